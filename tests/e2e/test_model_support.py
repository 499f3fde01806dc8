"""An architecture the sampler cannot run (on the fast or the generic path) ends a dry run and a real run with one
line, before any work."""

from __future__ import annotations

import pytest
import transformers

from tests.e2e.conftest import grpo_args, run_script
from tests.e2e.test_user_errors import _error_line


@pytest.mark.parametrize("dry_run", [True, False])
def test_unsupported_architecture_one_line(tiny_assets, tmp_path, dry_run):
    transformers.MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1).save_pretrained(tmp_path / "m")
    args = grpo_args(tiny_assets, tmp_path / "o", **{"model.path": tmp_path / "m"})
    line = _error_line(run_script("train_grpo.py", (["--dry-run"] if dry_run else []) + args))
    assert line == ("error: model.path: rollout sampler: mamba's layers keep convolution / recurrent state "
                    "(linear_attention layers); the generic sampler holds only the paged K/V cache per slot")
