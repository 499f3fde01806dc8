"""Deferred checkpoint loading (rlhf/models/checkpoint_reader.py, shard_init.py) on one process.

Each parameter is read from the safetensors file by slices in the checkpoint's dtype and upcast as
it is placed; the result equals ``from_pretrained`` in the training dtype exactly. The host then
holds one slice at a time instead of the whole model in fp32.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlhf.schema.config import ConfigError
from tests._archs import tiny_model


@pytest.fixture(scope="module")
def moe_bf16(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe") / "bf16"
    tiny_model("qwen3_moe").to(torch.bfloat16).save_pretrained(str(path))
    return path


def _placed(model):
    import rlhf.models.shard_init as shard_init

    host = shard_init.params_to_meta(model)
    shard_init.materialize_shards(model, host, torch.device("cpu"))
    return dict(model.named_parameters())


def test_slices_are_read_in_the_checkpoint_dtype_and_only_their_bytes(moe_bf16):
    from rlhf.models.checkpoint_reader import CheckpointIndex, checkpoint_sources
    from rlhf.models.loading import load_causal_lm

    whole = dict(load_causal_lm(str(moe_bf16), dtype="bfloat16").named_parameters())
    model = load_causal_lm(str(moe_bf16), deferred=True)
    index = CheckpointIndex(moe_bf16)
    src = checkpoint_sources(model, index)
    # A dense weight's rows, and fused experts (gate_up = cat(gate_e, up_e)) 2..4 across the gate/up seam.
    for name, idx in (("model.layers.0.self_attn.q_proj.weight", (slice(8, 24), slice(0, 64))),
                      ("model.layers.0.mlp.experts.gate_up_proj", (slice(2, 5), slice(10, 22), slice(0, 64))),
                      ("model.layers.2.mlp.experts.down_proj", (slice(7, 8),))):
        before = index.bytes_read
        got = src[name].read(idx)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, whole[name].detach()[idx]), name
        assert index.bytes_read - before == got.numel() * 2, name  # not the whole tensor


def test_deferred_load_equals_today_and_holds_one_slice_not_the_model(moe_bf16, monkeypatch):
    import rlhf.models.shard_init as shard_init
    from rlhf.models.loading import load_causal_lm

    held: list[int] = []
    real = shard_init.local_piece

    def measured(full, like):  # host bytes alive at once: the source tensors still held + this piece
        piece = real(full, like)
        held.append(sum(t.nbytes for t in host_of[0].values() if isinstance(t, torch.Tensor)) + piece.nbytes)
        return piece

    host_of: list[dict] = []
    real_meta = shard_init.params_to_meta
    monkeypatch.setattr(shard_init, "params_to_meta", lambda m: host_of.append(real_meta(m)) or host_of[-1])
    monkeypatch.setattr(shard_init, "local_piece", measured)
    today = _placed(load_causal_lm(str(moe_bf16)))
    peak_today, held[:], host_of[:] = max(held), [], []
    new = _placed(load_causal_lm(str(moe_bf16), deferred=True))
    peak_new = max(held)
    for n, p in today.items():
        assert new[n].dtype == torch.float32 and torch.equal(new[n], p), n
    model_fp32 = sum(p.numel() * 4 for p in today.values())
    assert peak_today >= model_fp32  # the whole fp32 model sat on the host
    largest_bf16 = max(p.numel() * 2 for p in today.values())
    assert peak_new == largest_bf16, (peak_new, largest_bf16)  # one bf16 tensor at a time (here: whole, 1 rank)


def test_a_layout_transformers_converts_loads_whole_at_placement_in_its_dtype(moe_bf16, monkeypatch):
    import rlhf.models.loading as loading

    today = _placed(loading.load_causal_lm(str(moe_bf16)))
    monkeypatch.setattr(loading, "checkpoint_sources", lambda *a: None)
    dtypes = []
    real = loading._from_pretrained
    monkeypatch.setattr(loading, "_from_pretrained", lambda p, dt, *a: dtypes.append(dt) or real(p, dt, *a))
    model = loading.load_causal_lm(str(moe_bf16), deferred=True)
    assert dtypes == []  # nothing loaded until the shards are placed
    new = _placed(model)
    assert dtypes == [torch.bfloat16]
    for n, p in today.items():
        assert torch.equal(new[n], p), n


def test_a_nan_read_at_placement_is_named(tmp_path):
    from rlhf.models.loading import load_causal_lm

    m = tiny_model("gemma3")
    with torch.no_grad():
        m.model.layers[1].mlp.up_proj.weight.view(-1)[7] = math.nan
    m.save_pretrained(str(tmp_path))
    model = load_causal_lm(str(tmp_path), deferred=True)
    with pytest.raises(ConfigError, match=r"model.path: .* weight model.layers.1.mlp.up_proj.weight holds 1 "
                                          r"non-finite value\(s\)"):
        _placed(model)


def test_load_ranks_per_node_is_checked():
    from rlhf.config.load import load_config

    with pytest.raises(ConfigError, match="model.load_ranks_per_node"):
        load_config(None, ["model.path=x", "data.train_files=x", "model.load_ranks_per_node=-1"])
