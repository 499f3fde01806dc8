"""Host syncs in the update: none per micro-batch, a fixed few per mini-batch.

Reading a device tensor on the host (``.item()``, ``float()``, ``.tolist()``, ``bool()``)
waits for the GPU to drain its queue. The metric parts of every micro-batch used to be read
that way (``float()`` per metric, and inside the pipeline loss); they now accumulate on the
device and are read once. Counted by patching the Tensor methods that sync, for calls made
from the project's code (not from torch / transformers internals).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from rlhf.train.actor import MetricSums
from tests.dist._batches import random_rollout_batch

RLHF_DIR = str(Path(__file__).resolve().parents[2] / "rlhf")


@pytest.fixture
def host_reads(monkeypatch):
    """A list that gets one entry per host read of a tensor made by rlhf/ code."""
    seen: list[str] = []
    for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
        real = getattr(torch.Tensor, name)

        def counting(self, *args, _real=real, _name=name):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(RLHF_DIR):
                seen.append(f"{_name} {caller}:{sys._getframe(1).f_lineno}")
            return _real(self, *args)

        monkeypatch.setattr(torch.Tensor, name, counting)
    return seen


def test_metric_sums_read_the_device_once(host_reads):
    m = MetricSums.new(torch.device("cpu"))
    for k in range(5):  # five micro-batches' metric parts, weighted by their token counts
        w = torch.tensor(float(k + 1))
        m.add("actor/pg_loss", torch.tensor(0.5 * k), w)
        m.add("actor/pg_clipfrac", torch.tensor(0.1), w)
    m.add("actor/grad_norm", 2.0)
    assert host_reads == []
    out = m.reduce()
    assert len(host_reads) == 1 and host_reads[0].startswith("tolist"), host_reads
    assert out["actor/pg_loss"] == pytest.approx(sum(0.5 * k * (k + 1) for k in range(5)) / 15)
    assert out["actor/pg_clipfrac"] == pytest.approx(0.1) and out["actor/grad_norm"] == 2.0


@pytest.fixture(scope="module")
def worker(mesh, tmp_path_factory):
    from rlhf.models.tiny import write_tiny_model
    from rlhf.schema.config import ActorConfig, ModelConfig
    from rlhf.train.actor import PolicyWorker

    path = write_tiny_model(str(tmp_path_factory.mktemp("m") / "model"), hidden_size=32, num_layers=2,
                            intermediate_size=64)
    cfg = ActorConfig(lr=1e-4, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, use_kl_loss=True,
                      entropy_coeff=0.01, weight_decay=0.0)
    return PolicyWorker(ModelConfig(path=str(path)), mesh, torch.device("cpu"), actor_cfg=cfg, total_steps=4)


def test_update_reads_the_host_per_mini_batch_not_per_micro_batch(worker, host_reads):
    batch = random_rollout_batch(4, 2, 6, 8, worker.hf_config.vocab_size)  # 8 rows, two mini-batches of 4
    counts = {}
    for micro in (4, 1):  # 1 and 4 micro-batches per mini-batch
        worker.actor_cfg.ppo_micro_batch_size_per_gpu = micro
        host_reads.clear()
        worker.update_policy(batch, mini_batch_rows=4, temperature=1.0, max_response_length=8)
        counts[micro] = list(host_reads)
    assert len(counts[1]) == len(counts[4]), (counts[4], counts[1])
    # per epoch: the mini-batch counts; per mini-batch: the step decision; at the end: metrics and covariance
    assert len(counts[4]) <= 1 + 2 + 2, counts[4]
