"""Config loading: yaml + dotted overrides, strict keys and types, clear messages."""

from __future__ import annotations

import math

import pytest

from rlhf.config.load import load_config
from rlhf.models.parallel import ParallelDims
from rlhf.schema.config import Config, ConfigError, describe
from rlhf.train.optim import lr_lambda, warmup_steps_for

REQ = ["model.path=/m", "data.train_files=/d.parquet"]


def test_yaml_and_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("model:\n  path: /m\ndata:\n  train_files: /d.parquet\nactor:\n  lr: 1e-6\n")
    cfg = load_config(str(f), ["actor.lr=3e-6", "parallel.tp=2", 'rollout.stop=["\\n\\n"]',
                               "algorithm.filter_groups.enable=true"])
    assert isinstance(cfg, Config)
    assert cfg.actor.lr == 3e-6 and cfg.parallel.tp == 2 and cfg.rollout.stop == ["\n\n"]
    assert cfg.algorithm.filter_groups.enable is True
    # yaml's "1e-6" (no dot) is a string for PyYAML; it must still be a float here.
    assert load_config(str(f)).actor.lr == 1e-6


def test_unknown_key_names_nearest(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown config key 'actor\.clip_ratio_hgih'; did you mean actor\.clip_ratio_high"):
        load_config(None, REQ + ["actor.clip_ratio_hgih=0.28"])
    with pytest.raises(ConfigError, match=r"unknown config key 'rolout'"):
        load_config(None, REQ + ["rolout.n=4"])


@pytest.mark.parametrize("override, msg", [
    ("rollout.n=two", "'rollout.n' must be int"),
    ("actor.use_kl_loss=3", "'actor.use_kl_loss' must be bool"),
    ("actor.warmup_style=linear", "'actor.warmup_style' must be one of 'constant', 'cosine'"),
    ("rollout.n=0", "'rollout.n': must be >= 1"),
    ("actor.ppo_mini_batch_size=300", "must divide data.train_batch_size"),
    ("rollout.top_p=1.5", "rollout.top_p"),
    ("rollout.ep=0", "'rollout.ep': must be >= 1"),
    ("trainer.mode=one_step_off rollout.ep=2", "'rollout.ep': > 1 is built for trainer.mode colocated only"),
])
def test_bad_values(override, msg):
    with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, REQ + override.split())


def test_required_and_missing_file():
    with pytest.raises(ConfigError, match="model.path"):
        load_config(None, ["data.train_files=/d"])
    with pytest.raises(ConfigError, match="config file not found"):
        load_config("/no/such.yaml")


def test_every_field_documented():
    lines = describe()
    assert len(lines) > 80
    assert all("#" in l and l.split("#", 1)[1].strip() for l in lines)


@pytest.mark.parametrize("dp, tp, pp, world, expect", [(-1, 2, 1, 8, 4), (-1, 2, 2, 8, 2), (2, 2, 1, 4, 2)])
def test_parallel_dims(dp, tp, pp, world, expect):
    assert ParallelDims.resolve(dp, tp, pp, world).dp == expect


@pytest.mark.parametrize("dp, tp, pp, world, msg", [
    (-1, 3, 1, 8, "world size 8 is not divisible by parallel.tp x parallel.pp = 3 x 1"),
    (3, 2, 1, 8, "parallel.dp x tp x pp = 3 x 2 x 1 = 6 but the world size is 8"),
])
def test_impossible_layouts(dp, tp, pp, world, msg):
    with pytest.raises(ConfigError, match=msg.replace("(", r"\(")):
        ParallelDims.resolve(dp, tp, pp, world)


def test_lr_schedule_numbers():
    # Warmup 10 of 100 steps: linear 0 -> 1, then cosine to min_lr_ratio at the end.
    assert warmup_steps_for(100, -1, 0.1) == 10 and warmup_steps_for(100, 5, 0.1) == 5
    kw = dict(total_steps=100, warmup=10, style="cosine", min_lr_ratio=0.1)
    assert lr_lambda(0, **kw) == 0.0 and lr_lambda(5, **kw) == 0.5 and lr_lambda(10, **kw) == 1.0
    assert lr_lambda(55, **kw) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_lambda(100, **kw) == pytest.approx(0.1)
    assert lr_lambda(50, total_steps=100, warmup=0, style="constant", min_lr_ratio=0.0) == 1.0
