"""Per-step operations figures: MFU arithmetic, per-phase peak memory, profiler traces."""

from __future__ import annotations

import json

import torch
from transformers import Qwen2Config

from rlhf.ops.efficiency import EfficiencyMeter
from rlhf.ops.flops import model_flops_per_token
from rlhf.ops.memory import PeakMemory
from rlhf.ops.metrics import PhaseTimer
from rlhf.ops.profiler import PhaseRanges, StepProfiler

CFG = Qwen2Config(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)


def test_mfu_is_model_flops_over_time_and_roof():
    meter = EfficiencyMeter(CFG, torch.device("cpu"), torch.float32, world_size=1, ppo_epochs=2)
    meter.peak = 1e9  # a round roof, so the expected values are plain arithmetic
    out = meter.step_metrics(prompt_tokens=torch.tensor(60), response_tokens=torch.tensor(40), n_seqs=4,
                             times={"step": 2.0, "generate": 0.5, "update": 1.0}, peaks={"update": 2 ** 31},
                             dp_group=None)
    mean_len = 25  # (60 + 40) / 4
    gen = 40 * model_flops_per_token(CFG, mean_len, training=False)
    upd = 2 * 100 * model_flops_per_token(CFG, mean_len, training=True)
    assert out["perf/mfu/generate"] == gen / (0.5 * 1e9)
    assert out["perf/mfu/update"] == upd / (1.0 * 1e9)
    assert out["perf/tokens_per_s_per_device"] == 100 / 2.0
    assert out["perf/max_memory_gb/update"] == 2.0
    assert out["perf/attn_backend"] == 0.0 and out["perf/attn_backend_decode"] == 0.0  # CPU: the reference paths


def test_phase_peaks_are_per_phase_and_nested_phases_fold_into_the_outer_one():
    mem = PeakMemory(torch.device("cpu"))
    timer = PhaseTimer("cpu", listeners=[mem])
    with timer("small"):
        pass
    with timer("outer"):
        with timer("inner"):
            big = torch.ones(64 * 2 ** 20 // 4)  # 64 MiB, touched
            big += 1
            del big
    peaks = mem.pop()
    assert set(peaks) == {"small", "inner", "outer"}
    assert peaks["outer"] >= peaks["inner"]
    assert peaks["inner"] - peaks["small"] > 32 * 2 ** 20  # the 64 MiB shows in its phase only
    assert mem.pop() == {}


def test_profiled_step_writes_a_chrome_trace_with_the_phase_labels(tmp_path):
    prof = StepProfiler([2], tmp_path, rank=0, device=torch.device("cpu"))
    timer = PhaseTimer("cpu", listeners=[PhaseRanges(cuda=False, profiler=prof)])
    for step in (1, 2, 3):
        prof.begin(step)
        with timer("update"):
            torch.randn(32, 32) @ torch.randn(32, 32)
        prof.end()
    assert prof.written == [tmp_path / "profile" / "step_2" / "rank0.json"]
    names = {e.get("name") for e in json.loads(prof.written[0].read_text())["traceEvents"]}
    assert "update" in names and any("mm" in (n or "") for n in names)
