"""Fixtures shared by the test tiers."""

from __future__ import annotations

import pytest

from tests._assets import write_tool_assets


@pytest.fixture(scope="session")
def tool_assets(tmp_path_factory):
    """Tiny assets plus a model fitted to call the calculator (`tool_model`) and `tools.yaml` (built once)."""
    return write_tool_assets(tmp_path_factory.mktemp("tool_assets"))
