"""A virtual clock for limiter tests: no wall-clock assertions, no real waits."""

from __future__ import annotations

import asyncio


class VirtualClock:
    """Time that only moves when the code under test sleeps."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds
        await asyncio.sleep(0)
