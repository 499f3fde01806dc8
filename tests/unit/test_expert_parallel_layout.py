"""Expert-parallel sizes: ``parallel.ep`` resolves, is checked against dp / num_experts / tp in one
line naming the key; verl's ``expert_model_parallel_size`` and ``router_replay.mode`` map to ours."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rlhf.config.load import load_config
from rlhf.models.parallel import ParallelDims
from rlhf.models.parallelize import validate_layout
from rlhf.schema.config import ConfigError, ParallelConfig


def test_ep_resolves_from_dp():
    assert ParallelDims.resolve(-1, 2, 1, 8, ep=2) == ParallelDims(dp=4, tp=2, pp=1, world_size=8, ep=2)


@pytest.mark.parametrize("dp, tp, world, ep, sp, msg", [
    (-1, 1, 4, 3, 1, "parallel.ep=3 must be >= 1 and divide dp=4"),
    (-1, 2, 4, 4, 1, "parallel.ep=4 must be >= 1 and divide dp=2"),
    (-1, 1, 4, 2, 2, "parallel.ep > 1 with parallel.sp > 1 is not supported"),
])
def test_impossible_ep(dp, tp, world, ep, sp, msg):
    with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace(".", r"\.")):
        ParallelDims.resolve(dp, tp, 1, world, sp=sp, ep=ep)


def _hf(**kw):
    base = dict(model_type="qwen3_moe", num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                vocab_size=64, num_hidden_layers=2, num_experts=8)
    return SimpleNamespace(**{**base, **kw})


def test_validate_layout_checks_experts():
    validate_layout(ParallelConfig(ep=4, tp=2), _hf(), 8)
    with pytest.raises(ConfigError, match=r"num_experts=6 is not divisible by parallel\.ep x tp = 2 x 2"):
        validate_layout(ParallelConfig(ep=2, tp=2), _hf(num_experts=6, num_attention_heads=4), 8)
    with pytest.raises(ConfigError, match=r"parallel\.ep=2 needs a mixture-of-experts model; llama"):
        validate_layout(ParallelConfig(ep=2), _hf(model_type="llama", num_experts=None), 4)


def test_verl_moe_keys_map_to_ours():
    base = ["actor_rollout_ref.model.path=/m", "data.train_files=/d.parquet"]
    cfg = load_config(None, base + ["actor_rollout_ref.actor.megatron.expert_model_parallel_size=4",
                                    "actor_rollout_ref.actor.router_replay.mode=R2"])
    assert cfg.parallel.ep == 4 and cfg.actor.router_replay == "R2"
    cfg = load_config(None, base + ["actor_rollout_ref.actor.router_replay.mode=disabled"])
    assert cfg.actor.router_replay == "none"
