"""`StatusLine`: what a running pass is doing right now, shown at once and kept current.

A model can take seconds before its first token; a blank screen for that long reads as a hang.
The CLI therefore always shows the current phase: connecting and waiting for the model (with the
seconds elapsed), the model writing a tool call, a tool running. On a terminal that is one line,
redrawn in place every `TICK` seconds and erased before any other output; elsewhere (pipes, logs,
CI) each phase is one line on stderr, with a reminder every `PLAIN_REMINDER` seconds of a long
wait, so stdout keeps only the transcript. This module must never write model text: it shows
state only, and never leaves a half-drawn line under real output.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import AsyncIterator
from typing import IO

from treadle.cli.terminal_text import visible

__all__ = ["PLAIN_REMINDER", "TICK", "StatusLine"]

#: Seconds between redraws of the terminal status line (the elapsed time advances this often).
TICK = 0.1
#: Seconds between "still ..." lines of one long phase when the output is not a terminal.
PLAIN_REMINDER = 5.0

_FRAMES = "|/-\\"
_CLEAR = "\r\x1b[K"


class StatusLine:
    """The current phase of a pass on `out` (a terminal) or `err` (otherwise)."""

    def __init__(self, out: IO[str], *, err: IO[str] | None = None, tty: bool | None = None):
        self.out = out
        self.err = err if err is not None else sys.stderr
        self.tty = _isatty(out) if tty is None else tty
        self.phase: str | None = None
        self.since = time.monotonic()
        self._drawn = False
        self._reminded = 0

    def set(self, phase: str | None, *, announce: bool = True) -> None:
        """Show `phase` now (None: nothing to show, e.g. while model text streams).

        `announce=False` skips the plain-output line for a phase the output already shows (the
        terminal line is drawn all the same, and a long phase is still reminded of)."""
        if phase is not None:
            phase = visible(phase)  # a phase can name a model's tool: no control reaches the tty
        if phase == self.phase:
            return
        self.phase = phase
        self.since = time.monotonic()
        self._reminded = 0
        if phase is None:
            self.clear()
        elif self.tty:
            self._draw()
        elif announce:
            self._plain(f"{phase}...")

    def clear(self) -> None:
        """Erase the drawn line (before other output is written)."""
        if self._drawn:
            self.out.write(_CLEAR)
            self.out.flush()
            self._drawn = False

    def tick(self) -> None:
        """Advance the elapsed time (terminal), or remind of a long phase (plain)."""
        if self.phase is None:
            return
        if self.tty:
            self._draw()
            return
        reminders = int((time.monotonic() - self.since) // PLAIN_REMINDER)
        if reminders > self._reminded:
            self._reminded = reminders
            self._plain(f"still {self.phase} ({reminders * PLAIN_REMINDER:.0f} s)")

    @contextlib.asynccontextmanager
    async def ticking(self) -> AsyncIterator[StatusLine]:
        """Keep the line current on the running loop while the block runs; erase it after."""
        import asyncio  # here, not at the top: an error printed before any pass never needs it

        task = asyncio.create_task(self._tick_forever())
        try:
            yield self
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            self.set(None)

    async def _tick_forever(self) -> None:
        import asyncio

        while True:
            await asyncio.sleep(TICK)
            self.tick()

    def _draw(self) -> None:
        elapsed = time.monotonic() - self.since
        frame = _FRAMES[int(elapsed / TICK) % len(_FRAMES)]
        text = f"{frame} {self.phase} {elapsed:.1f} s"
        import shutil  # only a terminal line needs its width

        width = shutil.get_terminal_size((80, 24)).columns - 1
        self.out.write(_CLEAR + text[:width])
        self.out.flush()
        self._drawn = True

    def _plain(self, text: str) -> None:
        self.err.write(f"treadle: {text}\n")
        self.err.flush()


def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or fake stream
        return False
