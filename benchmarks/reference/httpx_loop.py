"""The reference: the hand loop over `httpx.AsyncClient` (default limits) and stdlib json.

The client is created the way most code creates it: `httpx.AsyncClient()`.
"""

from __future__ import annotations

from typing import Any

import httpx

from benchmarks.reference import hand_loop
from benchmarks.reference.hand_loop import HandLoop, RateLimited
from benchmarks.worker import Meter
from benchmarks.workload import MODEL


class HttpxLoop(HandLoop):
    """The hand loop, one request at a time through httpx."""

    async def complete(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        """POST the messages (whole or SSE) and return the assistant message."""
        body: dict[str, Any] = {"model": MODEL, "messages": messages, "tools": self.schemas}
        if not self.stream:
            response = await self.client.post(self.url, json=body, headers=self.headers)
            if response.status_code == 429:
                raise RateLimited(response.headers)
            response.raise_for_status()
            message: dict[str, Any] = response.json()["choices"][0]["message"]
            return message
        body["stream"] = True
        events = []
        async with self.client.stream("POST", self.url, json=body, headers=self.headers) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(self.loads(line[6:]))
        return self.accumulate(events)


def serial(job: dict[str, Any], meter: Meter) -> dict[str, Any]:
    """`n` passes one at a time."""
    return {"errors": hand_loop.serial(job, meter, httpx.AsyncClient, HttpxLoop)}


def fanout(job: dict[str, Any], meter: Meter) -> dict[str, Any]:
    """`n` concurrent passes."""
    return {"errors": hand_loop.fanout(job, meter, httpx.AsyncClient, HttpxLoop)}


def growth(job: dict[str, Any], meter: Meter) -> dict[str, Any]:
    """One pass of many tool rounds."""
    return hand_loop.growth(job, meter, httpx.AsyncClient, HttpxLoop)


parallel = serial
