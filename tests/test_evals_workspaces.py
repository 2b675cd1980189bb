"""An eval run's workspace root: the final removal and a workspace being laid out never race."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from treadle.errors import ConfigurationError
from treadle.evals.workspaces import Workspaces


class _SlowFiles(dict[str, str]):
    """Files whose layout pauses after the folder exists, until the test lets it go on: the
    moment a cancelled run's worker thread is in when the run removes its root."""

    def __init__(self, started: threading.Event, go: threading.Event) -> None:
        super().__init__({"a/b.txt": "x"})
        self.started, self.go = started, go

    def items(self):  # type: ignore[override]
        self.started.set()
        assert self.go.wait(10)
        return super().items()


def test_close_waits_for_a_workspace_being_made_and_removes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    spaces = Workspaces()
    started, go = threading.Event(), threading.Event()
    made: list[Path] = []
    maker = threading.Thread(target=lambda: made.append(spaces.make("s0", _SlowFiles(started, go))))
    maker.start()
    assert started.wait(10)  # the folder exists, its files are being written
    closer = threading.Thread(target=spaces.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive()  # close waits for the layout in progress...
    go.set()
    maker.join(10)
    closer.join(10)
    assert made and not closer.is_alive()
    assert list(tmp_path.iterdir()) == []  # ...then removes it with the root


def test_no_workspace_is_made_after_close(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    spaces = Workspaces()
    spaces.close()
    with pytest.raises(ConfigurationError, match="has ended"):
        spaces.make("late", {"f.txt": "x"})
    assert list(tmp_path.iterdir()) == []
