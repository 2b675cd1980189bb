"""The timed loops every peer runs, over that peer's own agent: `n` passes one at a time
(`serial`) or all at once (`fanout`), after one untimed warm-up pass.

A peer module supplies `make_agent(job)` and `one_pass(agent) -> bool` (True: the pass gave an
output) and hands them here; the errors counted are the passes that gave none or raised.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from benchmarks.worker import Meter

A = TypeVar("A")


def serial_passes(
    job: dict[str, Any],
    meter: Meter,
    make_agent: Callable[[dict[str, Any]], A],
    one_pass: Callable[[A], Awaitable[bool]],
) -> dict[str, Any]:
    """`job["n"]` passes one at a time; `{"errors": ...}`."""
    return {"errors": asyncio.run(_timed_passes(job, meter, make_agent, one_pass, False))}


def fanout_passes(
    job: dict[str, Any],
    meter: Meter,
    make_agent: Callable[[dict[str, Any]], A],
    one_pass: Callable[[A], Awaitable[bool]],
) -> dict[str, Any]:
    """`job["n"]` concurrent passes; `{"errors": ...}` (a raised pass counts as an error)."""
    return {"errors": asyncio.run(_timed_passes(job, meter, make_agent, one_pass, True))}


async def _timed_passes(
    job: dict[str, Any],
    meter: Meter,
    make_agent: Callable[[dict[str, Any]], A],
    one_pass: Callable[[A], Awaitable[bool]],
    concurrent: bool,
) -> int:
    """The errors of `job["n"]` timed passes, after one untimed warm-up pass."""
    agent = make_agent(job)
    await one_pass(agent)
    meter.start()
    if concurrent:
        results = await asyncio.gather(
            *(one_pass(agent) for _ in range(job["n"])), return_exceptions=True
        )
        errors = sum(r is not True for r in results)
    else:
        errors = 0
        for _ in range(job["n"]):
            errors += not await one_pass(agent)
    meter.stop()
    return errors
