"""One grad-norm helper for SFT and RL (rlhf.models.parallelize.clip_grad_norm_, wrapped by
rlhf.train.optim.clip_grad_norm): the norm is reduced on the compute device, never on the host
gradients of model.param_offload (NCCL cannot all-reduce CPU tensors)."""

from __future__ import annotations

import json

import pytest
import torch

from rlhf.models import parallelize
from rlhf.train.optim import clip_grad_norm


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
    from rlhf.schema.config import ModelConfig
    from rlhf.models.tiny import write_tiny_model
    from rlhf.train.sft import SFTConfig, SFTRunConfig, SFTSettings, run_sft

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


# ---------------------------------------------------------------- one foreach group per mesh (AdamW, grad norm)


def _mesh_params(mesh):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    g = torch.Generator().manual_seed(3)
    plain = torch.nn.Parameter(torch.randn(4, 3, generator=g))
    a = torch.nn.Parameter(distribute_tensor(torch.randn(6, 4, generator=g), mesh["dp"], [Shard(0)]))
    b = torch.nn.Parameter(distribute_tensor(torch.randn(8, generator=g), mesh["dp", "tp"], [Shard(0), Replicate()]))
    c = torch.nn.Parameter(distribute_tensor(torch.randn(5, generator=g), mesh["dp"], [Shard(0)]))
    return [plain, a, b, c]


def test_adamw_runs_one_foreach_group_per_mesh_and_equals_the_per_parameter_loop(mesh):
    from rlhf.train.optim import build_optimizer, foreach_groups

    ps = _mesh_params(mesh)
    groups = foreach_groups(ps)
    assert [[id(p) for p in grp] for grp in groups] == [[id(ps[0])], [id(ps[1]), id(ps[3])], [id(ps[2])]]
    ref_ps = _mesh_params(mesh)
    opt = build_optimizer(ps, lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(ref_ps, lr=1e-2, weight_decay=0.1, foreach=False)
    assert all(grp["foreach"] for grp in opt.param_groups) and len(opt.param_groups) == 3
    for step in range(3):
        for p, q in zip(ps, ref_ps):
            g = torch.randn(p.shape, generator=torch.Generator().manual_seed(step))
            p.grad = q.grad = None
            if hasattr(p, "device_mesh"):
                from torch.distributed.tensor import distribute_tensor

                p.grad = distribute_tensor(g, p.device_mesh, p.placements)
                q.grad = distribute_tensor(g, q.device_mesh, q.placements)
            else:
                p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    for p, q in zip(ps, ref_ps):
        a, b = (t.full_tensor() if hasattr(t, "full_tensor") else t for t in (p.detach(), q.detach()))
        assert torch.equal(a, b)


def test_grad_norm_over_meshes_is_one_foreach_norm_per_group(mesh, monkeypatch):
    ps = _mesh_params(mesh)
    for p in ps:
        p.grad = torch.ones_like(p) * 2
    calls = []
    real = torch._foreach_norm
    monkeypatch.setattr(torch, "_foreach_norm", lambda ts, *a, **k: calls.append(len(ts)) or real(ts, *a, **k))
    norm = parallelize.global_grad_norm(ps, stage_ranks=1)
    n = 12 + 24 + 8 + 5
    torch.testing.assert_close(norm, torch.tensor(2.0 * n ** 0.5))
    assert sorted(calls) == [4]  # one fp32 group on the host: one call, no per-parameter loop


def test_optimizer_state_with_one_group_per_mesh_round_trips_the_checkpoint(mesh):
    """rlhf.checkpoint.ModelOptimState flattens the optimizer state per parameter: several param
    groups save and load as one did (and a state saved from one group loads into several)."""
    import copy

    from rlhf.train.checkpoint import ModelOptimState
    from rlhf.train.optim import build_optimizer

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            ps = _mesh_params(mesh)
            self.plain, self.a, self.b, self.c = ps

    def trained(opt_fn):
        m = M()
        opt = opt_fn(m)
        for p in m.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        return m, opt

    m, opt = trained(lambda m: build_optimizer(m.parameters(), lr=1e-2, weight_decay=0.1))
    one, one_opt = trained(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, foreach=False))
    for src, src_opt in ((m, opt), (one, one_opt)):
        sd = copy.deepcopy(ModelOptimState(src, src_opt).state_dict())
        fresh = M()
        fresh_opt = build_optimizer(fresh.parameters(), lr=1e-2, weight_decay=0.1)
        ModelOptimState(fresh, fresh_opt).load_state_dict(sd)
        for p, q in zip(fresh.parameters(), src.parameters()):
            st_p, st_q = fresh_opt.state[p], src_opt.state[q]
            for k in ("exp_avg", "exp_avg_sq"):
                a, b = (t.full_tensor() if hasattr(t, "full_tensor") else t for t in (st_p[k], st_q[k]))
                assert torch.equal(a, b), k


# ---------------------------------------------------------------- host optimizer threads under param_offload


def test_offload_threads_give_each_local_rank_its_share_of_the_cores():
    from rlhf.models.fsdp import offload_threads

    assert offload_threads(cpu_count=192, local_world_size=8, current=1) == 24  # torchrun's OMP_NUM_THREADS=1
    assert offload_threads(cpu_count=192, local_world_size=8, current=32) == 32  # never lowered
    assert offload_threads(cpu_count=4, local_world_size=8, current=1) == 1


def test_offloaded_fsdp_on_cuda_sets_the_threads(monkeypatch):
    """apply_fsdp(param_offload=True) on a GPU run sets this rank's threads (seam: the placement
    and sharding are stubbed, the device is only named)."""
    from rlhf.models import fsdp

    set_to = []
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(fsdp.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setattr(fsdp.torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(fsdp.torch, "set_num_threads", set_to.append)
    monkeypatch.setattr(fsdp, "fully_shard", lambda module, **kw: module)
    monkeypatch.setattr(fsdp, "materialize_shards", lambda *a: None)
    monkeypatch.setattr(fsdp, "CPUOffloadPolicy", lambda **kw: None)
    monkeypatch.setattr(fsdp, "decoder_layers", lambda model: [])
    fsdp.apply_fsdp(torch.nn.Linear(2, 2), None, device=torch.device("cuda"), mixed_precision=False,
                    param_offload=True, host={})
    assert set_to == [8]


# ---------------------------------------------------------------- tied embedding / lm_head grads under offload


class _StrictDevices(torch.overrides.TorchFunctionMode):
    """Refuses what CUDA refuses: an op (other than a copy or move) mixing tensors of two devices;
    "meta" stands in for the GPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in (torch.Tensor.to, torch.Tensor.copy_):
            leaves = torch.utils._pytree.tree_leaves((args, kwargs))
            devices = {t.device for t in leaves if isinstance(t, torch.Tensor) and t.dim() > 0}
            if len(devices) > 1:
                raise RuntimeError(f"{func}: tensors on {sorted(map(str, devices))}")
        return func(*args, **kwargs)


def test_tied_grads_on_the_host_are_summed_on_the_compute_device():
    from rlhf.models.pipeline import tied_grad_sum

    grads = [torch.ones(4, 3), torch.full((4, 3), 2.0)]  # embedding and lm_head grads, offloaded
    with _StrictDevices():
        total = tied_grad_sum(grads, (4, 3), torch.device("meta"))
    assert total.device.type == "meta" and total.shape == (4, 3)
    torch.testing.assert_close(tied_grad_sum(grads, (4, 3), torch.device("cpu")), torch.full((4, 3), 3.0))


def test_clipping_scales_local_shards_with_one_foreach_mul_and_equals_the_per_parameter_loop(mesh, monkeypatch):
    ps, ref = _mesh_params(mesh), _mesh_params(mesh)
    for p, q in zip(ps, ref):
        p.grad = p.detach() * 3.0
        q.grad = q.detach() * 3.0
    calls = []
    real = torch._foreach_mul_
    monkeypatch.setattr(torch, "_foreach_mul_", lambda ts, s: calls.append(len(ts)) or real(ts, s))
    norm = parallelize.clip_grad_norm_(ps, 0.5, stage_ranks=1)
    coef = (0.5 / (norm + 1e-6)).clamp(max=1.0)
    for q in ref:
        q.grad.mul_(coef)  # the per-parameter (DTensor) loop it replaces
    assert calls == [4]  # one call for all four parameters' local shards
    full = [[t.full_tensor() if hasattr(t, "full_tensor") else t for t in (p.grad, q.grad, q.detach() * 3.0)]
            for p, q in zip(ps, ref)]
    assert all(torch.equal(a, b) and not torch.equal(b, unscaled) for a, b, unscaled in full)
