"""What a user sees for a mistyped command line: overrides in any order, a bad logger backend
named at load time, "did you mean" hints that point at the right key."""

from __future__ import annotations

import pytest

from rlhf.cli import parse_args
from rlhf.config.load import load_config
from rlhf.schema.config import ConfigError

REQ = ["model.path=/m", "data.train_files=/d.parquet"]


def test_overrides_before_and_after_flags():
    args = parse_args("t", ["model.path=/m", "--dry-run", "rollout.n=4", "--config", "c.yaml", "actor.lr=1e-6"])
    assert args.dry_run and args.config == "c.yaml"
    assert args.overrides == ["model.path=/m", "rollout.n=4", "actor.lr=1e-6"]


def test_unknown_logger_backend_fails_at_load():
    with pytest.raises(ConfigError, match=r"trainer\.logger.*'mlfow'.*did you mean 'mlflow'"):
        load_config(None, REQ + ["trainer.logger=[console,mlfow]"])
    assert load_config(None, REQ + ["trainer.logger=[console,jsonl,tensorboard]"]).trainer.logger[-1] == "tensorboard"


def test_missing_tracker_package_fails_at_load(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"trainer\.logger.*pip install wandb"):
        load_config(None, REQ + ["trainer.logger=[console,wandb]"])


def _hint(key: str) -> str:
    """The "did you mean" part of the error for `key` ("" when there is none)."""
    with pytest.raises(ConfigError, match="unknown config key") as e:
        load_config(None, REQ + [f"{key}=1"])
    head = str(e.value).split(" (valid keys")[0]
    return head.split("; ", 1)[1] if "; " in head else ""


@pytest.mark.parametrize("key, hint", [
    ("trainer.max_to_keep", "did you mean checkpoint.max_to_keep?"),  # the same name in another section
    ("actor.temperature", "did you mean rollout.temperature, trainer.val_kwargs.temperature?"),
    ("actor.lrr", "did you mean actor.lr?"),  # a typo in the section
    ("actor.clip_ratio_hgih", "did you mean actor.clip_ratio_high?"),
    ("trainer.val_kwargs.dosample", "did you mean trainer.val_kwargs.do_sample?"),
    ("rolout.n", "did you mean rollout?"),
])
def test_hint_names_the_right_key(key, hint):
    assert _hint(key) == hint


# (trainer.nnodes / trainer.save_freq, the examples, are now accepted: verl's names, rlhf.verl_compat)
@pytest.mark.parametrize("key", ["trainer.world", "trainer.gpus", "actor.foo"])
def test_no_hint_without_a_close_key(key):
    assert _hint(key) == ""
