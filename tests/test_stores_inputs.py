"""Bad arguments say what is wrong: `fork(version=)` takes only an int of 0 or more (checked
before any I/O).

Real parts: SQLite files, a throwaway PostgreSQL database (the `url` fixture).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from treadle.errors import ConfigurationError
from treadle.session import ChunkRow
from treadle.stores import Store


@pytest.mark.parametrize("version", [1.5, 2.0, True, "1", -1, -0.5])
def test_fork_takes_only_an_int_version_of_zero_or_more(url: str, version: Any) -> None:
    with Store.open(url) as store:
        store.append("t", [ChunkRow.user("a"), ChunkRow("assistant", {"content": "b"})])
        with pytest.raises(ConfigurationError, match="version"):
            store.fork("t", "f", version=version)
        assert [c.key for c in store.conversations()] == ["t"]  # nothing was made
        assert store.fork("t", "f", version=1).metadata["version"] == 1


def test_fork_checks_its_version_before_any_io(tmp_path: Path) -> None:
    """A closed store would fail any I/O with a `StoreError`: the argument is refused first."""
    store = Store.sqlite(tmp_path / "s.db")
    store.close()
    with pytest.raises(ConfigurationError, match="version"):
        store.fork("t", "f", version=1.5)  # type: ignore[arg-type]
