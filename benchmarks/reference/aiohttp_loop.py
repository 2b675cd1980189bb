"""The floor: the hand loop over `aiohttp.ClientSession` and orjson, the fastest Python stack.

The connection cap is Treadle's default (1,000), so fan-outs compare like with like.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson

from benchmarks.reference import hand_loop
from benchmarks.reference.hand_loop import HandLoop, RateLimited
from benchmarks.worker import Meter
from benchmarks.workload import MODEL

CONNECTION_LIMIT = 1000


def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=CONNECTION_LIMIT))


class AiohttpLoop(HandLoop):
    """The hand loop over aiohttp, JSON through orjson."""

    dumps = staticmethod(orjson.dumps)
    loads = staticmethod(orjson.loads)

    async def complete(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        """POST the messages (whole or SSE) and return the assistant message."""
        body: dict[str, Any] = {"model": MODEL, "messages": messages, "tools": self.schemas}
        if self.stream:
            body["stream"] = True
        headers = {**self.headers, "content-type": "application/json"}
        async with self.client.post(self.url, data=orjson.dumps(body), headers=headers) as r:
            if r.status == 429:
                raise RateLimited(r.headers)
            r.raise_for_status()
            if not self.stream:
                message: dict[str, Any] = orjson.loads(await r.read())["choices"][0]["message"]
                return message
            events = []
            async for line in r.content:
                if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                    events.append(orjson.loads(line[6:]))
            return self.accumulate(events)


def serial(job: dict[str, Any], meter: Meter) -> dict[str, Any]:
    """`n` passes one at a time."""
    return {"errors": hand_loop.serial(job, meter, _session, AiohttpLoop)}


def fanout(job: dict[str, Any], meter: Meter) -> dict[str, Any]:
    """`n` concurrent passes."""
    return {"errors": hand_loop.fanout(job, meter, _session, AiohttpLoop)}


def growth(job: dict[str, Any], meter: Meter) -> dict[str, Any]:
    """One pass of many tool rounds."""
    return hand_loop.growth(job, meter, _session, AiohttpLoop)


parallel = serial
