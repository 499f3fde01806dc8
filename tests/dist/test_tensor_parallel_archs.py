"""TP x FSDP2 plans of Gemma 2, Gemma 3, Phi-3 and Qwen3-MoE (experts over tp) against one process, on 4
gloo ranks: logits, the loss and every parameter's gradient."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from rlhf.models.pipeline import positions_from_mask
from rlhf.models.tensor_parallel import apply_tp
from tests._archs import ARCHS, tiny_model
from tests.dist._dist_utils import run_distributed
from tests.dist.test_tensor_parallel import _batch, _full, _rl_loss, _sum_dp_grads

ATOL = 2e-5


def _check(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    ids, mask = _batch()
    pos = positions_from_mask(mask)
    n_tokens = int(mask[:, 1:].sum())
    rows = slice(2 * dp_rank, 2 * dp_rank + 2)
    for kind in ARCHS:
        ref = tiny_model(kind)
        model = copy.deepcopy(ref)
        apply_tp(model, mesh["tp"], loss_parallel=True)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        _sum_dp_grads(model)

        ref_logits = ref(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        _rl_loss(ref_logits, ids, mask, n_tokens).backward()
        logits = model(input_ids=ids[rows], attention_mask=mask[rows], position_ids=pos[rows]).logits
        assert isinstance(logits, DTensor) and logits.to_local().shape[-1] == 32, kind
        torch.testing.assert_close(logits.full_tensor(), ref_logits[rows], atol=ATOL, rtol=0, msg=kind)
        loss = _rl_loss(logits, ids[rows], mask[rows], n_tokens)
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total, group=mesh["dp"].get_group())
        torch.testing.assert_close(total, _rl_loss(ref_logits.detach(), ids, mask, n_tokens), atol=ATOL, rtol=0)
        ref_params = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            if kind == "qwen3_moe" and ".experts." in name:  # 8 experts: 4 per tp rank, 2 per (tp, dp) rank
                assert p.to_local().shape[0] == 2, (name, p.placements)
            torch.testing.assert_close(_full(p.grad), ref_params[name].grad, atol=ATOL, rtol=1e-4,
                                       msg=f"{kind} grad {name}")


def test_tp2_dp2_new_architectures_match_single_process() -> None:
    run_distributed(_check, 4)
