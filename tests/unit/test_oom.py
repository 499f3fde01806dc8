"""Out-of-memory records: which budgets are halved, how often, and when to give up."""

from __future__ import annotations

import pytest
import torch

from rlhf.ops.metrics import PhaseTimer
from rlhf.ops.oom import InjectedOom, apply_oom_records, record_oom
from rlhf.schema.config import Config, ConfigError


def cfg_at(tmp_path) -> Config:
    cfg = Config()
    cfg.trainer.output_dir = str(tmp_path)
    return cfg


def test_records_halve_the_phase_knobs_once_per_attempt(tmp_path):
    line = record_oom(tmp_path, rank=0, phase="update", step=3, attempt=0)
    record_oom(tmp_path, rank=1, phase="update", step=3, attempt=0)  # two ranks, one attempt
    record_oom(tmp_path, rank=1, phase="rollout", step=5, attempt=1)
    assert "rank 0 ran out of memory in phase 'update' of step 3" in line
    assert "actor.ppo_micro_batch_size_per_gpu" in line
    cfg = cfg_at(tmp_path)
    cfg.actor.ppo_micro_batch_size_per_gpu, cfg.actor.ppo_max_token_len_per_gpu = 8, 16384
    cfg.rollout.max_num_seqs, cfg.rollout.kv_cache_tokens, cfg.rollout.kv_cache_memory = 256, 0, 3.0
    assert apply_oom_records(cfg, max_retries=3) == 2
    assert (cfg.actor.ppo_micro_batch_size_per_gpu, cfg.actor.ppo_max_token_len_per_gpu) == (4, 8192)
    assert (cfg.rollout.max_num_seqs, cfg.rollout.kv_cache_tokens) == (128, 0)  # 0 = derived, left alone
    assert (cfg.rollout.kv_cache_memory, cfg.rollout.prefill_tokens) == (1.5, 4096)
    assert cfg.actor.log_prob_micro_batch_size_per_gpu == Config().actor.log_prob_micro_batch_size_per_gpu


def test_more_retries_than_allowed_is_one_line_naming_the_knobs(tmp_path):
    for attempt in range(3):
        record_oom(tmp_path, rank=0, phase="logprobs", step=1, attempt=attempt)
    with pytest.raises(ConfigError, match="trainer.max_oom_retries=2: lower actor.log_prob_max_token_len_per_gpu"):
        apply_oom_records(cfg_at(tmp_path), max_retries=2)


def test_injected_oom_fires_once_in_its_phase_and_step(monkeypatch):
    monkeypatch.setenv("RLHF_TEST_OOM", "update:2")
    hook = InjectedOom.from_env(rank=0)
    timer = PhaseTimer("cpu", listeners=[hook])
    timer.step = 1
    with timer("update"):
        pass
    timer.step = 2
    with pytest.raises(torch.OutOfMemoryError):
        with timer("update"):
            pass
    assert timer.failed_phase == "update"
    timer.pop()
    assert timer.failed_phase is None
    with timer("update"):
        pass
    assert InjectedOom.from_env(rank=1).armed is False
