"""Training layout -> rollout layout: every rollout parameter is the exact slice of the full one.

One 4-rank gloo run walks through the layouts (training pp x dp x tp -> rollout tp); for
each, every rank's rollout weights must equal ``rollout_slice(full HF parameter)``
bit for bit, hold no more than the rollout slice, and count the bytes it received.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist._dist_utils import dist_device, dist_device_type, run_distributed

# (pp, dp, tp, rollout_tp)
LAYOUTS = [
    (1, 4, 1, 1),  # dp4
    (1, 4, 1, 2),  # dp4 -> rollout tp2 (slice of the full tensor)
    (1, 2, 2, 2),  # dp2 x tp2 -> rollout tp2 (the training TP shard is kept: dp gather only)
    (1, 2, 2, 1),  # dp2 x tp2 -> rollout tp1
    (2, 2, 1, 1),  # pp2 x dp2
    (2, 2, 1, 2),  # pp2 x dp2 -> rollout tp2 (stages slice, then broadcast)
    (2, 1, 2, 2),  # pp2 x tp2 -> rollout tp2
    (2, 1, 2, 4),  # pp2 x tp2 -> rollout tp4 (pp peers want different slices: broadcast, then slice)
]
# With only 2 GPUs under the nccl switch: tp2 training, and rollout tp != training tp both ways.
LAYOUTS_2 = [
    (1, 2, 1, 2),  # dp2 -> rollout tp2
    (1, 1, 2, 1),  # tp2 -> rollout tp1
    (1, 1, 2, 2),  # tp2 -> rollout tp2
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from rlhf.models.tiny import write_tiny_model

    d = tmp_path_factory.mktemp("tiny_reshard")
    # kv heads = heads = 4 so that rollout tp4 is a valid layout
    write_tiny_model(str(d), hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=4, intermediate_size=64)
    return str(d)


def _worker(rank: int, world: int, model_dir: str, out: str, layouts: list) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from rlhf.rollout.reshard import RolloutLayout, gather_rollout_weights, rollout_shard_dim, rollout_slice
    from rlhf.schema.config import ModelConfig, ParallelConfig
    from rlhf.train.actor import PolicyWorker

    ref_model = AutoModelForCausalLM.from_pretrained(model_dir)
    full = {n: t.detach() for n, t in ref_model.state_dict().items()}
    params = {n for n, _ in ref_model.named_parameters()}  # tied lm_head counted once
    received = {}
    for pp, dp, tp, rtp in layouts:
        tag = f"pp{pp} dp{dp} tp{tp} -> rollout tp{rtp}"
        mesh = init_device_mesh(dist_device_type(), (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
        worker = PolicyWorker(ModelConfig(path=model_dir), mesh, dist_device(), trainable=False,
                              parallel_cfg=ParallelConfig(pp=pp, tp=tp, dp=dp, pp_microbatches=2))
        layout = RolloutLayout.build(rtp, dist_device_type())
        assert layout.tp_rank == rank % rtp and layout.dp == world // rtp, tag
        weights, stats = gather_rollout_weights(worker.model, pp_group=worker.pp_group, tp_rank=layout.tp_rank,
                                                tp_size=layout.tp, tp_group=layout.tp_group)
        # pp splits a tied embedding into two stage copies: the rollout gets both names.
        expected = params | ({"lm_head.weight"} if pp > 1 else set())
        assert set(weights) == expected, f"{tag}: {set(weights) ^ expected}"
        for name, t in weights.items():
            want = rollout_slice(full[name], name, layout.tp_rank, rtp)
            assert t.shape == want.shape, f"{tag} {name}: {tuple(t.shape)} vs {tuple(want.shape)}"
            assert torch.equal(t.cpu(), want), f"{tag} {name}"
        sliced = sum(full[n].numel() for n in expected if rollout_shard_dim(n) is not None)
        total = sum(full[n].numel() for n in expected)
        assert stats.numel == total - sliced + sliced // rtp, tag  # only the rollout slice is held
        assert stats.bytes_received > 0, tag
        received[(pp, dp, tp, rtp)] = stats.bytes_received
    # Keeping the training TP shard moves fewer bytes than gathering full tensors and slicing.
    if (1, 2, 2, 2) in received:
        assert received[(1, 2, 2, 2)] < received[(1, 2, 2, 1)]
    if rank == 0:
        torch.save(received, out)


def test_rollout_weights_are_exact_slices_in_every_layout(model_dir, tmp_path):
    out = str(tmp_path / "received.pt")
    world, layouts = 4, LAYOUTS
    if dist_device_type() == "cuda" and torch.cuda.device_count() < 4:
        world, layouts = 2, LAYOUTS_2
    run_distributed(_worker, world, model_dir, out, layouts)
    received = torch.load(out)
    assert set(received) == set(layouts)


def test_rollout_shard_dims():
    from rlhf.rollout.reshard import rollout_shard_dim, rollout_slice

    assert rollout_shard_dim("model.layers.3.self_attn.q_proj.weight") == 0
    assert rollout_shard_dim("model.layers.3.self_attn.k_proj.bias") == 0
    assert rollout_shard_dim("model.layers.0.mlp.up_proj.weight") == 0
    assert rollout_shard_dim("model.layers.0.mlp.down_proj.weight") == 1
    assert rollout_shard_dim("model.layers.0.self_attn.o_proj.weight") == 1
    assert rollout_shard_dim("model.layers.0.self_attn.o_proj.bias") is None  # added after the all-reduce
    assert rollout_shard_dim("model.embed_tokens.weight") is None
    assert rollout_shard_dim("lm_head.weight") is None
    w = torch.arange(24.0).view(4, 6)
    assert torch.equal(rollout_slice(w, "model.layers.0.mlp.down_proj.weight", 1, 2), w[:, 3:])
    assert torch.equal(rollout_slice(w, "model.layers.0.mlp.gate_proj.weight", 1, 2), w[2:])


def test_rollout_slices_of_fused_and_expert_weights():
    """Phi-3's fused q|k|v and gate|up are split part by part; MoE experts whole; the router replicated."""
    from types import SimpleNamespace

    from rlhf.rollout.reshard import rollout_shard_dim, rollout_slice

    cfg = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2)
    qkv = torch.arange(8.0)[:, None].repeat(1, 3)  # head dim 1: rows q0..q3, k0, k1, v0, v1
    assert torch.equal(rollout_slice(qkv, "model.layers.0.self_attn.qkv_proj.weight", 1, 2, cfg)[:, 0],
                       torch.tensor([2.0, 3.0, 5.0, 7.0]))  # q2, q3 | k1 | v1
    gate_up = torch.arange(8.0)[:, None]  # gate rows 0..3, up rows 4..7
    assert torch.equal(rollout_slice(gate_up, "model.layers.0.mlp.gate_up_proj.weight", 0, 2)[:, 0],
                       torch.tensor([0.0, 1.0, 4.0, 5.0]))
    experts = torch.arange(4.0)[:, None, None].expand(4, 6, 2)
    assert torch.equal(rollout_slice(experts, "model.layers.0.mlp.experts.gate_up_proj", 1, 2)[:, 0, 0],
                       torch.tensor([2.0, 3.0]))
    assert rollout_shard_dim("model.layers.0.mlp.experts.down_proj") == 0  # whole experts, not columns
    assert rollout_shard_dim("model.layers.0.mlp.gate.weight") is None  # the router
    with pytest.raises(ValueError, match="pass the model config"):
        rollout_slice(qkv, "model.layers.0.self_attn.qkv_proj.weight", 1, 2)
