"""`ProcessPool`: the `backend="process"` workers, one fresh Python process per core here.

Each worker process (`treadle.distributed.worker_process`: a fresh interpreter that never
re-runs the caller's `__main__` and never imports Treadle from its working directory, see
`treadle.runtime.child_python`) runs a `PassWorker` on its own event loop, many passes at once;
the driver talks to it over a socket pair (items out, outcomes back, as JSON-able dicts, in
`multiprocessing` `Connection` frames). Each side reads and writes the socket on its event loop
(an asyncio protocol), never blocking it and with no thread of its own. When
a worker process dies, every pass it had in flight fails with `WorkerLost` and the slot is
restarted by the scheduler (`treadle.distributed.driver`). The same pipe carries the learned
rate limits the workers share: the driver holds a `LimitBroker`, workers lease permits from it in
small batches (`("lease", id, request)` / `("grant", id, reply)`), and a 429 one worker reports
is pushed to the others at once (`("pause", endpoint, seconds)`). This module must never share
Python objects with a worker other than by pipe messages, and never leave a worker process
running after `close`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from multiprocessing.reduction import ForkingPickler
from typing import Any

from treadle.distributed.driver import WorkerLost
from treadle.distributed.outcome import PassItem, PassOutcome
from treadle.distributed.pipe import (
    Frames,
    Unreadable,
    dumps_batch,
    frame,
    messages,
    what_cannot_cross,
)
from treadle.errors import ConfigurationError
from treadle.llm.limit_broker import LimitBroker
from treadle.runtime.child_python import python_child_argv

__all__ = ["LEASE_TIMEOUT", "SHARE_LEARNED_LIMITS", "WORKER_START_TIMEOUT", "ProcessPool"]

#: Seconds a worker process may take to start and build its agent.
WORKER_START_TIMEOUT = 60.0
#: Seconds a worker waits for the driver to answer a lease before pacing on its own share.
LEASE_TIMEOUT = 10.0
#: Workers lease the learned rate limits from the driver (False: each paces at 1/N on its own,
#: the behaviour before the shared broker; benchmarks compare the two).
SHARE_LEARNED_LIMITS = True
log = logging.getLogger("treadle.distributed")

# Seconds to wait for a worker to exit after being asked to stop, before it is killed.
_STOP_GRACE = 10.0


# -- in the driver -------------------------------------------------------------------------------


class _Worker(asyncio.Protocol):
    """The driver's end of one worker process: its socket, read and written on the driver's
    event loop (an asyncio protocol; no thread of its own).

    Messages cross the pipe in batches: what the driver posts to a worker in one turn of its
    event loop goes as one pickled frame, and each frame the worker sent is read as it arrives,
    in the loop's own callback. A reader and a sender thread per worker used to do this: each
    batch then cost a thread hand-off and a wake-up of the loop through its self-pipe, and the
    threads took the GIL from the loop, a third of the driver's CPU per completion
    (docs/performance.md, process workers). Writes never block the loop (the transport buffers
    what the socket does not take), so a worker that stops reading cannot hang the driver.
    """

    def __init__(
        self, process: subprocess.Popen[bytes], loop: asyncio.AbstractEventLoop, pool: ProcessPool
    ) -> None:
        self.process = process
        self.pool = pool
        self.name = f"process:{process.pid}"
        self.pending: dict[int, asyncio.Future[Any] | _Chain] = {}
        self.loop = loop
        self.ready: asyncio.Future[str] = loop.create_future()
        self.lost = False
        self._batch: list[Any] = []
        self._frames = Frames()
        self._transport: asyncio.Transport | None = None
        self._closed = loop.create_future()  # the socket is closed (EOF, error or abort)

    # -- asyncio.Protocol -----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            for batch in messages(self._frames, data):
                self.on_batch(batch)
        except Unreadable as err:  # its passes are lost: nothing after it can be read
            self._unreadable(str(err))

    def _unreadable(self, what: str) -> None:
        self.fail(WorkerLost(f"worker {self.name} sent {what}"))
        if self._transport is not None:
            self._transport.abort()

    def eof_received(self) -> bool:
        return False  # close our end too: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._closed.done():
            self._closed.set_result(None)
        self.on_batch(None)

    # -- messages ---------------------------------------------------------------------------------
    def on_batch(self, batch: list[Any] | None) -> None:
        if batch is None:
            self.fail(WorkerLost(f"worker {self.name} exited"))
            return
        for message in batch:
            self.on_message(message)

    def on_message(self, message: Any) -> None:
        if message[0] == "done":
            future = self.pending.pop(message[1], None)
            if future is not None and not future.done():
                future.set_result(message[2])
        elif message[0] == "unreadable":
            self.fail(WorkerLost(f"worker {self.name} could not read a batch: {message[1]}"))
        elif message[0] == "lease":
            self.pool.lease(self, message[1], message[2])
        elif message[0] == "ready" and not self.ready.done():
            self.name = message[1]
            self.ready.set_result(message[1])
        elif message[0] == "failed" and not self.ready.done():
            self.ready.set_exception(
                ConfigurationError(f"a process worker could not start: {message[1]}")
            )

    def post(self, message: Any) -> None:
        """Queue `message` for the worker (call on the driver's loop); everything posted in one
        turn of the loop is sent as one batch (lost if the worker is)."""
        if not self._batch:
            self.loop.call_soon(self._flush)
        self._batch.append(message)

    def _flush(self) -> None:
        batch, self._batch = self._batch, []
        if batch:
            self._write(batch)

    def _write(self, batch: list[Any] | None) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():  # the worker is gone: its passes are lost
            if batch is not None:
                self.fail(WorkerLost(f"worker {self.name} is gone"))
            return
        try:
            # An input pickle refuses fails alone (`_refuse`), the rest of the batch crosses.
            payload = dumps_batch(batch, self._refuse)
        except Exception as err:  # never fail silently: this worker's passes are lost
            log.error("sending to worker %s failed: %r", self.name, err)
            self.fail(WorkerLost(f"sending to {self.name} failed ({err!r})"))
            return
        transport.write(frame(payload))

    def _refuse(self, message: Any, err: Exception) -> None:
        """A message pickle refused: a pass's item fails as its own outcome."""
        if not (isinstance(message, tuple) and len(message) == 2 and isinstance(message[1], dict)):
            log.error("a message to worker %s could not be pickled: %r", self.name, err)
            return
        call_id, item = message
        where = what_cannot_cross(item.get("messages"), "messages")
        error = (
            f"{type(err).__name__}: input {item.get('index')} cannot be sent to a worker"
            f" ({where or 'its data'} cannot be pickled: {err})"
        )[:2000]
        outcome = {
            "index": item.get("index", -1),
            "session_id": item.get("session_id", ""),
            "status": "error",
            "attempts": item.get("attempt", 1),
            "worker": "driver",
            "error": error,
        }
        self.loop.call_soon(self._refused, call_id, outcome)

    def _refused(self, call_id: int, outcome: dict[str, Any]) -> None:
        future = self.pending.pop(call_id, None)
        if future is not None and not future.done():
            future.set_result(outcome)

    def fail(self, err: Exception) -> None:
        if not self.lost:  # what it leased is no longer in flight anywhere
            self.pool.broker.forget(self.name)
        self.lost = True
        if not self.ready.done():
            self.ready.set_exception(err)
        pending, self.pending = self.pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(err)

    async def stop(self) -> None:
        """Ask the process to finish, kill it if it does not, and reap it."""
        self._flush()
        self._write(None)  # the stop message, after what is queued
        try:
            await asyncio.to_thread(self.process.wait, _STOP_GRACE)
        except subprocess.TimeoutExpired:
            self.process.kill()
            await asyncio.to_thread(self.process.wait)
        # The process is gone: what the socket did not take (a worker that stopped reading)
        # is dropped, never waited for.
        if self._transport is not None:
            self._transport.abort()
            await self._closed


class _Chain:
    """Passes run one after another on one worker, each next one sent from the socket's read
    callback as the one before it ends (`ProcessPool.run_chained`). It stands in the worker's
    `pending` where `run` puts a future, so an outcome, a refused input and a lost worker reach
    it as they reach a future; its own future is what the scheduler's task awaits, once for
    the whole chain instead of once per pass."""

    __slots__ = ("call_id", "calls", "future", "step", "worker")

    def __init__(
        self,
        worker: _Worker,
        calls: Iterator[int],
        step: Callable[[PassOutcome], PassItem | PassOutcome],
    ) -> None:
        self.worker = worker
        self.calls = calls
        self.step = step
        self.future: asyncio.Future[PassOutcome] = worker.loop.create_future()
        self.call_id = -1

    def send(self, item: PassItem) -> None:
        self.call_id = call_id = next(self.calls)
        self.worker.pending[call_id] = self
        self.worker.post((call_id, item.to_json()))

    def done(self) -> bool:
        return self.future.done()

    def set_result(self, data: Any) -> None:
        if self.future.done():  # its task was cancelled: the map is closing
            return
        try:
            following = self.step(PassOutcome.from_json(data))
            if isinstance(following, PassItem):
                self.send(following)
            else:
                self.future.set_result(following)
        except BaseException as err:  # the scheduler's task raises it, as `run`
            # would; out of the read callback it would abort the socket with the chain already
            # out of `pending`, and the task would wait for ever.
            if not self.future.done():
                self.future.set_exception(err)

    def set_exception(self, err: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(err)


class ProcessPool:
    """`size` worker processes (spawned), each running passes of `spec` on its own loop."""

    def __init__(
        self,
        spec: dict[str, Any],
        *,
        size: int | None = None,
        sandbox_base: str | None = None,
        pass_timeout: float | None = None,
        api_key: str | None = None,
        worker_init: str | None = None,
    ) -> None:
        self.size = size or os.cpu_count() or 1
        self._spec = spec
        # The key goes to each worker over its socketpair only: never in argv, the environment
        # or the spec (which is JSON that may be logged or written).
        self._options = {
            "share": 1.0 / self.size,
            "sandbox_base": sandbox_base,
            "pass_timeout": pass_timeout,
            "api_key": api_key,
            "worker_init": worker_init,
            "shared_limits": SHARE_LEARNED_LIMITS,
        }
        self._workers: list[_Worker | None] = [None] * self.size
        self._calls = itertools.count()
        self.broker = LimitBroker(self.size)
        """The learned rate limits the workers lease from (one per pool, on the driver's loop)."""
        self.pauses_pushed = 0
        """How many times a worker's 429 was pushed to the other workers as a pause."""

    def lease(self, worker: _Worker, lease_id: int, request: dict[str, Any]) -> None:
        """Answer one worker's lease; a 429 it reports pauses the other workers at once."""
        if worker.lost:  # a late message from a replaced worker: it holds nothing now
            return
        try:
            reply = self.broker.lease(request)
        except (KeyError, TypeError, ValueError, IndexError) as err:  # a malformed request
            log.warning("a malformed rate-limit lease from %s: %r", worker.name, err)
            return  # the worker's lease times out and it paces on its own share
        worker.post(("grant", lease_id, reply))
        if any(report[3] for report in request.get("reports", ())):
            self.pauses_pushed += 1
            for other in self._workers:
                if other is not None and other is not worker and not other.lost:
                    other.post(("pause", request["endpoint"], reply["pause"]))

    def worker_name(self, slot: int) -> str:
        """The current worker of `slot`, `host:pid`."""
        worker = self._workers[slot]
        return worker.name if worker is not None else "none"

    async def _spawn(self) -> _Worker:
        parent, child = socket.socketpair()
        with child:
            process = await asyncio.to_thread(
                subprocess.Popen,
                # Isolated: the driver's cwd must not shadow Treadle; its sys.path comes in "init".
                python_child_argv(
                    "treadle.distributed.worker_process", "_worker_entry", str(child.fileno())
                ),
                pass_fds=(child.fileno(),),
                stdin=subprocess.DEVNULL,
            )
        loop = asyncio.get_running_loop()
        worker = _Worker(process, loop, self)
        try:  # the first message, as `Connection.send` writes it (the worker reads it so)
            init = ("init", self._spec, self._options, list(sys.path))
            parent.sendall(frame(bytes(ForkingPickler.dumps(init))))
            parent.setblocking(False)
            await loop.connect_accepted_socket(lambda: worker, parent)  # owns `parent` now
        except BaseException:
            parent.close()
            await worker.stop()
            raise
        try:
            await asyncio.wait_for(asyncio.shield(worker.ready), WORKER_START_TIMEOUT)
        except BaseException:
            await worker.stop()
            raise
        return worker

    async def start(self) -> None:
        """Start every worker (they start in parallel)."""
        results = await asyncio.gather(
            *(self._spawn() for _ in range(self.size)), return_exceptions=True
        )
        for slot, result in enumerate(results):
            if isinstance(result, _Worker):
                self._workers[slot] = result
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.close()
            raise errors[0]

    async def run(self, slot: int, item: PassItem) -> PassOutcome:
        """Run one pass on the worker of `slot`."""
        worker = self._workers[slot]
        if worker is None or worker.lost:
            raise WorkerLost(f"worker slot {slot} has no live worker")
        call_id = next(self._calls)
        future: asyncio.Future[Any] = worker.loop.create_future()
        worker.pending[call_id] = future
        # Batched with the other items of this loop turn; a failed send fails `future`.
        worker.post((call_id, item.to_json()))
        try:
            return PassOutcome.from_json(await future)
        finally:
            worker.pending.pop(call_id, None)

    async def run_chained(
        self, slot: int, item: PassItem, step: Callable[[PassOutcome], PassItem | PassOutcome]
    ) -> PassOutcome:
        """Run `item` on the worker of `slot`, then each item `step` returns for the outcome
        before it, sent from the socket's read callback; return the outcome `step` gives back.
        Raises `WorkerLost` if the worker is lost under the pass in flight."""
        worker = self._workers[slot]
        if worker is None or worker.lost:
            raise WorkerLost(f"worker slot {slot} has no live worker")
        chain = _Chain(worker, self._calls, step)
        chain.send(item)
        try:
            return await chain.future
        finally:  # cancelled (the map closed early): a late outcome finds no one
            worker.pending.pop(chain.call_id, None)

    async def restart(self, slot: int) -> None:
        """Replace the worker of `slot`: reap the old process, spawn a new one (whose janitor
        removes the old one's sandboxes)."""
        old = self._workers[slot]
        self._workers[slot] = None
        if old is not None:
            old.fail(WorkerLost(f"worker {old.name} was replaced"))
            await old.stop()
        self._workers[slot] = await self._spawn()

    async def close(self) -> None:
        """Stop every worker and reap its process."""
        workers = [w for w in self._workers if w is not None]
        self._workers = [None] * self.size
        await asyncio.gather(*(w.stop() for w in workers))
        for worker in workers:
            worker.fail(WorkerLost("the pool is closed"))

    def pids(self) -> list[int | None]:
        """The process ids of the live workers, by slot."""
        return [w.process.pid if w is not None else None for w in self._workers]
