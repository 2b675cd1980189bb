"""A pass cancelled at a random point around its commit: cancellation is delivered at once and
never swallowed, the commit is never torn, and the store says whether the turn landed.

Many passes at once are each cancelled either a random number of loop steps after they start
(mostly before the commit) or a random moment after their commit started (while it is on its
way, or just after). For every caller: a result (its commit ended first) means its turn is in the
conversation at the version the result names; otherwise `CancelledError`. After
`Store.asettled()` the store holds each turn whole or not at all, and `pending(key)` lists a pass
whose commit started as `cancelled` exactly when its turn is absent. Both backends, both conflict
modes (a key per pass, and one queued key shared by a round).

Real parts: SQLite files, a throwaway PostgreSQL cluster (tests/pg_cluster.py), real passes; the
backend's own `commit` is wrapped only to see when it starts and ends (it still does the work).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from pathlib import Path
from typing import Any

import pytest

from pg_cluster import Cluster
from treadle import Agent, Session, arun_session_loop
from treadle.errors import ConflictError
from treadle.stores import Store
from treadle.testing import ScriptedExecutor
from treadle.testing.scripted import tool_call

#: Cancellations per backend and mode (rounds x passes at once).
ROUNDS, AT_ONCE = 6, 20


class CommitWatch:
    """When each pass's commit started and ended (and its pass id), by the pass's user message."""

    def __init__(self, hold: asyncio.Event | None = None) -> None:
        self.started: dict[str, asyncio.Event] = {}
        self.ended: set[str] = set()
        self.pass_ids: dict[str, str] = {}
        self.cancel_at_start: dict[str, asyncio.Future[Any]] = {}
        """Passes to cancel the moment their commit starts (before it does anything)."""
        self.hold = hold
        """When set, every commit waits for it before it does its work."""

    def event(self, message: str) -> asyncio.Event:
        return self.started.setdefault(message, asyncio.Event())

    def wrap(self, backend: Any) -> None:
        real = backend.commit

        async def commit(pass_id: str, key: str, base: int, rows: Any, **kw: Any) -> int:
            message = str(rows[0].payload["content"])
            self.pass_ids[message] = pass_id
            self.event(message).set()
            if message in self.cancel_at_start:
                self.cancel_at_start.pop(message).cancel()
            try:
                if self.hold is not None:
                    await self.hold.wait()
                version: int = await real(pass_id, key, base, rows, **kw)
                return version
            finally:
                self.ended.add(message)

        backend.commit = commit
        soon = getattr(backend, "commit_soon", None)
        if soon is not None:  # SQLite commits without a task: watched (and held) alike
            later: set[asyncio.Task[None]] = set()

            def commit_soon(
                then: Any, pass_id: str, key: str, base: int, rows: Any, **kw: Any
            ) -> None:
                message = str(rows[0].payload["content"])
                self.pass_ids[message] = pass_id
                self.event(message).set()
                if message in self.cancel_at_start:
                    self.cancel_at_start.pop(message).cancel()

                def ended(outcome: Any) -> None:
                    self.ended.add(message)
                    then(outcome)

                if self.hold is None:
                    soon(ended, pass_id, key, base, rows, **kw)
                    return
                hold = self.hold

                async def when_released() -> None:
                    await hold.wait()
                    soon(ended, pass_id, key, base, rows, **kw)

                task = asyncio.ensure_future(when_released())
                later.add(task)
                task.add_done_callback(later.discard)

            backend.commit_soon = commit_soon


def _pass(store: Store, key: str, message: str) -> Any:
    return arun_session_loop(
        Session.from_user_message(message),
        Session.from_agent_prompt("Answer briefly."),
        executor=ScriptedExecutor([f"answer {message}"]),
        store=store,
        conversation=key,
    )


async def _keep_error(store: Store, key: str, message: str, box: list[BaseException]) -> Any:
    """Run the pass, keeping the exception it raises (a cancelled task drops its notes)."""
    try:
        return await _pass(store, key, message)
    except BaseException as err:
        box.append(err)
        raise


async def _call(
    store: Store, key: str, message: str, watch: CommitWatch, rng: random.Random
) -> tuple[str, int | None, bool, BaseException | None]:
    """Start a pass, cancel it at a random point; what its caller saw (`result` with the
    version, `cancelled`, `conflict`), whether its commit was on its way when cancelled, and the
    exception the caller got."""
    box: list[BaseException] = []
    task = asyncio.ensure_future(_keep_error(store, key, message, box))
    how = rng.random()
    if how < 0.3:  # a random step from the start: mostly before the commit
        for _ in range(rng.randrange(40)):
            await asyncio.sleep(0)
    elif how < 0.6:  # the moment the commit starts
        watch.cancel_at_start[message] = task
        with contextlib.suppress(BaseException):  # its outcome is read below
            await asyncio.wait((task,))
        return _outcome(task, True, box)
    else:  # a random moment after the commit started: on its way, or just landed
        started = asyncio.ensure_future(watch.event(message).wait())
        await asyncio.wait((task, started), return_when=asyncio.FIRST_COMPLETED)
        started.cancel()
        await asyncio.sleep(rng.choice((0.0, 0.0, rng.uniform(0, 0.002), rng.uniform(0, 0.02))))
    mid_commit = watch.event(message).is_set() and message not in watch.ended
    task.cancel()
    with contextlib.suppress(BaseException):  # its outcome is read below
        await asyncio.wait((task,))
    return _outcome(task, mid_commit, box)


def _outcome(
    task: asyncio.Future[Session], mid_commit: bool, box: list[BaseException]
) -> tuple[str, int | None, bool, BaseException | None]:
    error = box[0] if box else None
    if task.cancelled():
        return "cancelled", None, mid_commit, error
    if isinstance(task.exception(), ConflictError):
        return "conflict", None, mid_commit, error
    return "result", task.result().metadata["version"], mid_commit, error


async def _stored(store: Store, key: str) -> dict[str, int]:
    """User message -> the version its turn made; each turn whole (its answer right after)."""
    stored: dict[str, int] = {}
    rows = (await store.conversation(key)).rows
    for n, row in enumerate(rows):
        if row.kind == "user":
            assert rows[n + 1].payload["content"] == f"answer {row.payload['content']}"
            stored[str(row.payload["content"])] = n + 2
    assert len(rows) == 2 * len(stored), rows  # no torn turn
    return stored


async def _rounds(store: Store, queue: bool, seed: int) -> tuple[int, int, int]:
    rng = random.Random(seed)
    watch = CommitWatch()
    watch.wrap(store.backend)
    landed = cancelled = mid_commit = 0
    for r in range(ROUNDS):
        keys = [f"q{seed}-{r}" if queue else f"k{seed}-{r}-{i}" for i in range(AT_ONCE)]
        messages = [f"r{r}-m{i}" for i in range(AT_ONCE)]
        outcomes = await asyncio.gather(
            *(_call(store, k, m, watch, rng) for k, m in zip(keys, messages, strict=True))
        )
        await store.asettled()
        stored: dict[str, int] = {}
        pending: dict[str, str] = {}  # pass id -> status
        for key in set(keys):
            stored.update(await _stored(store, key))
            pending.update({p.pass_id: p.status for p in await store.apending(key)})
        assert set(pending.values()) <= {"cancelled"}, pending  # never left `running`
        for message, (outcome, version, during, error) in zip(messages, outcomes, strict=True):
            mid_commit += during
            if outcome == "result":
                landed += 1
                assert stored.get(message) == version, (message, version, stored.get(message))
            else:
                assert outcome == "cancelled", (message, outcome, error)
                cancelled += 1
                if during:  # cancelled with its commit in flight: the error says so
                    assert error is not None
                    notes = " ".join(getattr(error, "__notes__", ()))
                    assert "the commit of conversation" in notes, notes
                    if "the turn landed" in notes:  # it had ended: the note says how
                        assert message in stored, notes
            if message in watch.pass_ids:  # its commit started: the store says if it landed
                listed = pending.get(watch.pass_ids[message]) == "cancelled"
                assert listed == (message not in stored), (message, outcome, listed)
            else:
                assert message not in stored
    return landed, cancelled, mid_commit


@pytest.mark.parametrize("mode", ["raise", "queue"])
def test_every_cancelled_caller_sees_what_the_store_holds(url: str, mode: str) -> None:
    async def main() -> tuple[int, int, int]:
        async with Store.open(url, on_conflict=mode) as store:  # type: ignore[arg-type]
            return await _rounds(store, mode == "queue", seed=hash((url, mode)) % 1000)

    landed, cancelled, mid_commit = asyncio.run(main())
    print(f"{mode}: {landed} landed, {cancelled} cancelled, {mid_commit} mid-commit")
    assert landed + cancelled == ROUNDS * AT_ONCE
    # Both outcomes happen, and many cancellations arrived while a commit was on its way (the
    # window this is about), so the assertions above were really exercised.
    assert landed > 0 and cancelled > 0, (landed, cancelled)
    assert mid_commit >= 20, (landed, cancelled, mid_commit)


def test_a_timeout_fires_at_once_mid_commit(url: str) -> None:
    """`asyncio.timeout` expiring while the commit is on its way raises `TimeoutError` at once:
    the code after the pass in its block does not run; the turn then lands (or not) shielded."""

    async def main() -> None:
        hold = asyncio.Event()
        async with Store.open(url) as store:
            watch = CommitWatch(hold)
            watch.wrap(store.backend)
            after: list[str] = []
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(None) as deadline:

                    async def arm() -> None:
                        await watch.event("hi").wait()
                        deadline.reschedule(asyncio.get_running_loop().time())

                    arming = asyncio.ensure_future(arm())
                    await _pass(store, "k", "hi")
                    after.append("ran")  # pragma: no cover - the assertion below says it did not
            await arming
            assert after == [] and "hi" not in watch.ended  # raised while the commit waits
            hold.set()
            await store.asettled()
            assert await _stored(store, "k") == {"hi": 2}  # landed, whole
            assert await store.apending("k") == []

    asyncio.run(main())


def test_an_agent_cancelled_in_its_first_commit_raises(url: str) -> None:
    """An Agent run with a handoff (two passes) cancelled during the first pass's commit raises
    `CancelledError`; the second agent never runs."""

    async def main() -> None:
        hold = asyncio.Event()
        async with Store.open(url) as store:
            watch = CommitWatch(hold)
            watch.wrap(store.backend)
            second = ScriptedExecutor(["b answers"])
            b = Agent("b", "Second.", executor=second)
            a = Agent(
                "a",
                "First.",
                executor=ScriptedExecutor([tool_call("transfer_to_b", {})]),
                handoffs=[b],
            )
            run = asyncio.ensure_future(
                a.run(Session.from_user_message("hi"), store=store, conversation="k")
            )
            await watch.event("hi").wait()
            run.cancel()
            with pytest.raises(asyncio.CancelledError):
                await run
            hold.set()
            await store.asettled()
            assert len(watch.started) == 1 and second.requests == []

    asyncio.run(main())


def test_a_commit_blocked_on_the_lock_does_not_hold_its_cancelled_caller(pg: Cluster) -> None:
    """PostgreSQL: another client holds the conversation's commit lock. The cancelled caller's
    `TimeoutError` arrives while the lock is still held; the commit goes on, and lands once the
    lock goes. `aclose(grace)` does not wait past its bound for a commit still stuck there."""
    import psycopg

    dsn = str(pg.new_database())

    async def blocked_pass(store: Store, message: str, events: list[str]) -> None:
        watch = CommitWatch()
        watch.wrap(store.backend)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(None) as deadline:

                async def arm() -> None:
                    await watch.event(message).wait()
                    await asyncio.sleep(0.05)  # the commit is now waiting on the lock
                    deadline.reschedule(asyncio.get_running_loop().time())

                arming = asyncio.ensure_future(arm())
                await _pass(store, "k", message)
        await arming
        events.append("caller timed out")

    async def main() -> None:
        events: list[str] = []
        async with Store.open(dsn) as store:
            await _pass(store, "k", "first")
            blocker = await psycopg.AsyncConnection.connect(dsn)
            await blocker.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", ("k",))
            await blocked_pass(store, "second", events)
            with pytest.raises(TimeoutError):  # still blocked on the lock
                async with asyncio.timeout(0.2):
                    await store.asettled()
            events.append("lock released")
            await blocker.rollback()
            await store.asettled()
            assert await _stored(store, "k") == {"first": 2, "second": 4}
            assert await store.apending("k") == []
            await blocker.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", ("k",))
            await blocked_pass(store, "third", events)
            await store.aclose(grace=0.2)  # bounded: it returns with the commit still stuck
            events.append("store closed")
        events.append("lock released")
        await blocker.rollback()
        await blocker.close()
        assert events == [
            "caller timed out", "lock released", "caller timed out", "store closed", "lock released"
        ]  # fmt: skip
        async with Store.open(dsn) as store:  # the stuck commit landed whole, or not at all
            stored = await _stored(store, "k")
            assert stored in ({"first": 2, "second": 4}, {"first": 2, "second": 4, "third": 6})

    asyncio.run(main())


def test_a_commit_left_on_a_closed_loop_is_not_waited_for(tmp_path: Path) -> None:
    """A loop run with `run_until_complete` and closed without cancelling its tasks (as worker
    threads and older frameworks do) drops a cancelled pass's commit still in flight:
    `asettled` and `aclose` on another loop must not wait for a task that can never end."""
    url = str(tmp_path / "s.db")
    store = Store.open(url)

    async def first() -> None:
        await store.__aenter__()
        real = store.backend.commit
        started = asyncio.Event()

        async def slow_commit(*args: Any, **kwargs: Any) -> Any:
            started.set()
            await asyncio.sleep(0.5)  # still in flight when the loop closes
            return await real(*args, **kwargs)

        store.backend.commit = slow_commit  # type: ignore[method-assign]
        store.backend.commit_soon = None  # type: ignore[attr-defined]  # a commit task, not SQLite's own way
        task = asyncio.ensure_future(
            arun_session_loop(
                Session.from_user_message("A"),
                Session.from_agent_prompt("x"),
                executor=ScriptedExecutor(["answer"]),
                store=store,
                conversation="k",
            )
        )
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    loop = asyncio.new_event_loop()
    loop.run_until_complete(first())
    loop.close()

    async def second() -> list[str]:
        await asyncio.wait_for(store.asettled(), 60)  # a hang guard, not a time assertion
        await store.aclose(grace=60)
        async with Store.open(url) as again:
            return [str(row.payload.get("content")) for row in (await again.conversation("k")).rows]

    assert asyncio.run(second()) in ([], ["A", "answer"])  # whole turn or none


@pytest.mark.parametrize("with_pass", [False, True])
def test_a_commit_cancelled_before_it_starts_settles_its_pass(url: str, with_pass: bool) -> None:
    """A commit task cancelled before its first step (a shutdown cancelling every task, its
    pass or not) never runs its body: its pass still ends (`CancelledError`: nothing landed,
    the pass is listed `cancelled`) and the task leaves the store's in-flight set."""
    from treadle.stores.journal import inflight

    async def main() -> None:
        loop = asyncio.get_running_loop()

        def factory(loop: asyncio.AbstractEventLoop, coro: Any) -> asyncio.Task[Any]:
            task: asyncio.Task[Any] = asyncio.Task(coro, loop=loop)
            if getattr(coro, "__name__", "") == "_commit":
                task.cancel()  # before its first step
                if with_pass:
                    asyncio.current_task().cancel()  # type: ignore[union-attr]
            return task

        async with Store.open(url) as store:
            store.backend.commit_soon = None  # type: ignore[attr-defined]  # a commit task, not SQLite's own way
            loop.set_task_factory(factory)
            try:
                # wait_for only guards against a hang; it asserts no time
                with pytest.raises(asyncio.CancelledError):
                    await asyncio.wait_for(asyncio.shield(_pass(store, "k", "A")), 60)
            finally:
                loop.set_task_factory(None)
            await asyncio.sleep(0)
            assert not inflight(store.backend)
            await asyncio.wait_for(store.asettled(), 60)
            assert (await store.conversation("k")).rows == ()
            assert [p.status for p in await store.apending("k")] == ["cancelled"]

    asyncio.run(main())


@pytest.mark.skipif(
    not hasattr(asyncio, "eager_task_factory"), reason="eager tasks are Python 3.12+"
)
def test_an_eager_commit_that_fails_at_once_leaves_nothing_in_flight(tmp_path: Path) -> None:
    """With `asyncio.eager_task_factory` a commit failing before its first suspension ends
    inside `ensure_future`: its pass gets the error and the task is not kept in flight."""
    from treadle.errors import StoreError
    from treadle.stores.journal import inflight

    async def main() -> None:
        asyncio.get_running_loop().set_task_factory(asyncio.eager_task_factory)  # type: ignore[attr-defined,unused-ignore]
        async with Store.open(str(tmp_path / "s.db")) as store:

            async def failing(*args: Any, **kwargs: Any) -> int:
                raise StoreError("the store failed at once")

            store.backend.commit = failing  # type: ignore[method-assign]
            store.backend.commit_soon = None  # type: ignore[attr-defined]  # a commit task, not SQLite's own way
            outcomes = await asyncio.gather(
                *(_pass(store, f"k{i}", f"m{i}") for i in range(20)), return_exceptions=True
            )
            assert {type(o) for o in outcomes} == {StoreError}
            assert not inflight(store.backend)

    asyncio.run(main())
