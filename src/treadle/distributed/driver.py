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
    Awaitable,
    Callable,
    Iterable,
)
from contextlib import asynccontextmanager
from typing import Any, Protocol

from treadle.distributed.outcome import PassItem, PassOutcome
from treadle.errors import ConfigurationError, WorkerLost
from treadle.session import Session

__all__ = ["FailedInput", "WorkerLost", "WorkerPool", "drive"]


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
#: A pool's `run_chained(slot, item, step)` (the process pool's): runs `item` on `slot`'s worker,
#: hands each outcome to `step` in its read callback, runs the item `step` returns next, and
#: returns the outcome `step` gives back (`WorkerLost` when the worker is lost under a pass).
_RunChained = Callable[
    [int, PassItem, Callable[[PassOutcome], "PassItem | PassOutcome"]], Awaitable[PassOutcome]
]


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
    state = {"next": 0, "in_flight": 0, "exhausted": False, "waiting": 0}
    generation = [0] * pool.size
    ready = [asyncio.Event() for _ in range(pool.size)]
    gates = [_SlotGate() for _ in range(pool.size)]
    for event in ready:
        event.set()

    pulling = asyncio.Lock()  # an async source's `anext` calls, one at a time

    async def take() -> tuple[int, Any] | None:
        """The next input and its position, or None at the end. A value gets its position in
        the step that takes it from the source, so no input is ever placed after a later one."""
        if sync_source is not None:
            # `next` never awaits: the value and its position are one step, with no lock (a
            # lock per pass was the scheduler's cost) and in the source's order.
            try:
                value = next(sync_source, _DONE)
            except asyncio.CancelledError as err:
                raise _source_cancelled(err) from err
        else:
            assert async_source is not None
            async with pulling:  # one `anext` at a time, each value numbered before the next
                if state["exhausted"]:
                    return None
                try:
                    value = await anext(async_source)
                except StopAsyncIteration:
                    return None
                index = state["next"]
                state["next"] += 1
                return index, value
        if value is _DONE:
            return None
        index = state["next"]
        state["next"] += 1
        return index, value

    def finished() -> Awaitable[None] | None:
        """One pass fewer in flight; what to await to wake the consumers waiting for the last."""
        state["in_flight"] -= 1
        return notify() if state["waiting"] else None

    async def notify() -> None:
        async with changed:
            changed.notify_all()

    async def next_item() -> PassItem | PassOutcome | None:
        while True:
            if retry:
                state["in_flight"] += 1
                return retry.popleft()
            if not state["exhausted"]:
                taken = await take()
                if taken is None:
                    state["exhausted"] = True
                    continue
                # In flight from here: a consumer with nothing left to take waits for this one
                # (its session may still be pending), as it waits for a pass that may come back.
                state["in_flight"] += 1
                return await prepare(*taken)
            if state["in_flight"] == 0:
                return None
            # Only the last consumers get here: they wait for a pass to end or come back.
            state["waiting"] += 1
            try:
                async with changed:
                    while not retry and state["in_flight"]:
                        await changed.wait()
            finally:
                state["waiting"] -= 1

    async def prepare(index: int, value: Any) -> PassItem | PassOutcome:
        """The item of an input taken (and counted in flight), or its outcome if it fails."""
        if isinstance(value, Session):
            try:
                await value.wait_ready()
            except Exception as err:  # its own pass failed: that is this item's outcome
                waking = finished()
                if waking is not None:
                    await waking
                return _failed_input(index, value, err)
            except BaseException:  # the map is cancelled: it ends
                state["in_flight"] -= 1
                raise
        try:
            return PassItem.from_input(index, value, trace_context)
        except Exception as err:  # reported like a failed pass
            waking = finished()
            if waking is not None:
                await waking
            return _bad_input(index, err)

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
        carried: tuple[int, Any] | BaseException | None = None  # what a chain took last
        while True:
            if isinstance(carried, asyncio.CancelledError):  # the iterable's own, see `take`
                raise _source_cancelled(carried) from carried
            if isinstance(carried, BaseException):  # the input iterable failed: the map fails
                raise carried
            item: PassItem | PassOutcome | None
            if carried is not None:  # an input a chain took that needs more than its callback
                # Its budget was taken with it (`chained`), so a held input counts as well.
                state["in_flight"] += 1
                item = await prepare(*carried)
                carried = None
            else:
                await undelivered.acquire()
                item = await next_item()
            if item is None:
                undelivered.release()
                return
            if isinstance(item, PassOutcome):  # an input that is not a session
                send(item)
                continue
            gate = gates[slot]
            try:
                if item.attempt == 1 and not gate.alone and not gate.waiting_alone:
                    # The gate's common case inline (no context manager per pass), as `enter`.
                    gate.sharing += 1
                    try:
                        if run_chained is not None:
                            outcome, carried = await chained(run_chained, slot, item, send)
                        else:
                            outcome = await attempt(slot, item, send)
                    finally:
                        gate.sharing -= 1
                        if gate.waiting_alone:
                            async with gate.changed:
                                gate.changed.notify_all()
                else:
                    async with gate.enter(alone=item.attempt > 1):
                        outcome = await attempt(slot, item, send)
                if outcome is None:
                    continue
                earlier = history.pop(outcome.index, None)  # a chain's last pass: its own
                if earlier:
                    outcome = dataclasses.replace(outcome, history=(*earlier, *outcome.history))
                send(outcome)
            finally:
                waking = finished()  # only the last passes' consumers wait for the others
                if waking is not None:
                    await waking

    async def chained(
        run: _RunChained, slot: int, item: PassItem, send: Callable[[PassOutcome], None]
    ) -> tuple[PassOutcome | None, tuple[int, Any] | BaseException | None]:
        """`item` and the inputs after it on `slot`'s worker, each sent from the pool's read
        callback as the pass before it ends, for as long as this consumer's loop would not
        wait for anything: no task resumed and no future per pass (the scheduler was a third
        of the driver's CPU, docs/performance.md). Returns the last pass's outcome (None: the
        worker was lost under it), for the loop to deliver, and an input taken meanwhile that
        needs the loop (a session, one that fails; with its budget taken) or the error the input
        iterable raised."""
        if not ready[slot].is_set():
            await ready[slot].wait()
        seen = generation[slot]
        worker = pool.worker_name(slot)
        gate = gates[slot]
        source = sync_source
        assert source is not None
        current = item
        carried: tuple[int, Any] | BaseException | None = None

        def step(outcome: PassOutcome) -> PassItem | PassOutcome:
            """In the read callback: the next item for this worker, or `outcome` back to the
            loop (which then delivers it as it delivers any)."""
            nonlocal current, carried
            if retry or state["exhausted"] or state["waiting"] or gate.alone:
                return outcome  # a retry, the end, a waiting consumer: the loop's cases
            if gate.waiting_alone or generation[slot] != seen or undelivered.locked():
                return outcome  # a suspect waiting, a restart, no budget: the loop waits
            # The next input's budget before the input: an input the loop must take over
            # (`carried`) keeps it, so a chain never holds one past the bound while it waits.
            _acquire_now(undelivered)
            try:  # taken in the source's order and numbered in the same step, as `take`
                value = next(source, _DONE)
            except BaseException as err:  # raised once this outcome is delivered: any error
                undelivered.release()  # escaping the read callback would abort the socket
                carried = err
                return outcome
            if value is _DONE:
                undelivered.release()
                state["exhausted"] = True
                return outcome
            index = state["next"]
            state["next"] += 1
            following: PassItem | None = None
            if not isinstance(value, Session):
                try:
                    following = PassItem.from_input(index, value, trace_context)
                except BaseException:  # `prepare` meets it again, in the loop, as for any input
                    following = None
            if following is None:
                carried = (index, value)  # with the budget just taken
                return outcome
            # The next pass takes this one's place in flight (the count stays).
            send(outcome)  # a first attempt: no earlier history to join
            current = following
            return following

        try:
            return await run(slot, item, step), carried
        except WorkerLost as err:
            await lost(worker, current, err, send)
            await restart(slot, seen)
            return None, carried

    async def attempt(
        slot: int, item: PassItem, send: Callable[[PassOutcome], None]
    ) -> PassOutcome | None:
        """One attempt of `item` on `slot`'s worker (None: the worker was lost under it)."""
        if not ready[slot].is_set():
            await ready[slot].wait()
        seen = generation[slot]
        worker = pool.worker_name(slot)
        try:
            if call_timeout is None:
                return await pool.run(slot, item)
            # A deadline on this task, not `wait_for`'s extra task per pass (Python 3.11).
            async with asyncio.timeout(call_timeout):
                return await pool.run(slot, item)
        except (WorkerLost, TimeoutError) as err:
            await lost(worker, item, err, send)
            await restart(slot, seen)
            return None

    # Passes chain on a worker from the pool's callbacks where the loop's cases allow it (a
    # sync source, no per-call deadline; a pool without `run_chained`, e.g. Ray, never chains).
    run_chained = getattr(pool, "run_chained", None)
    if sync_source is None or call_timeout is not None:
        run_chained = None

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


def _source_cancelled(err: asyncio.CancelledError) -> RuntimeError:
    """The error for a sync input iterable whose `next` raised CancelledError: `next` never
    awaits, so it is the iterable's own error, not the map's cancellation; raised as it is, the
    consumer's task would end as cancelled, its task group would drop it, and the map would end
    as if every input were done."""
    return RuntimeError(f"the input iterable raised CancelledError: {err}")


def _acquire_now(semaphore: asyncio.Semaphore) -> None:
    """`semaphore.acquire()` when it is not locked, from a callback: what `acquire` does
    without suspending (CPython 3.11-3.13)."""
    semaphore._value -= 1


@dataclasses.dataclass(frozen=True, slots=True)
class FailedInput(PassOutcome):
    """The outcome of a pending input session whose own pass failed: status `error`, and
    `cause`, that pass's exception, which `treadle.map` gives as the item's result (or raises),
    as an in-process map does. `cause` stays in the driver's process: `to_json` leaves it out."""

    cause: BaseException | None = dataclasses.field(default=None, compare=False, repr=False)


def _failed_input(index: int, value: Session, err: Exception) -> FailedInput:
    return FailedInput(
        index=index,
        session_id=value.id,
        status="error",
        attempts=0,
        worker="driver",
        error=f"{type(err).__name__}: {err}"[:2000],
        cause=err,
    )


def _bad_input(index: int, err: Exception) -> PassOutcome:
    return PassOutcome(
        index=index,
        session_id="",
        status="error",
        attempts=0,
        worker="driver",
        error=f"{type(err).__name__}: {err}",
    )
