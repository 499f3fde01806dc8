"""One grad-norm helper for SFT and RL (rlhf.models.parallelize.clip_grad_norm_, wrapped by
rlhf.optim.clip_grad_norm): the norm is reduced on the compute device, never on the host
gradients of model.param_offload (NCCL cannot all-reduce CPU tensors)."""

from __future__ import annotations

import json

import pytest
import torch

from rlhf.models import parallelize
from rlhf.optim import clip_grad_norm


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(5, 3, generator=g)), torch.nn.Parameter(torch.randn(7, generator=g))]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g) * 3
    return ps


@pytest.mark.parametrize("max_norm", [1.0, 1e9])
def test_clip_grad_norm_equals_torchs(max_norm):
    a, b = _params(), _params()
    ref = torch.nn.utils.clip_grad_norm_(a, max_norm)
    got = clip_grad_norm(b, max_norm, device=torch.device("cpu"))
    torch.testing.assert_close(got, ref.float())
    for p, q in zip(a, b):
        torch.testing.assert_close(q.grad, p.grad)


def test_host_gradients_are_reduced_on_the_compute_device(monkeypatch):
    """Gradients on the host (offload), compute device "meta" standing in for CUDA: the one
    all-reduce gets a tensor on the compute device."""
    seen = []
    monkeypatch.setattr(parallelize.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(parallelize.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(parallelize.dist, "all_reduce", lambda t, group=None: seen.append(t.device))
    norm = parallelize.global_grad_norm(_params(), stage_ranks=2, device=torch.device("meta"))
    assert seen == [torch.device("meta")] and norm.device.type == "meta"


def test_sft_clips_with_the_trainer_helper_on_the_compute_device(tmp_path, monkeypatch):
    from rlhf.config import ModelConfig
    from rlhf.models.tiny import write_tiny_model
    from rlhf.sft import SFTConfig, SFTRunConfig, SFTSettings, run_sft

    def refuse(*a, **k):
        raise AssertionError("torch.nn.utils.clip_grad_norm_ all-reduces the grads' own (host) tensors")

    devices = []
    inner = parallelize.global_grad_norm
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", refuse)
    monkeypatch.setattr(parallelize, "global_grad_norm",
                        lambda params, **kw: devices.append(kw.get("device")) or inner(params, **kw))
    write_tiny_model(str(tmp_path / "m"), hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                     intermediate_size=64)
    (tmp_path / "sft.jsonl").write_text("\n".join(json.dumps({"prompt": "1+1=", "response": "2"}) for _ in range(4)))
    cfg = SFTConfig(model=ModelConfig(path=str(tmp_path / "m"), mixed_precision=False),
                    sft=SFTSettings(train_files=str(tmp_path / "sft.jsonl"), train_batch_size=4,
                                    micro_batch_size_per_gpu=4, max_length=64),
                    trainer=SFTRunConfig(output_dir=str(tmp_path / "out"), device="cpu", logger=[]))
    last = run_sft(cfg)
    assert devices == [torch.device("cpu")] and last["sft/grad_norm"] > 0
