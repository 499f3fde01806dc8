"""Start-up checks and helpers of Ulysses sequence parallelism (no processes)."""

from __future__ import annotations

import types

import pytest
import torch

from rlhf.config.load import load_config
from rlhf.models.parallel import ParallelDims
from rlhf.models.ulysses import check_sp, kv_repeat_factor
from rlhf.schema.config import ConfigError


def _hf(heads: int, kv: int):
    return types.SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv)


@pytest.mark.parametrize("heads, kv, sp, f", [(8, 8, 2, 1), (8, 2, 2, 1), (4, 2, 4, 2), (8, 1, 4, 4), (12, 4, 3, 3)])
def test_kv_repeat_factor_keeps_gqa_mapping(heads, kv, sp, f):
    assert kv_repeat_factor(heads, kv, sp) == f
    # after repeating, query head h still reads KV head h // (heads / kv) of the original
    kv_of_q = torch.arange(heads) // (heads // kv)
    rep = torch.arange(kv).repeat_interleave(f)
    per = heads // (kv * f)
    assert torch.equal(rep[torch.arange(heads) // per], kv_of_q)


@pytest.mark.parametrize("kwargs, msg", [
    (dict(sp=2, hf=_hf(4, 2), use_remove_padding=False), "set model.use_remove_padding=true"),
    (dict(sp=2, hf=_hf(4, 2), pp=2), "parallel.sp=2 with parallel.pp=2 is not supported"),
    (dict(sp=2, hf=_hf(4, 2), tp=4), "num_attention_heads=4 is not divisible by sp x tp = 2 x 4"),
    (dict(sp=3, hf=_hf(4, 2)), "num_attention_heads=4 is not divisible by sp x tp = 3 x 1"),
])
def test_check_sp_errors_name_the_cause(kwargs, msg):
    sp, hf = kwargs.pop("sp"), kwargs.pop("hf")
    with pytest.raises(ConfigError, match=msg):
        check_sp(sp, hf, **kwargs)


def test_check_sp_allows_tp_when_heads_divide():
    check_sp(2, _hf(8, 2), tp=2)  # 8 heads: 4 per TP rank, 2 per sp rank; 1 KV head per TP rank is repeated


def test_parallel_dims_with_sp():
    dims = ParallelDims.resolve(-1, 1, 1, 8, sp=2)
    assert (dims.dp, dims.sp) == (4, 2)
    with pytest.raises(ConfigError, match="not divisible by parallel.tp x pp x sp = 1 x 1 x 3"):
        ParallelDims.resolve(-1, 1, 1, 8, sp=3)


def test_verl_alias_sets_parallel_sp():
    base = ["model.path=m", "data.train_files=f"]
    assert load_config(None, base + ["actor.ulysses_sequence_parallel_size=2"]).parallel.sp == 2
    with pytest.raises(ConfigError, match="disagree"):
        load_config(None, base + ["actor.ulysses_sequence_parallel_size=2", "parallel.sp=4"])
