"""One thread per SQLite database file in this process, owning the file's connection.

Statements on a file run on its thread in the order they were submitted, so writes of this
process never wait on each other's locks in Python, and the event loop awaits only a future.
Jobs that queue up together run in one transaction (group commit: many passes ending at once
pay for one commit); a job that fails undoes only its own writes (the batch stops at it and
runs again with a savepoint per job); a job's future is settled only once that transaction has
committed. When SQLite undoes the whole transaction itself (disk full, an I/O error), the job
it happened in fails with a `StoreError` and the batch runs again without it: no statement of
a write ever runs outside a transaction, so nothing is half-written. A failure at the COMMIT
itself (the write-ahead log cannot grow) fails every job of that transaction: none was written.
A thread that dies fails
its batch and every later job with a `StoreError` (no caller waits forever). A forked child
starts its own threads (the parent's are not in it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import queue
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from treadle.errors import StoreError
from treadle.stores.records import RowCache
from treadle.stores.sqlite_heads import Head, HeadCache
from treadle.stores.sqlite_jobs import HERE, Job, deliver

__all__ = ["DatabaseThread", "Head", "HeadCache", "release", "thread_for"]

T = TypeVar("T")

#: The first 16 bytes of every SQLite database file.
_HEADER = b"SQLite format 3\x00"

#: Most jobs that share one transaction (and one commit) when they queue up together.
MAX_BATCH = 256


class DatabaseThread:
    """The one thread (and connection) of a database file in this process: every statement on
    the file runs here, in the order submitted."""

    def __init__(self, path: Path, connect: Callable[[Path], sqlite3.Connection]) -> None:
        self.path = path
        self._connect = connect
        self.users = 0
        self.cache = RowCache()
        """Validated rows of the file's conversations (touched only on this thread)."""
        self.heads = HeadCache()
        """Heads of the file's conversations (touched only on this thread; see `HeadCache`)."""
        self._data_version: int | None = None  # PRAGMA data_version when the heads were true
        self.lost: str | None = None
        """Why the file this thread opened is no longer at its path (deleted, replaced)."""
        self.dead: StoreError | None = None
        """What every job gets once the thread has died (see `_die`) or stopped."""
        self._identity: tuple[int, int] | None = None
        self._wal: tuple[int, int] | None = None  # the -wal file's identity once it exists
        self._fd: int | None = None  # the database file, read-only: its header is checked
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._conn: sqlite3.Connection | None = None  # its connection, once open (to interrupt)
        ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._serve, args=(ready,), name=f"treadle-sqlite {path.name}", daemon=True
        )
        self._thread.start()
        ready.result()  # raises the error of a file that cannot be opened

    def _serve(self, ready: concurrent.futures.Future[None]) -> None:
        try:
            conn = self._connect(self.path)
        except BaseException as err:
            ready.set_exception(err)
            return
        with contextlib.suppress(OSError):
            self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            found = os.fstat(self._fd)
            self._identity = (found.st_dev, found.st_ino)
        self._conn = conn
        ready.set_result(None)
        batch: list[Job] = []
        try:
            stopping = False
            while not stopping:
                job = self._jobs.get()
                if job is None:
                    break
                batch = [job]
                # What queued meanwhile shares one commit. This thread is the queue's only
                # reader, so the jobs `qsize` counts are there to take: one call a batch to
                # count them, not an `empty()` and a `len()` a job (nor a `queue.Empty`
                # raised and caught at the end of every batch).
                take = self._jobs.get_nowait
                for _ in range(min(self._jobs.qsize(), MAX_BATCH - 1)):
                    more = take()
                    if more is None:
                        stopping = True
                        break
                    batch.append(more)
                self._run_batch(conn, batch)
                batch = []
            # Stopped (its last user closed the store). A call that took this thread just
            # before that close, on another thread, may hand it a job after the stop: it and
            # any later one fail with a StoreError (`submit` drains what it adds once `dead`
            # is set) instead of waiting for ever for a thread that has gone.
            self.dead = StoreError(f"the SQLite store {self.path} is closed; open a new Store.")
            self._drain()
        except BaseException as err:  # a bug: no caller may wait on a thread that is gone
            self._die(conn, batch, err)
        finally:
            conn.close()
            if self._fd is not None:
                os.close(self._fd)

    def _die(self, conn: sqlite3.Connection, batch: list[Job], err: BaseException) -> None:
        """The thread ends on `err`: its batch, what queued and every later job (`submit`
        drains what it adds) fail with a `StoreError`; what was not committed is undone."""
        self.dead = StoreError(
            f"the SQLite store {self.path}'s database thread failed ({type(err).__name__}: "
            f"{err}); nothing of its uncommitted writes was made. Open the store again."
        )
        self.dead.__cause__ = err
        with contextlib.suppress(sqlite3.Error):
            if conn.in_transaction:
                conn.rollback()
        deliver(self.path, [(job, None, self.dead) for job in batch])
        self._drain()

    def _drain(self) -> None:
        """Fail every queued job with `dead` (the thread is gone)."""
        failed: list[tuple[Job, Any, BaseException | None]] = []
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                failed.append((job, None, self.dead))
        deliver(self.path, failed)

    def _run_batch(self, conn: sqlite3.Connection, batch: list[Job]) -> None:
        """Run the jobs in one transaction; hand back their outcomes once it is durable.

        Jobs run without savepoints (two statements fewer per write). At the first write job
        that raises (or any job after which SQLite has ended the transaction itself, as it
        does on a full disk or an I/O error), the batch stops there: no later job's statement
        runs, the transaction is undone and the batch runs again with a savepoint per write
        (`_rerun`). Every job runs, even one whose caller stopped waiting: a caller cancelled
        after it submitted a write never leaves that write half-decided."""
        for job in batch:
            if not job[3]:
                break
        else:  # only reads (a turn's reads often queue together): no write lock, no commit
            self._run_reads(conn, batch)
            return
        error = self._begin(conn)
        if error is not None:
            deliver(self.path, [(job, None, error) for job in batch])
            return
        outcomes = self._run_plain(conn, batch)
        dropped: list[tuple[Job, Any, BaseException | None]] = []
        if outcomes is None:
            self._undo(conn)
            outcomes, dropped, error = self._rerun(conn, batch)
            if error is not None:
                deliver(self.path, dropped + [(job, None, error) for job, _, _ in outcomes])
                return
            if not outcomes:  # every job was dropped: nothing to commit
                deliver(self.path, dropped)
                return
        # The file may have gone while the jobs ran (a large write takes a while): look again
        # before committing, and undo rather than commit into a file no one else sees.
        lost = self._check_file()
        if lost is not None:
            conn.rollback()
            deliver(self.path, dropped + [(job, None, lost) for job, _, _ in outcomes])
            return
        try:
            conn.execute("COMMIT")
        except sqlite3.Error as err:
            self._undo(conn)  # the caches may hold rows of the commits that were just undone
            outcomes = [(job, None, err) for job, _, _ in outcomes]
        else:  # and once more after: gone during the commit itself, the write is unseen
            lost = self._check_file(committed=True)
            if lost is not None:
                outcomes = [(job, None, lost) for job, _, _ in outcomes]
        deliver(self.path, dropped + outcomes)

    def _run_reads(self, conn: sqlite3.Connection, batch: list[Job]) -> None:
        """Run a batch of reads in one read transaction (`BEGIN` without `IMMEDIATE`: other
        processes' writers are not held up, and there is nothing to commit or to check the
        file for afterwards). Its `PRAGMA data_version` starts the read, so the heads are
        checked against the snapshot the reads see."""
        error = self._begin(conn, write=False)
        if error is not None:
            deliver(self.path, [(job, None, error) for job in batch])
            return
        outcomes: list[tuple[Job, Any, BaseException | None]] = []
        for job in batch:
            try:
                outcomes.append((job, job[0](conn), None))
            except BaseException as err:  # a read has nothing to undo
                outcomes.append((job, None, err))
        with contextlib.suppress(sqlite3.Error):  # ends the read; nothing was written
            if conn.in_transaction:
                conn.execute("COMMIT")
        deliver(self.path, outcomes)

    def _undo(self, conn: sqlite3.Connection) -> None:
        """Undo the transaction, if SQLite has not already, and forget the caches (the jobs
        that ran updated them as if they had committed)."""
        if conn.in_transaction:
            conn.rollback()
        self.cache.clear()
        self.heads.clear()

    def _begin(self, conn: sqlite3.Connection, *, write: bool = True) -> BaseException | None:
        """Begin a transaction, holding the write lock unless not `write` (an error: it did
        not begin, and nothing is open)."""
        lost = self._check_file()
        if lost is not None:
            return lost
        try:
            conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            # Holding the write lock (or, for reads, starting the read's snapshot): another
            # process's commit since the last transaction moved data_version, and the heads
            # may be stale (this connection's own commits leave it, and update the heads
            # they change).
            seen = conn.execute("PRAGMA data_version").fetchone()[0]
        except sqlite3.Error as err:
            if conn.in_transaction:
                conn.rollback()
            return err
        if seen != self._data_version:
            self.heads.clear()
            self._data_version = seen
        return None

    @staticmethod
    def _run_plain(
        conn: sqlite3.Connection, batch: list[Job]
    ) -> list[tuple[Job, Any, BaseException | None]] | None:
        """Each job's outcome, run without savepoints; None at the first write job that raises
        or the first job after which the transaction is gone (the batch stopped there: a later
        job's statements would run outside any transaction, each committing on its own)."""
        outcomes: list[tuple[Job, Any, BaseException | None]] = []
        for job in batch:
            assert conn.in_transaction  # no statement of the write path outside a transaction
            try:
                value = job[0](conn)
            except BaseException as err:
                if not job[3] or not conn.in_transaction:
                    return None
                outcomes.append((job, None, err))  # a read has nothing to undo
                continue
            if not conn.in_transaction:
                return None
            outcomes.append((job, value, None))
        return outcomes

    def _rerun(
        self, conn: sqlite3.Connection, batch: list[Job]
    ) -> tuple[
        list[tuple[Job, Any, BaseException | None]],
        list[tuple[Job, Any, BaseException | None]],
        BaseException | None,
    ]:
        """Run the batch again, each write in its own savepoint, so a write that raises undoes
        only its own statements. A job after which SQLite has undone the whole transaction
        itself (disk full, an I/O error) cannot be undone alone: it fails with a `StoreError`
        saying what SQLite said, and the batch runs again without it (the earlier jobs' work
        was undone with it). Each round drops one job: at most the batch's size of rounds.
        Returns the outcomes to commit, the dropped jobs' outcomes, and an error when a
        transaction could not begin (nothing is then open)."""
        jobs = list(batch)
        dropped: list[tuple[Job, Any, BaseException | None]] = []
        while jobs:
            error = self._begin(conn)
            if error is not None:
                return [(job, None, None) for job in jobs], dropped, error
            outcomes, ended = self._run_saved(conn, jobs)
            if ended is None:
                return outcomes, dropped, None
            at, cause = ended
            self._undo(conn)
            said = f": {cause}" if cause is not None else ""
            failure = StoreError(
                f"the SQLite store {self.path} failed{said}; SQLite undid the whole "
                "transaction, so nothing of this write was made (check the disk's free "
                "space and the file's health)."
            )
            failure.__cause__ = cause
            dropped.append((jobs.pop(at), None, failure))
        return [], dropped, None

    @staticmethod
    def _run_saved(
        conn: sqlite3.Connection, jobs: list[Job]
    ) -> tuple[
        list[tuple[Job, Any, BaseException | None]], tuple[int, BaseException | None] | None
    ]:
        """Each job's outcome, a write in its own savepoint; and, when a job left no
        transaction, its index and what it raised (the batch stopped there)."""
        outcomes: list[tuple[Job, Any, BaseException | None]] = []
        for at, job in enumerate(jobs):
            assert conn.in_transaction  # no statement of the write path outside a transaction
            if not job[3]:
                conn.execute("SAVEPOINT job")
            try:
                value = job[0](conn)
            except BaseException as err:
                if not conn.in_transaction:
                    return outcomes, (at, err)
                if not job[3]:
                    conn.execute("ROLLBACK TO job")
                    conn.execute("RELEASE job")
                outcomes.append((job, None, err))
                continue
            if not conn.in_transaction:
                return outcomes, (at, None)
            if not job[3]:
                conn.execute("RELEASE job")
            outcomes.append((job, value, None))
        return outcomes, None

    def _check_file(self, *, committed: bool = False) -> StoreError | None:
        """A `StoreError` when the file at the path is not the one this thread opened.

        SQLite keeps writing to the inode it opened: a file deleted (or replaced by another)
        while in use would take this process's commits where no other process, and no later
        open, ever sees them. A transaction stats the file before it begins, before it commits
        and after (`committed`: the error then says the write went to the old file). A file
        swapped in the instant between the last two checks and the commit itself cannot be
        caught by any check from this side: do not replace a store's file while a process
        has it open.
        """
        if self.lost is None and self._identity is not None:
            try:
                found = os.stat(self.path)
            except FileNotFoundError:
                self.lost = "was deleted"
            except OSError as err:
                self.lost = f"cannot be checked ({err.strerror})"
            else:
                if (found.st_dev, found.st_ino) != self._identity:
                    self.lost = "was replaced by another file"
                else:
                    self.lost = self._check_contents()
            if self.lost is not None:
                self.cache.clear()
                self.heads.clear()
        if self.lost is None:
            return None
        outcome = (
            "this write went only to the file that is no longer there (no later open sees it)"
            if committed
            else "nothing was written"
        )
        return StoreError(
            f"the SQLite store {self.path} {self.lost} while this process had it open; "
            f"{outcome}. Open the store again (Store.sqlite(path)) to use the file now at "
            "that path."
        )

    def _check_contents(self) -> str | None:
        """Why the (same) file is unusable: its header overwritten, or its -wal file (which
        this connection keeps open while it lives) deleted."""
        if self._fd is not None and os.pread(self._fd, 16, 0) not in (_HEADER, b""):
            return "was overwritten (it no longer starts as a SQLite database: corrupted)"
        try:
            wal = os.stat(f"{self.path}-wal")
        except FileNotFoundError:
            return None if self._wal is None else "lost its write-ahead log (-wal deleted)"
        except OSError:
            return None
        if self._wal is None:
            self._wal = (wal.st_dev, wal.st_ino)
        elif self._wal != (wal.st_dev, wal.st_ino):
            return "had its write-ahead log (-wal) replaced"
        return None

    def submit(
        self, fn: Callable[[sqlite3.Connection], T], *, read_only: bool = False
    ) -> asyncio.Future[T]:
        """Run `fn(connection)` on the thread; a future of the calling event loop settles with
        its outcome (one wake-up of that loop per batch, not per job). `read_only`: `fn` writes
        nothing, so it runs without a savepoint of its own."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = asyncio.Future(loop=loop)  # not create_future: a call less
        self._jobs.put((fn, loop, future, read_only))
        if self.dead is not None:  # set before the thread drained: this job may be left
            self._drain()
        return future

    def submit_then(
        self,
        fn: Callable[[sqlite3.Connection], T],
        then: Callable[[T | None, BaseException | None], None],
    ) -> None:
        """Run the write `fn(connection)` on the thread; `then(value, error)` is called on the
        calling event loop with its outcome, in the one call that settles its batch there (no
        future, and no loop callback of its own). `then` must not raise (what it raises is
        reported to the loop's exception handler)."""
        self._jobs.put((fn, asyncio.get_running_loop(), then, False))
        if self.dead is not None:
            self._drain()

    def submit_here(
        self,
        fn: Callable[[sqlite3.Connection], T],
        then: Callable[[T | None, BaseException | None], None],
    ) -> None:
        """Run the write `fn(connection)`; `then(value, error)` is called on this thread once
        its transaction is durable (or failed), whatever becomes of the caller's loop. `then`
        must not raise."""
        self._jobs.put((fn, HERE, then, False))  # type: ignore[arg-type]
        if self.dead is not None:
            self._drain()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop after the jobs already queued (waits, at most `timeout` seconds, unless called
        on the thread itself). A thread still busy then (a write waiting for another client's
        lock, up to the busy timeout) is left to end alone: a daemon, its statement interrupted
        (a busy wait is not: its job runs, or fails, when the wait ends)."""
        self._jobs.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=max(0.0, timeout))
            conn = self._conn
            if self._thread.is_alive() and conn is not None:
                with contextlib.suppress(sqlite3.Error):
                    conn.interrupt()


_writers: dict[Path, DatabaseThread] = {}
_writers_lock = threading.Lock()
_writers_pid = os.getpid()


def thread_for(path: Path, connect: Callable[[Path], sqlite3.Connection]) -> DatabaseThread:
    """The thread of the database file at `path`, started on first use (one more user)."""
    global _writers_pid
    with _writers_lock:
        if _writers_pid != os.getpid():  # a forked child: the parent's threads are not here
            _writers.clear()
            _writers_pid = os.getpid()
        writer = _writers.get(path)
        if writer is not None and (writer.lost or writer.dead) is not None:  # a new one
            del _writers[path]
            writer = None
        if writer is None:
            writer = _writers[path] = DatabaseThread(path, connect)
        writer.users += 1
        return writer


def release(writer: DatabaseThread, timeout: float = 30.0) -> None:
    """One user fewer; the thread stops (closing its connection) with its last user, waited
    for at most `timeout` seconds (see `DatabaseThread.stop`)."""
    with _writers_lock:
        writer.users -= 1
        if writer.users > 0:
            return
        if _writers.get(writer.path) is writer:
            del _writers[writer.path]
        elif writer.lost is None:  # a forked parent's thread, which is not in this process
            return
    writer.stop(timeout)
