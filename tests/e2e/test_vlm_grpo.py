"""GRPO end to end on a tiny random Qwen2.5-VL with images in verl's schema (1 CPU process): the
built-in sampler runs the vision tower and M-RoPE, and its log-probs equal the trainer's recomputed
ones on image prompts (``rollout/logprob_diff_max``: a sampler that ignored the images, or placed
them at the wrong rotary positions, would be off by ~1e-1). The same run's HF export and its checkpoint
exported offline load in transformers with the processor, and ``python -m rlhf.eval`` samples with images.
The one_step_off and fully_async runs carry the images across their exchanges; a LoRA run exports merged;
tool turns run on image prompts (``rollout.multi_turn``)."""

from __future__ import annotations

import pytest
import torch

from tests.e2e.conftest import run_script, run_script_many, train_steps

pytest.importorskip("PIL")

REWARD = '''
def char_parity(data_source, solution_str, ground_truth, extra_info=None):
    return float(sum(map(ord, solution_str)) % 2)  # varied over a random model's samples
'''


def _assets(root):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    from rlhf.models.tiny_vlm import write_tiny_vlm

    write_tiny_vlm(str(root / "model"), "qwen2_5_vl")
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(4):  # three image prompts and a text-only one
        im = Image.fromarray((torch.rand(16 + 8 * (i % 2), 16, 3, generator=g) * 255).byte().numpy())
        im.save(root / f"im{i}.png")
        text, images = (f"text only {i}", []) if i == 3 else (f"<image>What is {i}?", [{"bytes": None,
                                                                                    "path": f"im{i}.png"}])
        rows.append({"prompt": [{"role": "user", "content": text}], "images": images, "data_source": "t",
                     "reward_model": {"ground_truth": str(i)}})
    pq.write_table(pa.Table.from_pylist(rows), root / "train.parquet")
    (root / "reward.py").write_text(REWARD)


@pytest.fixture(scope="module")
def vlm_run(tmp_path_factory):
    """One 2-step GRPO run (checkpoint at step 2, HF export at the end) shared by the tests below, and in the
    same interpreter a 1-step LoRA run (checkpoint and merged HF export) in ``out_lora`` and a 2-step run
    with the calculator on a tool-calling tiny VLM in ``tools/out``."""
    from tests._assets import write_tool_vlm_assets

    tmp_path = tmp_path_factory.mktemp("vlm_grpo")
    _assets(tmp_path)
    tools = write_tool_vlm_assets(tmp_path / "tools")
    full = _args(tmp_path, tmp_path / "out", steps=2) + ["checkpoint.save_freq=2"]
    lora = _args(tmp_path, tmp_path / "out_lora", steps=1) + ["checkpoint.save_freq=1", "model.lora_rank=4",
                                                              "model.lora_alpha=8", "actor.lr=1e-2"]
    agent = {"model.path": tools / "tool_vlm", "data.train_files": tools / "train.parquet",
             "data.max_response_length": 128, "checkpoint.export_hf": False, "reward.reward_fn": "gsm8k",
             "rollout.multi_turn.enable": True, "rollout.multi_turn.tool_config_path": tools / "tools.yaml",
             "rollout.multi_turn.num_workers": 0}
    agent = _args(tmp_path, tools / "out", steps=2) + [f"{k}={v}" for k, v in agent.items()]
    for r in run_script_many("train_grpo.py", [full, lora, agent]):
        assert r.returncode == 0, r.stderr[-3000:]
    return tmp_path


def _args(root, out, steps: int) -> list[str]:
    args = {"model.path": root / "model", "data.train_files": root / "train.parquet", "data.val_files": "",
            "data.max_prompt_length": 48, "data.max_response_length": 8, "data.train_batch_size": 4,
            "rollout.n": 2, "actor.ppo_mini_batch_size": 4, "actor.ppo_micro_batch_size_per_gpu": 4,
            "actor.lr": 1e-3, "trainer.device": "cpu", "trainer.output_dir": out,
            "trainer.total_training_steps": steps,
            "reward.reward_fn": f"{root / 'reward.py'}:char_parity", "reward.num_workers": 0}
    return [f"{k}={v}" for k, v in args.items()]


def test_vlm_grpo_steps_run_on_the_sampler_with_images(vlm_run):
    tmp_path = vlm_run
    steps = train_steps(tmp_path / "out" / "metrics.jsonl")
    assert sorted(steps) == [1, 2]
    for m in steps.values():
        assert m["rollout/logprob_diff_max"] < 1e-4, m["rollout/logprob_diff_max"]
        assert m["rollout/tokens_generated"] > 0 and m["actor/grad_norm"] > 0


def test_vlm_grpo_with_tools_on_image_prompts(vlm_run):
    """``rollout.multi_turn`` on a VLM: the agent loop's tool turns append observations to rows whose prompts
    carry images (batches mix image and text-only prompts); the trainer takes the stitched trajectories
    with the rows' images (observation tokens out of the loss, M-RoPE positions over the whole trajectory)
    and its log-probs equal the sampler's: a turn resumed at the wrong rotary positions is off by ~1."""
    steps = train_steps(vlm_run / "tools" / "out" / "metrics.jsonl")
    assert sorted(steps) == [1, 2]
    for m in steps.values():
        assert m["agent/tool_calls_per_traj"] > 0.5 and m["agent/observation_tokens_per_traj"] > 1
        assert m["agent/turns_per_traj"] > 1
        assert m["rollout/logprob_diff_max"] < 1e-4, m["rollout/logprob_diff_max"]


def test_vlm_export_and_eval(vlm_run, tmp_path):
    """The run's HF export and ``python -m rlhf.checkpoint export`` of its checkpoint load in transformers
    with their processor and hold the same trained weights; ``python -m rlhf.eval`` samples with images."""
    import json
    import subprocess
    import sys

    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    from rlhf.export import export_checkpoint
    from rlhf.models.processor import load_processor
    from tests.e2e.conftest import ROOT

    run = vlm_run
    ckpt = run / "out" / "checkpoints" / "global_step_2"
    exported = export_checkpoint(ckpt, tmp_path / "from_ckpt")
    init = dict(AutoModelForImageTextToText.from_pretrained(run / "model").named_parameters())
    models = [dict(AutoModelForImageTextToText.from_pretrained(d).named_parameters())
              for d in (run / "out" / "hf_export", exported)]
    for name, p in models[0].items():
        torch.testing.assert_close(models[1][name], p, rtol=0, atol=0, msg=name)
    assert any(not torch.equal(p, init[n]) for n, p in models[0].items() if n.startswith("model.visual."))
    for d in (run / "out" / "hf_export", exported):
        assert AutoImageProcessor.from_pretrained(d).merge_size == 2
        proc = load_processor(str(d))
        out = proc(text=["<|user|><|vision_start|><|image_pad|><|vision_end|>?"],
                   images=[Image.new("RGB", (16, 16))], return_tensors="pt")
        assert out["image_grid_thw"].tolist() == [[1, 4, 4]]  # 16 px / patch 4: the tiny model's processor
    r = subprocess.run([sys.executable, "-m", "rlhf.eval", "--model", str(ckpt), "--data",
                        str(run / "train.parquet"), "--max-new-tokens", "4", "--max-prompt-length", "48",
                        "--reward", f"{run / 'reward.py'}:char_parity", "--reward-workers", "0", "--device", "cpu",
                        "--out", str(tmp_path / "eval")], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "eval" / "generations.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and sum("<|image_pad|>" in row["prompt"] for row in rows) == 3


def test_vlm_lora_export_loads_with_its_processor(vlm_run, tmp_path):
    """A LoRA run of a VLM: its merged HF export and ``python -m rlhf.checkpoint export`` of its checkpoint
    (the base rebuilt as the VLM class, adapters re-applied and merged) load in transformers with the
    processor and hold the same weights; the adapters moved the language model only (the tower is frozen)."""
    from transformers import AutoModelForImageTextToText

    from rlhf.export import export_checkpoint
    from rlhf.models.processor import load_processor

    out = vlm_run / "out_lora"
    exported = export_checkpoint(out / "checkpoints" / "global_step_1", tmp_path / "lora")
    assert (exported / "adapter").is_dir() and (out / "hf_export" / "adapter").is_dir()
    init = dict(AutoModelForImageTextToText.from_pretrained(vlm_run / "model").named_parameters())
    merged, offline = (dict(AutoModelForImageTextToText.from_pretrained(d).named_parameters())
                       for d in (out / "hf_export", exported))
    assert set(merged) == set(offline) == set(init)
    for name, p in merged.items():
        torch.testing.assert_close(offline[name], p, rtol=0, atol=0, msg=name)
        adapted = "language_model.layers." in name and name.endswith("proj.weight")  # LoRA's targets
        assert torch.equal(p, init[name]) != adapted, name
    assert load_processor(str(exported)).image_processor.merge_size == 2


def test_one_step_off_carries_the_images_to_the_training_rank(vlm_run, tmp_path):
    """trainer.mode=one_step_off (1 rollout + 1 training rank): the batch and its pixel values cross in the
    exchange, so step 1 (generated by the initial weights, like the colocated run's) equals the colocated
    step 1. Without the images the trainer's log-probs would be off by ~1 (``rollout/logprob_diff_max``)."""
    out = tmp_path / "one_step_off"
    r = run_script("train_grpo.py", _args(vlm_run, out, steps=1) + ["trainer.mode=one_step_off",
                                                                     "actor.tis_imp_ratio_cap=2.0"], nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    got, want = train_steps(out / "metrics.jsonl")[1], train_steps(vlm_run / "out" / "metrics.jsonl")[1]
    assert got["rollout/logprob_diff_max"] < 1e-4, got["rollout/logprob_diff_max"]
    for key in ("reward/mean", "response_length/mean", "actor/entropy", "actor/grad_norm", "actor/loss"):
        assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key


def test_fully_async_streams_the_images_to_the_training_rank(vlm_run, tmp_path):
    """trainer.mode=fully_async at staleness 0 (1 rollout + 1 training rank): the streaming sampler runs the
    tower on each admitted prompt's images and its groups carry the pixel values to the training leader, so
    both steps equal the colocated run's (step 2's rollout runs the tower of the pushed weights)."""
    out = tmp_path / "fully_async"
    r = run_script("train_grpo.py", _args(vlm_run, out, steps=2) + ["trainer.mode=fully_async"], nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    got, want = train_steps(out / "metrics.jsonl"), train_steps(vlm_run / "out" / "metrics.jsonl")
    assert sorted(got) == [1, 2]
    for step in (1, 2):
        assert got[step]["rollout/logprob_diff_max"] < 1e-4, (step, got[step]["rollout/logprob_diff_max"])
        for key in ("reward/mean", "response_length/mean", "actor/entropy", "actor/grad_norm", "actor/loss"):
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-4, abs=1e-6), (step, key)
