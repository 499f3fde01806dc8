"""Bad input found by the fault-injection run of issue 33: refused at start with one line naming it."""

from __future__ import annotations

import shutil

import pytest

from rlhf.config import ConfigError
from tests._assets import write_tiny_assets


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return write_tiny_assets(tmp_path_factory.mktemp("assets"), n_train=8, n_val=4)


def test_a_model_directory_without_tokenizer_files_is_refused(assets, tmp_path):
    """transformers builds a 1-token tokenizer from config.json alone: every prompt would be []."""
    from rlhf.models.loading import load_tokenizer

    bare = tmp_path / "model"
    bare.mkdir()
    for f in (assets / "model").iterdir():
        if not f.name.startswith("tokenizer"):
            shutil.copy(f, bare)
    with pytest.raises(ConfigError, match=f"model.path: {bare} has no tokenizer files"):
        load_tokenizer(str(bare), key="model.path")
    # tokenizer files that give an empty vocabulary are refused too
    (bare / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ConfigError, match="model.path: the tokenizer in .* is empty"):
        load_tokenizer(str(bare), key="model.path")
    assert len(load_tokenizer(str(assets / "model"))("1+2=")["input_ids"]) > 0
