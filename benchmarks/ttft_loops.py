"""Time to first token, worker side: `n` concurrent streamed passes, each stamping the moment its
first piece of answer text arrives (scenario 12, `benchmarks/ttft_bench.py`).

Two contestants: Treadle through `stream_session_loop` (its `TextDelta` events) and the floor,
the aiohttp+orjson hand loop reading SSE lines. Each function imports only its own stack, so a
worker never loads the other (the worker module's rule).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from benchmarks.worker import Meter
from benchmarks.workload import API_KEY, MODEL, SYSTEM_PROMPT, USER_PROMPT


def _summary(firsts: list[float], errors: int) -> dict[str, Any]:
    """The stamps as seconds after the start, sorted (the orchestrator takes percentiles)."""
    return {"errors": errors, "ttft": sorted(firsts)}


def treadle(job: dict[str, Any], meter: Meter) -> dict[str, Any]:
    """`n` passes of `stream_session_loop` at once; each stamps its first `TextDelta`."""
    from treadle import Provider, Session, stream_session_loop
    from treadle.loop.events import TextDelta

    options = {"first_wave": job["first_wave"]} if "first_wave" in job else {}
    provider = Provider(model=MODEL, base_url=job["url"], api_key=API_KEY, stream=True, **options)
    agent = Session.from_agent_prompt(SYSTEM_PROMPT)
    user = Session.from_user_message(USER_PROMPT)

    async def one(start: float) -> float | None:
        first = None
        async for event in stream_session_loop(user, agent, agent_provider=provider):
            if first is None and isinstance(event, TextDelta) and event.text:
                first = time.perf_counter() - start
        return first

    async def main() -> tuple[list[float], int]:
        await one(time.perf_counter())  # warm the pool and the code paths
        meter.start()
        start = time.perf_counter()
        outs = await asyncio.gather(*(one(start) for _ in range(job["n"])), return_exceptions=True)
        meter.stop()
        firsts = [o for o in outs if isinstance(o, float)]
        return firsts, len(outs) - len(firsts)

    return _summary(*asyncio.run(main()))


def aiohttp(job: dict[str, Any], meter: Meter) -> dict[str, Any]:
    """The floor: `n` streamed requests at once over one aiohttp session, orjson per event."""
    import aiohttp as http
    import orjson

    url = job["url"] + "/chat/completions"
    headers = {"authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": USER_PROMPT},
    ]
    body = {"model": MODEL, "messages": messages, "stream": True}

    async def one(client: http.ClientSession, start: float) -> float | None:
        first = None
        async with client.post(url, data=orjson.dumps(body), headers=headers) as reply:
            reply.raise_for_status()
            async for line in reply.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                event = orjson.loads(line[6:])
                if first is None and any(c["delta"].get("content") for c in event["choices"]):
                    first = time.perf_counter() - start
        return first

    async def main() -> tuple[list[float], int]:
        connector = http.TCPConnector(limit=1000)  # Treadle's default connection cap
        async with http.ClientSession(connector=connector) as client:
            await one(client, time.perf_counter())
            meter.start()
            start = time.perf_counter()
            outs = await asyncio.gather(
                *(one(client, start) for _ in range(job["n"])), return_exceptions=True
            )
            meter.stop()
        firsts = [o for o in outs if isinstance(o, float)]
        return firsts, len(outs) - len(firsts)

    return _summary(*asyncio.run(main()))
