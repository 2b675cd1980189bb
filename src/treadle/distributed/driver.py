"""The scheduler shared by the process and Ray backends: lazy feeding, bounded work, retries.

`drive(pool, sessions, ...)` pulls sessions from any iterable only when a slot frees up, keeps at
most `concurrency` passes in flight per worker, streams outcomes back as they finish, and when a
worker is lost (its process died, or a call outlived `call_timeout`) restarts that worker and
puts its in-flight passes back in the queue for any worker, up to `max_attempts` attempts each.
Which of those passes killed the worker is unknown (a hook calling `os._exit`, a tool leaking
memory), so each retried pass runs alone on its worker: a pass that kills its worker again takes
no other pass with it, and only it ends `lost`.
This module must never hold more than the in-flight passes plus the undelivered outcomes (both
bounded), never stop the map because one pass failed, and never block the event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import deque
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    AsyncIterator,
    Callable,
    Iterable,
)
from contextlib import asynccontextmanager
from typing import Any, Protocol

from treadle.distributed.outcome import PassItem, PassOutcome
from treadle.errors import ConfigurationError, WorkerLost
from treadle.session import Session

__all__ = ["WorkerLost", "WorkerPool", "drive"]


class WorkerPool(Protocol):
    """A fixed number of worker slots, each one live worker at a time."""

    size: int

    def worker_name(self, slot: int) -> str:
        """The current worker of `slot` (`host:pid`), for attempt records."""
        ...

    async def run(self, slot: int, item: PassItem) -> PassOutcome:
        """Run one pass on the worker of `slot`; raise `WorkerLost` if the worker is gone."""
        ...

    async def restart(self, slot: int) -> None:
        """Replace the worker of `slot` (after a loss) with a fresh one."""
        ...


_DONE = object()


class _SlotGate:
    """Admission to one worker slot: first attempts share the worker; a pass retried after a
    worker died under it (a suspect) waits until the worker is idle and then runs alone."""

    def __init__(self) -> None:
        self.changed = asyncio.Condition()
        self.sharing = 0
        self.alone = False
        self.waiting_alone = 0

    @asynccontextmanager
    async def enter(self, alone: bool) -> AsyncIterator[None]:
        if not alone and not self.alone and not self.waiting_alone:
            # The common case, no suspect anywhere: share the worker without the condition's
            # lock and notify only a suspect waiting for the worker to go idle.
            self.sharing += 1
            try:
                yield
            finally:
                self.sharing -= 1
                if self.waiting_alone:
                    async with self.changed:
                        self.changed.notify_all()
            return
        async with self.changed:
            if alone:
                self.waiting_alone += 1
                try:
                    await self.changed.wait_for(lambda: not self.alone and self.sharing == 0)
                finally:
                    self.waiting_alone -= 1
                self.alone = True
            else:  # a waiting suspect goes first, or it could wait for ever behind new passes
                await self.changed.wait_for(lambda: not self.alone and not self.waiting_alone)
                self.sharing += 1
        try:
            yield
        finally:
            async with self.changed:
                if alone:
                    self.alone = False
                else:
                    self.sharing -= 1
                self.changed.notify_all()


async def drive(
    pool: WorkerPool,
    sessions: Iterable[Any] | AsyncIterable[Any],
    *,
    concurrency: int,
    max_attempts: int,
    call_timeout: float | None,
    trace_context: dict[str, str] | None = None,
) -> AsyncGenerator[PassOutcome, None]:
    """Run every session on `pool`; yield each `PassOutcome` as it finishes (any order).

    `trace_context` (W3C headers) goes out with every item: the parent of the passes' spans.
    """
    if isinstance(sessions, AsyncIterable):
        async_source: AsyncIterator[Any] | None = aiter(sessions)
        sync_source = None
    elif isinstance(sessions, Iterable) and not isinstance(sessions, (str, bytes, Session)):
        async_source = None
        sync_source = iter(sessions)
    else:
        raise ConfigurationError(
            f"map takes an iterable of sessions, got {type(sessions).__name__}; wrap one item "
            "in a list."
        )
    consumers = pool.size * concurrency
    # Outcomes not yet taken by the caller plus passes in flight stay under this bound.
    undelivered = asyncio.Semaphore(2 * consumers)
    changed = asyncio.Condition()
    retry: deque[PassItem] = deque()
    history: dict[int, list[dict[str, Any]]] = {}
    state = {"next": 0, "in_flight": 0, "exhausted": False}
    generation = [0] * pool.size
    ready = [asyncio.Event() for _ in range(pool.size)]
    gates = [_SlotGate() for _ in range(pool.size)]
    for event in ready:
        event.set()

    async def pull() -> Any:
        try:
            if async_source is not None:
                return await anext(async_source)
            assert sync_source is not None
            return next(sync_source)
        except (StopIteration, StopAsyncIteration):
            return _DONE

    async def next_item() -> PassItem | PassOutcome | None:
        async with changed:
            while True:
                if retry:
                    state["in_flight"] += 1
                    return retry.popleft()
                if not state["exhausted"]:
                    value = await pull()
                    if value is _DONE:
                        state["exhausted"] = True
                        changed.notify_all()
                        continue
                    index = state["next"]
                    state["next"] += 1
                    if isinstance(value, Session):
                        await value.wait_ready()
                    try:
                        item = PassItem.from_input(index, value, trace_context)
                    except Exception as err:  # reported like a failed pass
                        return _bad_input(index, err)
                    state["in_flight"] += 1
                    return item
                if state["in_flight"] == 0:
                    return None
                await changed.wait()

    async def restart(slot: int, seen: int) -> None:
        if generation[slot] != seen:  # another pass on this worker already restarted it
            await ready[slot].wait()
            return
        generation[slot] += 1
        ready[slot].clear()
        try:
            await pool.restart(slot)
        finally:
            ready[slot].set()

    async def lost(
        worker: str, item: PassItem, err: BaseException, send: Callable[[PassOutcome], None]
    ) -> None:
        records = history.setdefault(item.index, [])
        records.append(
            {
                "attempt": item.attempt,
                "worker": worker,
                "status": "lost",
                "error": f"{type(err).__name__}: {err}"[:2000],
            }
        )
        if item.attempt < max_attempts:
            retry.append(dataclasses.replace(item, attempt=item.attempt + 1))
            undelivered.release()  # nothing delivered for this attempt
            return
        del history[item.index]
        send(
            PassOutcome(
                index=item.index,
                session_id=item.session_id,
                status="lost",
                attempts=item.attempt,
                worker=records[-1]["worker"],
                error=records[-1]["error"],
                history=tuple(records),
            )
        )

    async def consume(slot: int, send: Callable[[PassOutcome], None]) -> None:
        while True:
            await undelivered.acquire()
            item = await next_item()
            if item is None:
                undelivered.release()
                return
            if isinstance(item, PassOutcome):  # an input that is not a session
                send(item)
                continue
            try:
                async with gates[slot].enter(alone=item.attempt > 1):
                    await ready[slot].wait()
                    seen = generation[slot]
                    worker = pool.worker_name(slot)
                    try:
                        outcome = await asyncio.wait_for(pool.run(slot, item), call_timeout)
                    except (WorkerLost, TimeoutError) as err:
                        await lost(worker, item, err, send)
                        await restart(slot, seen)
                        continue
                earlier = history.pop(item.index, None)
                if earlier:
                    outcome = dataclasses.replace(outcome, history=(*earlier, *outcome.history))
                send(outcome)
            finally:
                async with changed:
                    state["in_flight"] -= 1
                    changed.notify_all()

    async def main(send: Callable[[PassOutcome], None]) -> None:
        async with asyncio.TaskGroup() as tg:
            for slot in range(pool.size):
                for _ in range(concurrency):
                    tg.create_task(consume(slot, send))

    from treadle.runtime.streams import produce  # with the first map, not the import

    async with produce(main) as outcomes:
        async for outcome in outcomes:
            yield outcome
            undelivered.release()
        outcomes.result()  # a failing input iterable or a worker that cannot restart


def _bad_input(index: int, err: Exception) -> PassOutcome:
    return PassOutcome(
        index=index,
        session_id="",
        status="error",
        attempts=0,
        worker="driver",
        error=f"{type(err).__name__}: {err}",
    )
