"""Shard first, then place (rlhf/models/shard_init.py), on 2 gloo ranks.

Every byte that reaches the rank's device goes through ``shard_init.place``; the test
counts them. Before the fix the whole model was moved to the device before ``fully_shard``
(one full copy per rank); now each rank places only its shards (FSDP2 over dp = 2, or TP
over tp = 2), never a whole parameter that is sharded, and the sharded model holds the
loaded weights exactly.
"""

from __future__ import annotations

import copy

import torch

from tests.dist._dist_utils import run_distributed


def _model(vocab: int) -> torch.nn.Module:
    from transformers import Qwen2ForCausalLM

    from rlhf.models.tiny import tiny_qwen2_config

    torch.manual_seed(0)
    # vocab 37: the embedding's rows split 19 / 18 (FSDP2 pads the second shard)
    return Qwen2ForCausalLM(tiny_qwen2_config(vocab, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                              intermediate_size=48))


def _check(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    import rlhf.models.shard_init as shard_init
    from rlhf.config import ParallelConfig
    from rlhf.models.parallelize import parallelize_model

    calls: list[int] = []
    real_place = shard_init.place

    def counting_place(piece, device):
        calls.append(piece.numel() * piece.element_size())
        return real_place(piece, device)

    shard_init.place = counting_place
    for dims, vocab in (((1, 2, 1), 37), ((1, 1, 2), 38)):  # FSDP2 over dp=2; TP over tp=2 (FSDP2 over dp=1)
        calls.clear()
        model = _model(vocab)
        ref = copy.deepcopy(model)
        full = {n: p.detach().clone() for n, p in model.named_parameters()}
        total = sum(t.numel() * t.element_size() for t in full.values())
        mesh = init_device_mesh("cpu", dims, mesh_dim_names=("pp", "dp", "tp"))
        pm = parallelize_model(model, mesh, ParallelConfig(), torch.device("cpu"))
        params = dict(pm.module.named_parameters())
        local = sum(p.to_local().numel() * p.element_size() for p in params.values())
        assert sum(calls) == local, (dims, sum(calls), local)
        # Half the model per rank, plus what stays whole under TP (norms).
        replicated = sum(full[n].numel() * 4 for n, p in params.items() if p.to_local().numel() == full[n].numel())
        assert sum(calls) <= (total - replicated) / 2 + replicated + 64 * 4, (dims, sum(calls), total)
        assert max(calls) < max(t.numel() * 4 for t in full.values()), "a whole sharded parameter was placed"
        for n, p in params.items():
            assert isinstance(p, DTensor) and not p.is_meta, n
            torch.testing.assert_close(p.full_tensor(), full[n], rtol=0, atol=0, msg=n)
        # Tied embedding / LM head: still one parameter.
        assert pm.module.lm_head.weight is pm.module.model.embed_tokens.weight
        ids = torch.randint(2, vocab, (2, 7), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            out = pm.module(input_ids=ids).logits
            out = out.full_tensor() if isinstance(out, DTensor) else out
            torch.testing.assert_close(out, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
        # Training works on the placed shards (FSDP2 lazy init re-reads them).
        pm.module(input_ids=ids).logits.float().pow(2).mean().backward()
        assert all(p.grad is not None for p in params.values())


def test_each_rank_places_only_its_shards():
    run_distributed(_check, 2)
