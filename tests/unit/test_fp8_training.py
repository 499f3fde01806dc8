"""actor.fp8 (rlhf/models/fp8_training.py): torchao's float8 layers under the real PolicyWorker and FSDP2.

The CPU has ``torch._scaled_mm`` with tensor-wise scales, so the FP8 update runs here when the device
check is lifted (the trainer itself refuses actor.fp8 off sm89+: tests/unit/test_fp8.py)."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf.schema.config import ActorConfig
from tests.dist._batches import random_rollout_batch

pytest.importorskip("torchao.float8")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from rlhf.models.tiny import write_tiny_model

    return str(write_tiny_model(str(tmp_path_factory.mktemp("m") / "model"), hidden_size=64, num_layers=1,
                                intermediate_size=128))


def _update(mesh, path, batch, **fp8):
    from rlhf.rollout.reshard import gather_rollout_weights
    from rlhf.schema.config import ModelConfig
    from rlhf.train.actor import PolicyWorker

    torch.manual_seed(0)
    cfg = ActorConfig(lr=1e-3, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=4, log_prob_micro_batch_size_per_gpu=4,
                      clip_ratio=0.2, **fp8)
    w = PolicyWorker(ModelConfig(path=path, use_remove_padding=True), mesh, torch.device("cpu"), actor_cfg=cfg,
                     total_steps=2)
    batch.old_log_probs, _ = w.compute_log_probs(batch, temperature=1.0, micro_batch_size=4)
    metrics = w.update_policy(batch, mini_batch_rows=16, temperature=1.0, max_response_length=batch.response_length)
    weights, _ = gather_rollout_weights(w.model)  # the reshard sees the same HF names after the update
    return w, metrics, weights


@pytest.mark.parametrize("all_gather", [False, True])
def test_fp8_update_tracks_the_full_precision_update(mesh, model_path, monkeypatch, all_gather):
    from torchao.float8.float8_linear import Float8Linear

    batch = random_rollout_batch(4, 4, 6, 8, 64, seed=5)
    _, ref_metrics, ref_weights = _update(mesh, model_path, batch)
    monkeypatch.setattr("rlhf.models.fp8_training.supports_fp8", lambda device: True)
    w, metrics, weights = _update(mesh, model_path, batch, fp8=True, fp8_all_gather=all_gather)
    layers = [m for m in w.model.modules() if isinstance(m, Float8Linear)]
    assert len(layers) == 7  # q k v o gate up down; the LM head stays in high precision
    assert 0.5 < metrics["perf/fp8"] < 1 and "perf/fp8" not in ref_metrics
    assert math.isclose(metrics["actor/grad_norm"], ref_metrics["actor/grad_norm"], rel_tol=0.05)
    assert weights.keys() == ref_weights.keys()
    for name, t in weights.items():  # one step of lr 1e-3 from the same start: the FP8 step lands nearby
        torch.testing.assert_close(t, ref_weights[name], rtol=0, atol=2e-3, msg=name)
