"""OpenRath through the same workloads (runs in benchmarks/.peers/openrath).

OpenRath's public API is synchronous: `flow.Agent(session)` submits the session loop to
OpenRath's own background asyncio loop (a daemon thread) and returns a lazy `Session` at once;
reading its result (`Session.text()`) blocks until the loop is done. A pass here starts the
agent from the benchmark's event loop (non-blocking, so a fan-out starts every pass at once)
and waits for the answer in `asyncio.to_thread`, as OpenRath's docs advise for async callers.
The waiting threads only observe finished passes; the passes themselves run concurrently on
OpenRath's loop, whatever the size of the default thread pool.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from rath import flow  # type: ignore[import-not-found]
from rath.flow.tool import FlowToolCall  # type: ignore[import-not-found]
from rath.session import Session  # type: ignore[import-not-found]

from benchmarks.peers.passes import fanout_passes, serial_passes
from benchmarks.worker import Meter
from benchmarks.workload import API_KEY, MODEL, NOOP_SCHEMA, SYSTEM_PROMPT, USER_PROMPT


class _Noop(FlowToolCall):  # type: ignore[misc]
    """The noop tool, in OpenRath's tool shape (schema and call together)."""

    @property
    def name(self) -> str:
        return "noop"

    @property
    def description(self) -> str:
        return "Do nothing and report the round."

    @property
    def parameters(self) -> Mapping[str, Any]:
        return NOOP_SCHEMA["function"]["parameters"]  # type: ignore[no-any-return]

    def __call__(self, session: Session, arguments: Mapping[str, Any]) -> dict[str, Any]:
        return {"round": arguments["round"]}


def _agent(job: dict[str, Any]) -> Any:
    provider = flow.Provider(base_url=job["url"], api_key=API_KEY, model=MODEL)
    return flow.Agent(SYSTEM_PROMPT, provider, tools=[_Noop()])


async def _one(agent: Any) -> bool:
    out = agent(Session.from_user_message(USER_PROMPT))  # starts the loop; returns at once
    return bool(await asyncio.to_thread(out.text))


def serial(job: dict[str, Any], meter: Meter) -> dict[str, Any]:
    """`n` passes one at a time."""
    return serial_passes(job, meter, _agent, _one)


def fanout(job: dict[str, Any], meter: Meter) -> dict[str, Any]:
    """`n` concurrent passes."""
    return fanout_passes(job, meter, _agent, _one)
