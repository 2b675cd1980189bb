"""Soak tests are skipped unless asked for: `make soak`, `pytest -m soak` or `TREADLE_SOAK=1`."""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wanted = os.environ.get("TREADLE_SOAK") == "1" or "soak" in str(config.getoption("-m") or "")
    if wanted:
        return
    skip = pytest.mark.skip(reason="soak test: run `make soak` (or -m soak, or TREADLE_SOAK=1)")
    for item in items:
        if "soak" in item.keywords:
            item.add_marker(skip)
