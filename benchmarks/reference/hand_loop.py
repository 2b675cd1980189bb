"""The hand-written agent loop shared by the reference stacks (HTTP and JSON plugged in).

A `messages` list, POST, append the reply, run the tools it asks for (async tools gathered,
sync tools in `asyncio.to_thread`), repeat: what a Python user writes without a framework.
Subclasses supply `complete(messages)`; the drivers at the bottom run the benchmark workloads.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from benchmarks.worker import Meter
from benchmarks.workload import (
    API_KEY,
    MAX_ROUNDS,
    NAP_SCHEMA,
    NOOP_SCHEMA,
    SYSTEM_PROMPT,
    USER_PROMPT,
    WARMUP_PASSES,
    Stamps,
    async_nap,
    noop_result,
    sync_nap,
)

RETRIES = 10
"""A patient hand loop: this many retries of a 429 before the pass fails."""


class RateLimited(Exception):
    """The server answered 429; `wait` is what its headers asked for (None: not said)."""

    def __init__(self, headers: Any) -> None:
        super().__init__("429")
        ms, seconds = headers.get("retry-after-ms"), headers.get("retry-after")
        self.wait = float(ms) / 1000 if ms else float(seconds) if seconds else None


class HandLoop:
    """One client, one endpoint, the tools of one workload."""

    def __init__(self, job: dict[str, Any], client: Any) -> None:
        self.client = client
        self.url = job["url"] + "/chat/completions"
        self.headers = {"authorization": f"Bearer {API_KEY}"}
        self.stream = bool(job.get("stream"))
        self.stamps: Stamps | None = None
        kind = job.get("tool_kind")
        self.schemas = [NAP_SCHEMA] if kind else [NOOP_SCHEMA]
        self.kind = kind

    dumps: Callable[[Any], str | bytes] = staticmethod(json.dumps)
    loads: Callable[[str | bytes], Any] = staticmethod(json.loads)

    async def call_tool(self, call: dict[str, Any]) -> Any:
        """Run one tool call (the tool is the workload's; the name is not looked up)."""
        args = self.loads(call["function"]["arguments"] or "{}")
        if self.kind == "sync":
            return await asyncio.to_thread(sync_nap, **args)
        if self.kind == "async":
            return await async_nap(**args)
        if self.stamps is not None:
            self.stamps.mark()
        return noop_result(**args)

    async def complete(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        """Send one chat completion and return the assistant message."""
        raise NotImplementedError

    async def complete_retrying(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        """`complete`, retrying a 429 after the server's `retry-after-ms` / `Retry-After` (as
        the OpenAI SDK does), else after an exponential backoff."""
        for attempt in range(RETRIES + 1):
            try:
                return await self.complete(messages)
            except RateLimited as exc:
                if attempt == RETRIES:
                    raise
                await asyncio.sleep(exc.wait if exc.wait is not None else 0.5 * 2**attempt)
        raise AssertionError("unreachable")

    @staticmethod
    def accumulate(events: list[dict[str, Any]]) -> dict[str, Any]:
        """Build the assistant message from parsed stream events."""
        content: list[str] = []
        calls: dict[int, dict[str, Any]] = {}
        for event in events:
            for choice in event["choices"]:
                delta = choice["delta"]
                if delta.get("content"):
                    content.append(delta["content"])
                for tc in delta.get("tool_calls") or ():
                    call = calls.setdefault(
                        tc["index"],
                        {"id": "", "type": "function", "function": {"name": "", "arguments": ""}},
                    )
                    call["id"] = tc.get("id") or call["id"]
                    fn = tc.get("function") or {}
                    call["function"]["name"] += fn.get("name") or ""
                    call["function"]["arguments"] += fn.get("arguments") or ""
        message: dict[str, Any] = {"role": "assistant", "content": "".join(content) or None}
        if calls:
            message["tool_calls"] = [calls[i] for i in sorted(calls)]
        return message

    async def run_pass(self) -> str:
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": USER_PROMPT},
        ]
        for _ in range(MAX_ROUNDS):
            message = await self.complete_retrying(messages)
            messages.append(message)
            calls = message.get("tool_calls")
            if not calls:
                return str(message.get("content"))
            results = await asyncio.gather(*(self.call_tool(c) for c in calls))
            for call, result in zip(calls, results, strict=True):
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": call["id"],
                        "content": _text(self.dumps(result)),
                    }
                )
        raise RuntimeError("too many rounds")


def _text(data: str | bytes) -> str:
    return data.decode() if isinstance(data, bytes) else data


ClientFactory = Callable[[], AbstractAsyncContextManager[Any]]
LoopClass = Callable[[dict[str, Any], Any], HandLoop]


def serial(job: dict[str, Any], meter: Meter, client: ClientFactory, make: LoopClass) -> int:
    """`n` passes one at a time; returns the error count."""

    async def main() -> int:
        async with client() as c:
            loop = make(job, c)
            for _ in range(job.get("warmup", WARMUP_PASSES)):
                await loop.run_pass()
            meter.start()
            errors = 0
            for _ in range(job["n"]):
                try:
                    await loop.run_pass()
                except Exception:
                    errors += 1
            meter.stop()
            return errors

    return asyncio.run(main())


def fanout(job: dict[str, Any], meter: Meter, client: ClientFactory, make: LoopClass) -> int:
    """`n` concurrent passes; returns the error count."""

    async def main() -> int:
        async with client() as c:
            loop = make(job, c)
            await loop.run_pass()
            meter.start()
            results = await asyncio.gather(
                *(loop.run_pass() for _ in range(job["n"])), return_exceptions=True
            )
            meter.stop()
            return sum(isinstance(r, BaseException) for r in results)

    return asyncio.run(main())


def growth(
    job: dict[str, Any], meter: Meter, client: ClientFactory, make: LoopClass
) -> dict[str, Any]:
    """One pass of many tool rounds, stamped at each tool call."""

    async def main() -> dict[str, Any]:
        async with client() as c:
            loop = make(job, c)
            await loop.run_pass()
            loop.stamps = stamps = Stamps()
            meter.start()
            stamps.mark()
            await loop.run_pass()
            meter.stop()
            return {"errors": 0, **stamps.result()}

    return asyncio.run(main())
