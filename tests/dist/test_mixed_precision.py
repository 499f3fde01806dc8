"""FSDP2 mixed precision (bf16 compute, fp32 master weights and gradient reduce) on 2 gloo ranks.

``model.mixed_precision`` takes effect on CUDA only; a test adds "cpu" to
``rlhf.models.fsdp.MIXED_PRECISION_DEVICES`` to run the same policy over gloo: the blocks
compute in bf16, the sharded parameters and their gradients stay fp32, and one update
tracks the fp32 update (as tests/gpu/test_fsdp_gpu.py checks on a GPU).
"""

from __future__ import annotations

import torch

from tests.dist._batches import random_rollout_batch
from tests.dist._dist_utils import run_distributed


def _update(rank: int, world: int, model_dir: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    import rlhf.models.fsdp as fsdp
    from rlhf.schema.config import ActorConfig, ModelConfig
    from rlhf.train.actor import PolicyWorker

    fsdp.MIXED_PRECISION_DEVICES.add("cpu")
    res = {}
    for mixed in (False, True):
        mesh = init_device_mesh("cpu", (1, 2, 1), mesh_dim_names=("pp", "dp", "tp"))
        torch.manual_seed(0)
        cfg = ActorConfig(lr=1e-3, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, use_kl_loss=True,
                          kl_loss_coef=0.1, grad_clip=1e9, weight_decay=0.0)
        worker = PolicyWorker(ModelConfig(path=model_dir, mixed_precision=mixed), mesh, torch.device("cpu"),
                              actor_cfg=cfg, total_steps=1)
        seen = []
        block = worker.model.model.layers[0].mlp.down_proj
        block.register_forward_pre_hook(lambda m, args: seen.append((m.weight.dtype, args[0].dtype)))
        before = {n: p.full_tensor().clone() for n, p in worker.model.named_parameters()}
        batch = random_rollout_batch(4, 2, 6, 8, worker.hf_config.vocab_size)
        local = batch.select(list(range(4 * rank, 4 * rank + 4)))
        metrics = worker.update_policy(local, mini_batch_rows=4, temperature=1.0, max_response_length=8)
        res[mixed] = {"delta": {n: p.full_tensor() - before[n] for n, p in worker.model.named_parameters()},
                      "param_dtypes": {p.dtype for p in worker.model.parameters()}, "seen": set(seen),
                      "loss": metrics["actor/loss"]}
        # Gradients reach the optimizer in fp32 (reduced in fp32), next to fp32 master weights.
        ids = local.input_ids
        worker.model(input_ids=ids, attention_mask=local.attention_mask).logits.float().mean().backward()
        res[mixed]["grad_dtypes"] = {p.grad.dtype for p in worker.model.parameters()}
    torch.save(res, f"{out}.rank{rank}")


def test_bf16_compute_fp32_reduce_on_gloo_tracks_fp32(tmp_path):
    from rlhf.models.tiny import write_tiny_model

    model_dir = str(write_tiny_model(str(tmp_path / "m"), hidden_size=64, num_layers=2, intermediate_size=128))
    run_distributed(_update, 2, model_dir, str(tmp_path / "out"))
    res = torch.load(f"{tmp_path / 'out'}.rank0", weights_only=False)
    fp32, bf16 = res[False], res[True]
    assert fp32["seen"] == {(torch.float32, torch.float32)}
    assert bf16["seen"] == {(torch.bfloat16, torch.bfloat16)}  # the all-gathered weights and the activations
    assert bf16["param_dtypes"] == bf16["grad_dtypes"] == {torch.float32}
    a = torch.cat([d.flatten() for d in fp32["delta"].values()])
    b = torch.cat([bf16["delta"][n].flatten() for n in fp32["delta"]])
    assert not torch.equal(a, b)  # bf16 compute did change the numbers ...
    cos = torch.nn.functional.cosine_similarity(a, b, dim=0).item()
    assert cos > 0.98, cos  # ... but not the update
    assert abs(fp32["loss"] - bf16["loss"]) < 0.02 * max(1.0, abs(fp32["loss"]))
