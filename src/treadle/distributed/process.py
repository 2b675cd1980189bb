"""`ProcessPool`: the `backend="process"` workers, one fresh Python process per core here.

Each worker process (`python -I -c` calling `_worker_entry([FD])`, a fresh interpreter that never
re-runs the caller's `__main__` and never imports Treadle from its working directory, see
`treadle.runtime.child_python`) runs a `PassWorker` on its own event loop, many passes at once;
the driver talks to it over a socket pair wrapped in a `multiprocessing` `Connection` (items out,
outcomes back, as JSON-able dicts). Reads and writes of the pipe happen on threads, so the
driver's event loop never waits on a pipe. When
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
import contextlib
import gc
import itertools
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any

from treadle.distributed.driver import WorkerLost
from treadle.distributed.outcome import PassItem, PassOutcome
from treadle.distributed.pipe import dumps_batch, refuse_outcome, what_cannot_cross
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


# -- inside the worker process ------------------------------------------------------------------


def _worker_main(fd: int) -> None:
    """Entry point of a worker process: the first message carries the spec and `sys.path`."""
    # What closing needs, imported now: `asyncio.to_thread` loads the thread pool lazily, and
    # a worker whose passes used every file descriptor could not import it then (no cleanup).
    import concurrent.futures.thread  # noqa: F401

    conn = Connection(fd)
    try:
        _kind, spec, options, path = conn.recv()
    except (EOFError, OSError):
        return
    sys.path[:] = path  # the driver's import path, so tools import here as they do there
    asyncio.run(_serve(conn, spec, options))
    # Every outcome is sent and telemetry flushed: exit now. A normal exit would first join
    # the threads of abandoned user code (a hook or tool still sleeping past its pass's
    # deadline), keeping the driver's map waiting for nothing until it kills this process.
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


def _worker_entry(argv: list[str]) -> None:
    """`python_child_argv` entry point: argv is the socket's fd."""
    _worker_main(int(argv[0]))


async def _serve(conn: Connection, spec: dict[str, Any], options: dict[str, Any]) -> None:
    from treadle.distributed.worker import PassWorker, worker_name
    from treadle.llm.shared_limits import install_shared_limits, pause_shared

    loop = asyncio.get_running_loop()
    outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
    grants: dict[int, asyncio.Future[dict[str, Any]]] = {}
    lease_ids = itertools.count()

    async def lease(request: dict[str, Any]) -> dict[str, Any]:
        lease_id = next(lease_ids)
        future = grants[lease_id] = loop.create_future()
        post(("lease", lease_id, request))
        try:
            return await asyncio.wait_for(future, LEASE_TIMEOUT)
        finally:
            grants.pop(lease_id, None)

    if options.pop("shared_limits", False):  # before the agent's limiters exist
        install_shared_limits(lease, worker_name())

    pending: list[Any] = []

    def flush() -> None:
        if pending:
            outbox.put(pending[:])
            pending.clear()

    def post(message: Any) -> None:
        """Queue `message` for the driver: all posted in one loop iteration go as one batch."""
        if not pending:
            loop.call_soon(flush)
        pending.append(message)

    def write() -> None:
        while (batch := outbox.get()) is not None:
            try:
                # Pickled apart from the write: an outcome pickle refuses fails alone.
                conn.send_bytes(dumps_batch(batch, refuse_outcome))
            except OSError:  # the driver is gone; nothing left to tell
                return
            except Exception as err:  # a bug here: say so, and keep sending what follows
                log.error("a batch for the driver could not be sent: %r", err)

    writer = threading.Thread(target=write, name="treadle-worker-send", daemon=True)
    writer.start()
    try:
        worker = PassWorker(spec, **options)
    except Exception as err:
        outbox.put([("failed", f"{type(err).__name__}: {err}")])
        outbox.put(None)
        writer.join()
        return
    # Start-up's heap (imports, the agent) lives as long as this worker: collected once and
    # frozen, no full collection scans it again (the first one cost a pass 30 ms). The price: a
    # start-up object that later becomes cyclic garbage is never collected (docs/performance.md).
    gc.collect()
    gc.freeze()
    outbox.put([("ready", worker.name)])
    stop = asyncio.Event()
    tasks: set[asyncio.Task[None]] = set()

    async def run_one(call_id: int, item: dict[str, Any]) -> None:
        # `run_json` turns every failure of the item into its outcome: the driver always hears.
        post(("done", call_id, await worker.run_json(item)))

    def on_message(message: Any) -> None:
        if message[0] == "grant":
            future = grants.get(message[1])
            if future is not None and not future.done():
                future.set_result(message[2])
            return
        if message[0] == "pause":
            pause_shared(message[1], message[2])
            return
        task = loop.create_task(run_one(*message))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    def on_batch(batch: list[Any] | None) -> None:
        if batch is None:
            stop.set()
            return
        for message in batch:
            on_message(message)

    def read() -> None:
        while True:  # one wake-up of the loop per batch the driver sent, not per message
            try:
                batch = conn.recv()
            except (EOFError, OSError):
                batch = None
            except Exception as err:  # e.g. a class only the driver has: which pass is unknown
                # Say why and end: the driver retries the batch's passes alone, on new workers.
                loop.call_soon_threadsafe(post, ("unreadable", f"{type(err).__name__}: {err}"))
                batch = None
            loop.call_soon_threadsafe(on_batch, batch)
            if batch is None:
                return

    threading.Thread(target=read, name="treadle-worker-recv", daemon=True).start()
    await stop.wait()
    for task in list(tasks):
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.to_thread(worker.close)
    flush()
    outbox.put(None)
    writer.join()


# -- in the driver -------------------------------------------------------------------------------


class _Worker:
    """The driver's end of one worker process.

    Messages cross the pipe in batches: what the driver posts to a worker in one turn of its
    event loop goes as one pickled list, written by this worker's sender thread, and the reader
    thread wakes the loop once per batch the worker sent. Per message, a thread hand-off and a
    loop wake-up cost more CPU than the pass's own bookkeeping (docs/performance.md).
    """

    def __init__(
        self, process: subprocess.Popen[bytes], conn: Connection, pool: ProcessPool
    ) -> None:
        self.process = process
        self.conn = conn
        self.pool = pool
        self.name = f"process:{process.pid}"
        self.pending: dict[int, asyncio.Future[Any]] = {}
        self.loop = asyncio.get_running_loop()
        self.ready: asyncio.Future[str] = self.loop.create_future()
        self.lost = False
        self._batch: list[Any] = []
        self._outbox: queue.SimpleQueue[list[Any] | None] = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send, name="treadle-pool-send", daemon=True)
        self._sender.start()

    def start_reader(self, loop: asyncio.AbstractEventLoop) -> None:
        def read() -> None:
            while True:
                try:
                    batch = self.conn.recv()
                except (EOFError, OSError):
                    batch = None
                try:
                    loop.call_soon_threadsafe(self.on_batch, batch)
                except RuntimeError:  # the driver's loop is closed
                    return
                if batch is None:
                    return

        threading.Thread(target=read, name="treadle-pool-recv", daemon=True).start()

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
        turn of the loop is sent as one batch, on the sender thread (lost if the worker is)."""
        if not self._batch:
            self.loop.call_soon(self._flush)
        self._batch.append(message)

    def _flush(self) -> None:
        if self._batch:
            self._outbox.put(self._batch)
            self._batch = []

    def _send(self) -> None:
        while True:
            batch = self._outbox.get()  # None: the stop message, sent last
            try:
                # Pickled here, apart from the write: an input pickle refuses fails alone.
                self.conn.send_bytes(dumps_batch(batch, self._refuse))
            except (OSError, ValueError) as err:  # the worker is gone: its passes are lost
                if batch is not None:
                    self._call_soon(self.fail, WorkerLost(f"worker {self.name} is gone ({err})"))
                return
            except Exception as err:  # never die silently: this worker's passes are lost
                log.error("sending to worker %s failed: %r", self.name, err)
                self._call_soon(self.fail, WorkerLost(f"sending to {self.name} failed ({err!r})"))
            if batch is None:
                return

    def _call_soon(self, callback: Any, *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the driver's loop is closed
            self.loop.call_soon_threadsafe(callback, *args)

    def _refuse(self, message: Any, err: Exception) -> None:
        """(sender thread) A message pickle refused: a pass's item fails as its own outcome."""
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
        self._call_soon(self._refused, call_id, outcome)

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

    def stop(self) -> None:
        """Ask the process to finish, kill it if it does not, and reap it (blocks)."""
        self._outbox.put(None)  # after what is queued, on the one thread that writes the pipe
        try:
            self.process.wait(_STOP_GRACE)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        # The process is gone: a send still blocked on a full pipe fails at once and the
        # sender ends (it is never joined before the kill, so a hung worker cannot hang this).
        self._sender.join(_STOP_GRACE)
        self.conn.close()


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
                    "treadle.distributed.process", "_worker_entry", str(child.fileno())
                ),
                pass_fds=(child.fileno(),),
                stdin=subprocess.DEVNULL,
            )
        conn = Connection(parent.detach())
        conn.send(("init", self._spec, self._options, list(sys.path)))
        worker = _Worker(process, conn, self)
        worker.start_reader(asyncio.get_running_loop())
        try:
            await asyncio.wait_for(asyncio.shield(worker.ready), WORKER_START_TIMEOUT)
        except BaseException:
            await asyncio.to_thread(worker.stop)
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

    async def restart(self, slot: int) -> None:
        """Replace the worker of `slot`: reap the old process, spawn a new one (whose janitor
        removes the old one's sandboxes)."""
        old = self._workers[slot]
        self._workers[slot] = None
        if old is not None:
            old.fail(WorkerLost(f"worker {old.name} was replaced"))
            await asyncio.to_thread(old.stop)
        self._workers[slot] = await self._spawn()

    async def close(self) -> None:
        """Stop every worker and reap its process."""
        workers = [w for w in self._workers if w is not None]
        self._workers = [None] * self.size
        await asyncio.gather(*(asyncio.to_thread(w.stop) for w in workers))
        for worker in workers:
            worker.fail(WorkerLost("the pool is closed"))

    def pids(self) -> list[int | None]:
        """The process ids of the live workers, by slot."""
        return [w.process.pid if w is not None else None for w in self._workers]


if __name__ == "__main__":
    _worker_main(int(sys.argv[1]))
