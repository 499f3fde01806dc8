"""Fixtures shared by the test tiers."""

from __future__ import annotations

import os

import pytest

from tests._assets import write_tool_assets


@pytest.fixture(scope="session")
def tool_assets(tmp_path_factory):
    """Tiny assets plus a model fitted to call the calculator (`tool_model`) and `tools.yaml` (built once)."""
    return write_tool_assets(tmp_path_factory.mktemp("tool_assets"))


_RENDEZVOUS_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


@pytest.fixture(autouse=True)
def _no_leaked_rendezvous_env():
    """A test that builds a trainer in-process starts a 1-process group, which writes its free port into
    os.environ; an entry script a later test launches from the same pytest process (one pytest-xdist
    worker runs many files) would inherit it and fail to host its store on that taken port."""
    before = {k: os.environ.get(k) for k in _RENDEZVOUS_ENV}
    yield
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
