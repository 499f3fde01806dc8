"""Shard first, then place (rlhf/models/shard_init.py), on 2 gloo ranks.

Every byte that reaches the rank's device goes through ``shard_init.place``; the test
counts them. Before the fix the whole model was moved to the device before ``fully_shard``
(one full copy per rank); now each rank places only its shards (FSDP2 over dp = 2, or TP
over tp = 2, or FSDP2 with CPU offload), never a whole parameter that is sharded, and the
sharded model holds the loaded weights exactly.
"""

from __future__ import annotations

import copy

import torch

from tests.dist._dist_utils import dist_device, dist_device_type, run_distributed


def _model(vocab: int) -> torch.nn.Module:
    from transformers import Qwen2ForCausalLM

    from rlhf.models.tiny import tiny_qwen2_config

    torch.manual_seed(0)
    # vocab 37: the embedding's rows split 19 / 18 (FSDP2 pads the second shard)
    return Qwen2ForCausalLM(tiny_qwen2_config(vocab, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                              intermediate_size=48))


def _check(rank: int, world: int, tmp: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    import rlhf.models.shard_init as shard_init
    from rlhf.models.parallel import to_mesh_device
    from rlhf.models.parallelize import parallelize_model
    from rlhf.rollout.reshard import gather_rollout_weights
    from rlhf.schema.config import ParallelConfig

    calls: list[int] = []
    real_place = shard_init.place

    def counting_place(piece, device, dtype=None):
        calls.append(piece.numel() * piece.element_size())
        return real_place(piece, device, dtype)

    shard_init.place = counting_place
    # FSDP2 over dp=2; TP over tp=2 (FSDP2 over dp=1); FSDP2 with CPU offload
    for dims, vocab, offload in (((1, 2, 1), 37, False), ((1, 1, 2), 38, False), ((1, 2, 1), 37, True)):
        calls.clear()
        model = _model(vocab)
        ref = copy.deepcopy(model)
        full = {n: p.detach().clone() for n, p in model.named_parameters()}
        total = sum(t.numel() * t.element_size() for t in full.values())
        mesh = init_device_mesh(dist_device_type(), dims, mesh_dim_names=("pp", "dp", "tp"))
        pm = parallelize_model(model, mesh, ParallelConfig(), dist_device(), param_offload=offload)
        params = dict(pm.module.named_parameters())
        local = sum(p.to_local().numel() * p.element_size() for p in params.values())
        assert sum(calls) == local, (dims, sum(calls), local)
        # Half the model per rank, plus what stays whole under TP (norms).
        replicated = sum(full[n].numel() * 4 for n, p in params.items() if p.to_local().numel() == full[n].numel())
        assert sum(calls) <= (total - replicated) / 2 + replicated + 64 * 4, (dims, sum(calls), total)
        assert max(calls) < max(t.numel() * 4 for t in full.values()), "a whole sharded parameter was placed"
        for n, p in params.items():
            assert isinstance(p, DTensor) and not p.is_meta, n
            assert p.device.type == ("cpu" if offload else dist_device_type()), (n, p.device)
            torch.testing.assert_close(to_mesh_device(p).full_tensor().cpu(), full[n], rtol=0, atol=0, msg=n)
        # Tied embedding / LM head: still one parameter.
        assert pm.module.lm_head.weight is pm.module.model.embed_tokens.weight
        ids = torch.randint(2, vocab, (2, 7), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            out = pm.module(input_ids=ids.to(dist_device())).logits
            out = out.full_tensor() if isinstance(out, DTensor) else out
            torch.testing.assert_close(out.cpu(), ref(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
        # The rollout reshard gathers them (under offload: moved to the mesh's device first).
        weights, _ = gather_rollout_weights(pm.module)
        for n, t in weights.items():
            torch.testing.assert_close(t.cpu(), full[n], rtol=0, atol=0, msg=n)
        # Training works on the placed shards (FSDP2 lazy init re-reads them).
        pm.module(input_ids=ids.to(dist_device())).logits.float().pow(2).mean().backward()
        assert all(p.grad is not None for p in params.values())
    shard_init.place = real_place
    _check_deferred_load(rank, world, tmp)  # in the same launch (process start-up is most of the cost)


def _check_deferred_load(rank: int, world: int, tmp: str) -> None:
    """``load_causal_lm(deferred=True)``: the shards equal today's loading (whole model in fp32, then
    sliced) exactly, for an fp32 checkpoint on dp 2 and a bf16 one on tp 2; each rank reads about half of
    the checkpoint's bytes, in its own dtype; ``model.load_ranks_per_node=1`` places one rank at a time."""
    import os
    import time

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import rlhf.models.shard_init as shard_init
    from rlhf.models.loading import load_causal_lm
    from rlhf.models.parallel import to_mesh_device
    from rlhf.models.parallelize import parallelize_model
    from rlhf.schema.config import ParallelConfig

    spans: list[tuple[float, float]] = []
    real = shard_init._materialize

    def timed(*a):
        t0 = time.monotonic()
        out = real(*a)
        spans.append((t0, time.monotonic()))
        return out

    shard_init._materialize = timed
    os.environ["LOCAL_WORLD_SIZE"] = str(world)  # one node: the stagger applies
    for dtype, dims in ((torch.float32, (1, 2, 1)), (torch.bfloat16, (1, 1, 2))):
        path = f"{tmp}/{str(dtype)[6:]}"
        saved = _model(38).to(dtype)
        # today's loading: from_pretrained in fp32 (bf16 values upcast exactly), then sliced
        full = {n: p.detach().float() for n, p in saved.named_parameters()}
        if rank == 0:
            saved.save_pretrained(path)
        dist.barrier()
        file_bytes = sum(f.stat().st_size for f in __import__("pathlib").Path(path).glob("*.safetensors"))
        mesh = init_device_mesh(dist_device_type(), dims, mesh_dim_names=("pp", "dp", "tp"))
        model = load_causal_lm(path, deferred=True)
        assert all(p.is_meta for p in model.parameters())
        index = next(model.parameters())._rlhf_source.index
        spans.clear()
        new = parallelize_model(model, mesh, ParallelConfig(), dist_device(), load_ranks_per_node=1).module
        for n, b in new.named_parameters():
            assert b.dtype == torch.float32 and b.to_local().numel() < full[n].numel() or b.dim() == 1, n
            torch.testing.assert_close(to_mesh_device(b).full_tensor().cpu(), full[n], rtol=0, atol=0, msg=n)
        # About half of the checkpoint per rank (norms and the header are read whole): not all of it.
        assert index.bytes_read < 0.6 * file_bytes, (dims, dtype, index.bytes_read, file_bytes)
        # Staggered: rank 0 placed its shards before rank 1 started.
        got = [None] * world
        dist.all_gather_object(got, spans[0])
        assert got[0][1] <= got[1][0], got


def test_each_rank_places_only_its_shards(tmp_path):
    run_distributed(_check, 2, str(tmp_path))
