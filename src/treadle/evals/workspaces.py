"""The per-sample workspace folders of one eval run, under one temporary root.

Workspaces are laid out and removed in worker threads (file I/O never runs on the loop). A
cancelled `await asyncio.to_thread(...)` does not stop its thread, so a run cancelled while a
workspace is being laid out would otherwise race the final removal: the thread creates its
folder after `rmtree` has listed the root, and the folder outlives the run. One lock makes the
two exclusive, and once the root is closed no new workspace can be made in it.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path

from treadle.errors import ConfigurationError

__all__ = ["Workspaces"]


class Workspaces:
    """A temporary root holding one folder per sample; `close()` removes it and all of them."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="treadle-eval-"))
        self._lock = threading.Lock()
        self._closed = False

    def make(self, name: str, files: Mapping[str, str]) -> Path:
        """Lay out `files` (relative path -> text) in a new folder `name` (blocking: call it in
        a worker thread). Refused once the run has closed its root."""
        with self._lock:
            if self._closed:
                raise ConfigurationError("the eval run has ended; no workspace can be made.")
            path = self.root / name
            path.mkdir()
            for relative, text in files.items():
                target = path / relative
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(text, encoding="utf-8")  # whatever the locale says
            return path

    def close(self) -> None:
        """Remove the root and every folder in it (blocking). Waits for a workspace being made
        right now, and no workspace can be made after."""
        with self._lock:
            self._closed = True
        shutil.rmtree(self.root, ignore_errors=True)
