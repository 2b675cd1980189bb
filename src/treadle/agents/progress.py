"""What every backend of `map` shares: the progress display, the input count, the result list
and the blocking call.

The local fan-out (`treadle.agents.fanout`) and the distributed one (`treadle.distributed`) both
use these, so a map reports progress and failures the same way whichever backend ran it.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Coroutine
from typing import Any, TextIO, TypeVar

from treadle.errors import ConfigurationError
from treadle.runtime import submit

__all__ = ["Progress", "known_length", "run_blocking", "settle_results"]

T = TypeVar("T")

# The plain progress line is redrawn at most this often (seconds).
_PLAIN_REFRESH = 0.2


def known_length(items: object) -> int | None:
    """`len(items)` when the input has one (a list), else None (a generator: total unknown)."""
    try:
        return len(items)  # type: ignore[arg-type]
    except TypeError:
        return None


def settle_results(results: list[Any], return_exceptions: bool) -> list[Any]:
    """The list `map` returns: as is with `return_exceptions`, else the first failure raised
    (in input order, once every item has finished) with a note counting the failures."""
    if not return_exceptions:
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            first = failures[0]
            first.add_note(
                f"treadle.map: {len(failures)} of {len(results)} items failed (this is the "
                "first); pass return_exceptions=True to get every result."
            )
            raise first
    return results


class Progress:
    """A progress display for `map`: rich's bar when available, else one redrawn line."""

    def __init__(self, total: int | None, stream: TextIO, *, use_rich: bool) -> None:
        self.total = total
        self.done = 0
        self.failed = 0
        self.stream = stream
        self._last = 0.0
        self._rich: Any = None
        self._task: Any = None
        if use_rich:
            from rich.console import Console
            from rich.progress import Progress as RichProgress

            self._rich = RichProgress(console=Console(file=stream), transient=False)
            self._task = self._rich.add_task("treadle.map", total=total)
            self._rich.start()

    @classmethod
    def create(cls, total: int | None, stream: TextIO | None = None) -> Progress | None:
        """A display on `stream` (default stderr), or None when it is not a terminal."""
        stream = stream or sys.stderr
        if not stream.isatty():
            return None
        try:
            import rich  # noqa: F401
        except ImportError:
            return cls(total, stream, use_rich=False)
        return cls(total, stream, use_rich=True)

    def advance(self, *, failed: bool = False) -> None:
        """Count one finished item."""
        self.done += 1
        self.failed += failed
        if self._rich is not None:
            self._rich.update(self._task, advance=1, description=self._label())
            return
        now = time.monotonic()
        if now - self._last >= _PLAIN_REFRESH or self.done == self.total:
            self._last = now
            self.stream.write("\r" + self._label())
            self.stream.flush()

    def _label(self) -> str:
        total = "?" if self.total is None else str(self.total)
        failed = f", {self.failed} failed" if self.failed else ""
        return f"treadle.map {self.done}/{total}{failed}"

    def close(self) -> None:
        """Finish the display."""
        if self._rich is not None:
            self._rich.stop()
        else:
            self.stream.write("\r" + self._label() + "\n")
            self.stream.flush()


def run_blocking(call: Coroutine[Any, Any, T], name: str) -> T:
    """Run a map's coroutine on the runtime and wait for it; a clear error inside async code,
    where waiting would block the caller's event loop (`name` is the blocking call's name)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return submit(call).result()
    call.close()
    raise ConfigurationError(
        f"{name} blocks; inside async code use `await {name.replace('map', 'amap')}(...)`."
    )
