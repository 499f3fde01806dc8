"""Gradient accumulation over micro-batches on 2 gloo ranks (FSDP2 over dp = 2).

By default FSDP2 reduce-scatters after every micro-batch, so no rank holds the unsharded
gradients of its model between micro-batches (before the fix: +4 bytes per parameter, the
unsharded fp32 gradients of the whole model, from the first micro-batch to the last).
``model.unsharded_grad_accumulation`` restores the no-sync accumulation; both give the same
update. ``model.fsdp_unit: model`` (the whole model as one FSDP2 unit, auto for small models)
gives the same update with one all-gather and one reduce-scatter per micro-batch, not one per
block in forward, again in backward, and per block in the reduce.
"""

from __future__ import annotations

import torch

from bench.update_fixed_costs import count_fsdp_collectives
from tests.dist._batches import random_rollout_batch
from tests.dist._dist_utils import run_distributed


def held_unsharded_grad_bytes(model: torch.nn.Module) -> int:
    """Bytes of unsharded gradients FSDP2 keeps between backward passes (reads its internals)."""
    from torch.distributed.fsdp import FSDPModule

    total = 0
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        for group in m._get_fsdp_state()._fsdp_param_groups:
            for fp in group.fsdp_params:
                for g in (fp.unsharded_accumulated_grad, getattr(fp, "_unsharded_param", None)):
                    g = g.grad if isinstance(g, torch.nn.Parameter) else g
                    if g is not None:
                        total += g.numel() * g.element_size()
    return total


def _update(rank: int, world: int, model_dir: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from rlhf.schema.config import ActorConfig, ModelConfig
    from rlhf.train.actor import PolicyWorker

    result = {}
    counts = count_fsdp_collectives()
    for no_sync, unit in ((False, "block"), (True, "block"), (False, "model")):
        mesh = init_device_mesh("cpu", (1, 2, 1), mesh_dim_names=("pp", "dp", "tp"))
        torch.manual_seed(0)
        cfg = ActorConfig(lr=1e-3, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, grad_clip=1e9,
                          weight_decay=0.0)
        worker = PolicyWorker(ModelConfig(path=model_dir, unsharded_grad_accumulation=no_sync, fsdp_unit=unit), mesh,
                              torch.device("cpu"), actor_cfg=cfg, total_steps=1)
        held: list[int] = []
        forward = worker.forward_log_probs

        def watched(*args, **kw):
            held.append(held_unsharded_grad_bytes(worker.model))  # what the previous micro-batches left
            return forward(*args, **kw)

        worker.forward_log_probs = watched
        batch = random_rollout_batch(4, 2, 6, 8, worker.hf_config.vocab_size)  # 8 rows: 4 per rank, 2 micro-batches
        local = batch.select(list(range(4 * rank, 4 * rank + 4)))
        local.old_log_probs = local.rollout_log_probs.clone()
        counts.update(all_gather=0, reduce_scatter=0)
        worker.update_policy(local, mini_batch_rows=4, temperature=1.0, max_response_length=8)
        # After the update every parameter is this rank's shard again (none left gathered).
        assert all(isinstance(p, DTensor) for p in worker.model.parameters())
        params = {n: p.full_tensor().clone() for n, p in worker.model.named_parameters()}
        result[(no_sync, unit)] = {"held": held, "collectives": dict(counts), "params": params,
                                   "model_bytes": sum(p.numel() * p.element_size() for p in worker.model.parameters())}
    torch.save(result, f"{out}.rank{rank}")


def test_sync_every_micro_batch_holds_no_unsharded_grads_and_updates_the_same(tmp_path):
    from rlhf.models.tiny import write_tiny_model

    model_dir = str(write_tiny_model(str(tmp_path / "m"), hidden_size=32, num_layers=2, num_heads=4,
                                     intermediate_size=64))
    run_distributed(_update, 2, model_dir, str(tmp_path / "out"))
    for rank in range(2):
        res = torch.load(f"{tmp_path / 'out'}.rank{rank}", weights_only=False)
        sync, no_sync, whole = res[(False, "block")], res[(True, "block")], res[(False, "model")]
        assert len(sync["held"]) == 2 and sync["held"] == [0, 0], sync["held"]
        # The opt-in path does hold them: the whole model's unsharded gradients, fp32.
        assert no_sync["held"][0] == 0 and no_sync["held"][1] >= 0.9 * no_sync["model_bytes"], no_sync["held"]
        for n, p in sync["params"].items():
            torch.testing.assert_close(p, no_sync["params"][n], rtol=1e-5, atol=1e-6, msg=n)
            # Same collectives' maths on fewer, larger tensors: bit for bit.
            assert torch.equal(p, whole["params"][n]), n
        assert whole["held"] == [0, 0], whole["held"]
        # 2 micro-batches: per block and root, gather in forward and again in backward; the whole
        # model: one gather per forward (kept for its backward) and one reduce-scatter per backward.
        assert sync["collectives"] == {"all_gather": 12, "reduce_scatter": 6}, sync["collectives"]
        assert whole["collectives"] == {"all_gather": 2, "reduce_scatter": 2}, whole["collectives"]
