"""The worker process of `backend="process"`: what `ProcessPool` spawns, one per worker.

A fresh interpreter (`python -I -c` calling `_worker_entry([FD])`, see
`treadle.runtime.child_python`) reads its first message (the agent's spec, options and the
driver's `sys.path`) from the socket the driver passed it, builds a `PassWorker`, then serves
items on its own event loop: the socket is read and written there (an asyncio protocol, no
thread), every item runs as a task, and what one turn of the loop finished goes back as one
pickled batch. This module must never let an item go unanswered (every failure of `run_wire` is
an outcome) and never keep the process alive once the driver is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import logging
import os
import socket
import sys
from multiprocessing.connection import Connection
from typing import Any

from treadle.distributed.pipe import (
    Frames,
    Unreadable,
    dumps_batch,
    frame,
    messages,
    refuse_outcome,
)
from treadle.distributed.process import _STOP_GRACE, LEASE_TIMEOUT

__all__: list[str] = []

log = logging.getLogger("treadle.distributed")


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


class _DriverLink(asyncio.Protocol):
    """The worker's end of the socket, on its event loop: each frame the driver sent is read in
    the loop's own callback. A reader and a writer thread used to do this, each batch a thread
    hand-off and a wake-up of the loop (docs/performance.md, process workers)."""

    def __init__(self, on_batch: Any, post: Any) -> None:
        self.on_batch = on_batch
        self.post = post
        self.frames = Frames()
        self.transport: asyncio.Transport | None = None
        self.closed = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            for batch in messages(self.frames, data):
                self.on_batch(batch)
                if batch is None:  # the stop message: nothing follows it
                    return
        except Unreadable as err:  # which pass it held is unknown: say why and stop
            self._unreadable(str(err))

    def _unreadable(self, why: str) -> None:
        # Say why and end: the driver retries the batch's passes alone, on new workers.
        self.post(("unreadable", why))
        if self.transport is not None:
            self.transport.pause_reading()
        self.on_batch(None)

    def eof_received(self) -> bool:
        self.on_batch(None)  # the driver is gone: stop
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)
        self.on_batch(None)


async def _serve(conn: Connection, spec: dict[str, Any], options: dict[str, Any]) -> None:
    from treadle.distributed.worker import PassWorker, worker_name
    from treadle.llm.shared_limits import install_shared_limits, pause_shared

    loop = asyncio.get_running_loop()
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
    try:
        worker = PassWorker(spec, **options)
    except Exception as err:
        with contextlib.suppress(OSError):
            conn.send([("failed", f"{type(err).__name__}: {err}")])
        return
    # Start-up's heap (imports, the agent) lives as long as this worker: collected once and
    # frozen, no full collection scans it again (the first one cost a pass 30 ms). The price: a
    # start-up object that later becomes cyclic garbage is never collected (docs/performance.md).
    gc.collect()
    gc.freeze()

    pending: list[Any] = []
    link: _DriverLink | None = None

    def flush() -> None:
        if not pending:
            return
        batch = pending[:]
        pending.clear()
        transport = link.transport if link is not None else None
        if transport is None or transport.is_closing():  # the driver is gone: nothing to tell
            return
        try:  # an outcome pickle refuses fails alone (`refuse_outcome`)
            transport.write(frame(dumps_batch(batch, refuse_outcome)))
        except Exception as err:  # a bug here: say so, and keep sending what follows
            log.error("a batch for the driver could not be sent: %r", err)

    def post(message: Any) -> None:
        """Queue `message` for the driver: all posted in one loop iteration go as one batch."""
        if not pending:
            loop.call_soon(flush)
        pending.append(message)

    stop = asyncio.Event()
    tasks: set[asyncio.Task[None]] = set()

    async def run_one(call_id: int, item: dict[str, Any]) -> None:
        # `run_json` inlined (one coroutine less a pass, in every step of its task): every
        # failure of the item is its outcome, so the driver always hears.
        try:
            outcome = await worker.run_wire(item)
        except Exception as err:
            outcome = worker.unrunnable(item, err)
        post(("done", call_id, outcome))

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

    sock = socket.socket(fileno=os.dup(conn.fileno()))  # the loop's from here on
    conn.close()
    sock.setblocking(False)
    link = _DriverLink(on_batch, post)
    await loop.connect_accepted_socket(lambda: link, sock)
    post(("ready", worker.name))
    await stop.wait()
    for task in list(tasks):
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.to_thread(worker.close)
    flush()
    if link.transport is not None:
        link.transport.close()  # after what is buffered is written
        with contextlib.suppress(TimeoutError):  # a driver that stops reading kills us anyway
            await asyncio.wait_for(asyncio.shield(link.closed), _STOP_GRACE)


if __name__ == "__main__":
    _worker_main(int(sys.argv[1]))
