"""FSDP2 updates on one GPU (nccl): bf16 mixed precision vs fp32, CPU offload vs none."""

from __future__ import annotations

import pytest
import torch

from rlhf.schema.config import ActorConfig, ModelConfig
from tests.dist._batches import random_rollout_batch
from tests.dist._dist_utils import DEVICE_ENV, run_distributed
from tests.gpu._gpu import GPU

pytestmark = GPU


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from rlhf.models.tiny import write_tiny_model

    return str(write_tiny_model(str(tmp_path_factory.mktemp("m") / "model"), hidden_size=128, num_layers=4))


def _update(rank: int, world: int, model_dir: str, out: str, mixed: bool, offload: bool) -> None:
    from rlhf.models.parallel import ParallelDims, to_mesh_device
    from rlhf.train.actor import PolicyWorker

    torch.backends.cuda.matmul.allow_tf32 = False
    mesh = ParallelDims.resolve(-1, 1, 1, world).build_mesh("cuda")
    torch.manual_seed(0)
    cfg = ActorConfig(lr=1e-3, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=8, use_kl_loss=True,
                      kl_loss_coef=0.1, entropy_coeff=0.01, grad_clip=1e9, weight_decay=0.0)
    worker = PolicyWorker(ModelConfig(path=model_dir, mixed_precision=mixed, param_offload=offload), mesh,
                          torch.device("cuda", 0), actor_cfg=cfg, total_steps=1)
    grads = {}
    step = worker.optimizer.step

    def recording_step(*a, **k):  # the gradients the (one) optimizer step is given
        for n, p in worker.model.named_parameters():
            if p.grad is not None:
                grads[n] = to_mesh_device(p.grad).full_tensor().float().cpu().clone()
        return step(*a, **k)

    worker.optimizer.step = recording_step
    before = {n: to_mesh_device(p).full_tensor().float().cpu().clone() for n, p in worker.model.named_parameters()}
    batch = random_rollout_batch(4, 4, 8, 16, worker.hf_config.vocab_size).to(torch.device("cuda", 0))
    metrics = worker.update_policy(batch, mini_batch_rows=16, temperature=1.0, max_response_length=16)
    after = {n: to_mesh_device(p).full_tensor().float().cpu().clone() for n, p in worker.model.named_parameters()}
    torch.save({"delta": {n: after[n] - before[n] for n in after}, "grads": grads, "metrics": metrics}, out)


def _run(model_dir, tmp_path, monkeypatch, name, **kw):
    monkeypatch.setenv(DEVICE_ENV, "cuda")
    out = str(tmp_path / f"{name}.pt")
    run_distributed(_update, 1, model_dir, out, kw["mixed"], kw["offload"])
    return torch.load(out)


def test_bf16_mixed_precision_update_tracks_fp32(model_dir, tmp_path, monkeypatch):
    ref = _run(model_dir, tmp_path, monkeypatch, "fp32", mixed=False, offload=False)
    bf16 = _run(model_dir, tmp_path, monkeypatch, "bf16", mixed=True, offload=False)
    # The gradients, not the AdamW update: a first AdamW step is lr x sign(g), so every small gradient whose
    # sign bf16 rounding flips moves by 2 lr (update cosine 0.889 on an H200, and 0.889 on the CPU with FSDP2
    # mixed precision forced on: the same program). The gradients differ by more than bf16 rounding because
    # this random batch is far off-policy (ppo_kl ~3): a token near the clip boundary flips in or out of it.
    assert set(bf16["grads"]) == set(ref["grads"]) and ref["grads"]
    a = torch.cat([g.flatten() for g in ref["grads"].values()])
    b = torch.cat([bf16["grads"][n].flatten() for n in ref["grads"]])
    cos = torch.nn.functional.cosine_similarity(a, b, dim=0).item()
    rel = ((a - b).norm() / a.norm()).item()
    print(f"bf16 vs fp32 gradient: cosine {cos:.5f}, relative error {rel:.4f} (CPU, forced: 0.977 / 0.21)")
    assert cos > 0.95 and rel < 0.35, (cos, rel)
    for k in ("actor/loss", "actor/ppo_kl"):  # (pg_loss / entropy are not update metrics)
        assert abs(ref["metrics"][k] - bf16["metrics"][k]) < 0.02 * max(1.0, abs(ref["metrics"][k])), k


def test_cpu_offload_update_equals_on_device(model_dir, tmp_path, monkeypatch):
    ref = _run(model_dir, tmp_path, monkeypatch, "dev", mixed=False, offload=False)
    off = _run(model_dir, tmp_path, monkeypatch, "off", mixed=False, offload=True)
    for n, d in ref["delta"].items():
        torch.testing.assert_close(off["delta"][n], d, atol=1e-6, rtol=1e-4, msg=n)


def _load_peak(rank: int, world: int, model_dir: str, out: str) -> None:
    from rlhf.models.parallel import ParallelDims
    from rlhf.train.actor import PolicyWorker

    mesh = ParallelDims.resolve(-1, 1, 1, world).build_mesh("cuda")
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    worker = PolicyWorker(ModelConfig(path=model_dir), mesh, torch.device("cuda", 0), trainable=False)
    model_bytes = sum(p.to_local().numel() * p.element_size() for p in worker.model.parameters())
    torch.save({"peak": torch.cuda.max_memory_allocated() - base, "model": model_bytes}, out)


def test_load_places_only_the_shards(model_dir, tmp_path, monkeypatch):
    """rlhf/models/shard_init.py: the loaded model stays on the host and only this rank's shards
    are copied to the GPU. Before, the whole model was moved to the GPU and then FSDP2 made its
    padded shard copies there: a peak of two models at load."""
    monkeypatch.setenv(DEVICE_ENV, "cuda")
    out = str(tmp_path / "peak.pt")
    run_distributed(_load_peak, 1, model_dir, out)
    r = torch.load(out)
    print(f"load peak {r['peak'] / 2**20:.1f} MiB for {r['model'] / 2**20:.1f} MiB of shards")
    assert r["peak"] <= 1.1 * r["model"] + 2**20, r


def _sft(rank: int, world: int, model_dir: str, data: str, out: str, offload: bool) -> None:
    from rlhf.train.sft import SFTConfig, SFTRunConfig, SFTSettings, run_sft

    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = SFTConfig(model=ModelConfig(path=model_dir, mixed_precision=False, param_offload=offload),
                    sft=SFTSettings(train_files=data, train_batch_size=4, micro_batch_size_per_gpu=2, max_length=64,
                                    grad_clip=0.5),
                    trainer=SFTRunConfig(output_dir=out, device="cuda", logger=[]))
    last = run_sft(cfg)
    if rank == 0:
        torch.save(last, out + ".pt")


def test_offloaded_sft_clips_like_on_device(model_dir, tmp_path, monkeypatch):
    """SFT with model.param_offload: the grad norm of host gradients is reduced on the GPU (one helper
    with the RL path); before, torch's clip_grad_norm_ all-reduced CPU tensors over NCCL. Two ranks
    when two GPUs are visible."""
    import json

    monkeypatch.setenv(DEVICE_ENV, "cuda")
    data = tmp_path / "sft.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"{i}+1=", "response": str(i + 1)}) for i in range(8)))
    world = 2 if torch.cuda.device_count() >= 2 else 1
    runs = {}
    for offload in (False, True):
        out = str(tmp_path / f"sft_{offload}")
        run_distributed(_sft, world, model_dir, str(data), out, offload)
        runs[offload] = torch.load(out + ".pt")
    for k in ("sft/loss", "sft/grad_norm"):
        assert abs(runs[True][k] - runs[False][k]) <= 1e-4 * max(1.0, abs(runs[False][k])), (k, runs)


def _offload_threads(rank: int, world: int, model_dir: str, out: str) -> None:
    import os

    from rlhf.train.actor import PolicyWorker
    from rlhf.models.parallel import ParallelDims

    mesh = ParallelDims.resolve(-1, 1, 1, world).build_mesh("cuda")
    before = torch.get_num_threads()  # 1: run_distributed's workers start as torchrun's do
    worker = PolicyWorker(ModelConfig(path=model_dir, param_offload=True), mesh, torch.device("cuda", 0),
                          actor_cfg=ActorConfig(), total_steps=1)
    groups = [g["foreach"] for g in worker.optimizer.param_groups]
    torch.save({"before": before, "after": torch.get_num_threads(), "cpus": len(os.sched_getaffinity(0)),
                "foreach": groups}, out)


def test_offloaded_optimizer_runs_multi_threaded_foreach(model_dir, tmp_path, monkeypatch):
    """model.param_offload: the host AdamW step gets this rank's share of the cores (torchrun's
    OMP_NUM_THREADS=1 left it single-threaded) and runs foreach, one group per mesh."""
    monkeypatch.setenv(DEVICE_ENV, "cuda")
    out = str(tmp_path / "threads.pt")
    run_distributed(_offload_threads, 1, model_dir, out)
    r = torch.load(out)
    assert r["before"] == 1 and r["after"] == max(1, r["cpus"]), r
    assert r["foreach"] and all(r["foreach"]), r
