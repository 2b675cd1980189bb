"""A pass cancelled while one of its journal calls is in flight: the call goes on wherever the
backend runs it, so the journal must neither write its entries twice nor lose a pending pass.

- A pass cancelled while its journal write (`record`) is in flight: the rows it was writing are
  written again when the pass records its end; they are in the journal once, and a resume
  continues from one copy of them.
- A resume cancelled while its takeover (`claim`) is in flight: the takeover lands, but nobody
  runs the pass it took; the pass stays listed by `pending()` and resumable, in this process and
  in another, and the conversation is not stuck waiting for it.

Both backends (a SQLite file, a database of the throwaway PostgreSQL cluster). The backend's own
call is wrapped only to cancel the caller the moment it starts; it still does its work.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from treadle import Session, arun_session_loop, tool
from treadle.errors import ConfigurationError, ConflictError
from treadle.session import ChunkRow
from treadle.stores import Store
from treadle.testing import ScriptedExecutor
from treadle.testing.scripted import tool_call

#: Tasks of loops these tests close on purpose, kept for the session: collected mid-suite,
#: a coroutine would run its `finally` blocks inside another test (GeneratorExit, asyncio's
#: destroyed-task log).
KEEP: list[asyncio.Task[Any]] = []
AGENT = Session.from_agent_prompt("Deploy when asked.")


@tool(needs_approval=True)
def deploy(target: str) -> str:
    """Deploy `target`."""
    return f"deployed {target}"


@tool
def lookup(target: str) -> str:
    """Look `target` up."""
    return f"found {target}"


@pytest.fixture
def store(url: str) -> Iterator[Store]:
    opened = Store.open(url)
    yield opened
    opened.close()


def _cancel_at(store: Store, method: str) -> dict[str, asyncio.Future[Any]]:
    """Wrap the backend's `method`: the first call after a victim is set cancels it, then runs."""
    victim: dict[str, asyncio.Future[Any]] = {}
    real = getattr(store.backend, method)

    async def wrapped(*args: Any, **kw: Any) -> Any:
        target = victim.pop("task", None)
        if target is not None:
            target.cancel()
        return await real(*args, **kw)

    setattr(store.backend, method, wrapped)
    return victim


def _kinds(session: Session) -> list[str]:
    return [r.kind for r in session.rows]


async def test_a_journal_write_cancelled_in_flight_is_kept_once(store: Store) -> None:
    victim = _cancel_at(store, "record")
    task = asyncio.ensure_future(
        arun_session_loop(
            Session.from_user_message("look x up"),
            AGENT,
            executor=ScriptedExecutor([tool_call("lookup", {"target": "x"}), "done"]),
            tools=[lookup],
            store=store,
            conversation="k",
        )
    )
    victim["task"] = task
    with pytest.raises(asyncio.CancelledError):
        await task
    await store.asettled()
    (pending,) = await store.apending("k")
    assert pending.status == "cancelled"
    await arun_session_loop(
        Session(),
        AGENT,
        executor=ScriptedExecutor([tool_call("lookup", {"target": "x"}), "done"]),
        tools=[lookup],
        store=store,
        conversation=pending,
    )
    rows = (await store.conversation("k")).rows
    # one user row and one assistant row asking for the call (the journal's single copy), then
    # whatever the resume added: never the first two twice
    assert [r.kind for r in rows][:2] == ["user", "assistant"]
    assert [r.kind for r in rows].count("user") == 1
    ids = [
        c["id"] for r in rows if r.kind == "assistant" for c in r.payload.get("tool_calls") or ()
    ]
    assert len(ids) == len(set(ids)), ids


async def _waiting(store: Store, deploy_tool: Any = deploy) -> Any:
    """Conversation `k` after a pass that stopped for an approval of `deploy_tool`: its
    pending pass."""
    await arun_session_loop(
        Session.from_user_message("deploy x"),
        AGENT,
        executor=ScriptedExecutor([tool_call("deploy", {"target": "x"})]),
        tools=[deploy_tool],
        store=store,
        conversation="k",
    )
    (pending,) = await store.apending("k")
    return pending


async def _resume_cancelled_at_claim(store: Store, pending: Any, deploy_tool: Any = deploy) -> None:
    """A resume of `pending` approving its call, cancelled the moment its takeover starts (the
    takeover itself goes on)."""
    victim = _cancel_at(store, "claim")
    task = asyncio.ensure_future(
        arun_session_loop(
            Session(), AGENT, executor=ScriptedExecutor(["never"]), tools=[deploy_tool],
            store=store, conversation=pending,
            approvals={pending.pending_approvals[0]["id"]: True},
        )
    )  # fmt: skip
    victim["task"] = task
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_resume_cancelled_at_its_takeover_leaves_the_pass_resumable(store: Store) -> None:
    pending = await _waiting(store)
    call_id = pending.pending_approvals[0]["id"]
    await _resume_cancelled_at_claim(store, pending)
    await store.asettled()
    (again,) = await store.apending("k")
    assert again.pass_id == pending.pass_id
    assert again.resumable
    assert again.pending_approvals == pending.pending_approvals
    out = await arun_session_loop(
        Session(),
        AGENT,
        executor=ScriptedExecutor(["Deployed."]),
        tools=[deploy],
        store=store,
        conversation=again,
        approvals={call_id: True},
    )
    assert out.rows[-1].payload["content"] == "Deployed."
    assert _kinds(await store.conversation("k")) == [
        "user",
        "assistant",
        "tool_result",
        "assistant",
    ]
    assert await store.apending("k") == []


CHILD = """
import sys
from treadle import Session, run_session_loop, tool
from treadle.stores import Store
from treadle.testing import ScriptedExecutor

@tool(needs_approval=True)
def deploy(target: str) -> str:
    '''Deploy.'''
    return "deployed " + target

store = Store.open(sys.argv[1])
(pending,) = store.pending("k")
assert pending.resumable, pending
out = run_session_loop(Session(), Session.from_agent_prompt("Deploy when asked."),
    executor=ScriptedExecutor(["Deployed."]), tools=[deploy], store=store,
    conversation=pending, approvals={pending.pending_approvals[0]["id"]: True})
print(out.rows[-1].payload["content"])
store.close()
"""


async def test_another_process_resumes_a_pass_whose_takeover_was_cancelled(
    store: Store, url: str
) -> None:
    pending = await _waiting(store)
    await _resume_cancelled_at_claim(store, pending)
    await store.asettled()
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", CHILD, url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "Deployed."


async def test_results_of_parallel_calls_are_each_journaled_once(store: Store) -> None:
    """Tool results of one round are written as they finish, at once: each write takes its
    own place in the journal, none overwrites or drops another. The pass is cancelled once all
    three results are durable (while the model is asked again): the resume adopts all three and
    runs none of them again."""
    ran: list[str] = []
    three = asyncio.Event()

    @tool
    async def probe(target: str) -> str:
        """Probe `target`."""
        await asyncio.sleep(0.01 * (3 - int(target)))  # finish in reverse order
        ran.append(target)
        return f"probed {target}"

    class Stall(ScriptedExecutor):
        """Answers the first request from the script; the second waits until cancelled."""

        async def acomplete(self, request: Any) -> Any:
            if ran:
                three.set()
                await asyncio.Event().wait()
            return await super().acomplete(request)

    from treadle.testing.scripted import tool_calls

    calls = tool_calls([("probe", {"target": str(i)}) for i in range(3)])
    task = asyncio.ensure_future(
        arun_session_loop(
            Session.from_user_message("probe all"),
            AGENT,
            executor=Stall([calls, "unused"]),
            tools=[probe],
            store=store,
            conversation="k",
        )
    )
    await asyncio.wait_for(three.wait(), 30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await store.asettled()
    (pending,) = await store.apending("k")
    out = await arun_session_loop(
        Session(),
        AGENT,
        executor=ScriptedExecutor(["all probed"]),
        tools=[probe],
        store=store,
        conversation=pending,
    )
    assert out.rows[-1].payload["content"] == "all probed"
    assert sorted(ran) == ["0", "1", "2"]  # none ran again
    rows = (await store.conversation("k")).rows
    results = [r.payload["tool_call_id"] for r in rows if r.kind == "tool_result"]
    assert len(results) == 3 and len(set(results)) == 3, results


class Deploys:
    """A `deploy` tool needing approval that counts its runs."""

    def __init__(self) -> None:
        self.runs = 0

        @tool(needs_approval=True)
        async def deploy(target: str) -> str:
            """Deploy `target`."""
            self.runs += 1
            await asyncio.sleep(0.001)
            return f"deployed {target}"

        self.tool = deploy


async def _resume_all(store: Store, deploys: Deploys, rounds: int = 4) -> None:
    """Resume whatever `k` has pending, approving what each item lists, until nothing is."""
    for _ in range(rounds):
        found = await store.apending("k")
        if not found:
            return
        item = found[0]
        await arun_session_loop(
            Session(),
            AGENT,
            executor=ScriptedExecutor(["Deployed."]),
            tools=[deploys.tool],
            store=store,
            conversation=item,
            approvals={a["id"]: True for a in item.pending_approvals},
        )
    assert await store.apending("k") == []


async def test_a_resume_that_decides_nothing_leaves_one_pending_pass(store: Store) -> None:
    deploys = Deploys()
    first = await _waiting(store, deploys.tool)
    out = await arun_session_loop(
        Session(), AGENT, executor=ScriptedExecutor([]), tools=[deploys.tool], store=store,
        conversation=first,
    )  # fmt: skip
    assert out.stop_reason == "interrupted"
    (again,) = await store.apending("k")  # one pass waits, not the old one beside it
    assert again.pending_approvals == first.pending_approvals
    await _resume_all(store, deploys)
    assert deploys.runs == 1


@pytest.mark.parametrize("when", ["before", "after"])
async def test_a_resume_cut_off_at_its_intent_never_runs_the_call_twice(
    store: Store, when: str
) -> None:
    """The resume is cancelled as its intent write starts, or once it has landed (the tool may
    or may not have started): whatever is listed next says what still waits, and resuming it
    (approving what it lists) never runs the call a second time."""
    deploys = Deploys()
    first = await _waiting(store, deploys.tool)
    victim: dict[str, asyncio.Future[Any]] = {}
    real = store.backend.record

    async def record(*args: Any, **kw: Any) -> None:
        target = victim.pop("task", None) if any(e[0] == "intent" for e in args[4]) else None
        if target is not None and when == "before":
            target.cancel()
        await real(*args, **kw)
        if target is not None and when == "after":
            target.cancel()

    store.backend.record = record  # type: ignore[method-assign]
    task = asyncio.ensure_future(
        arun_session_loop(
            Session(), AGENT, executor=ScriptedExecutor(["Deployed."]), tools=[deploys.tool],
            store=store, conversation=first,
            approvals={first.pending_approvals[0]["id"]: True},
        )
    )  # fmt: skip
    victim["task"] = task
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await store.asettled()
    listed = await store.apending("k")
    assert len(listed) <= 1, listed
    await _resume_all(store, deploys)
    assert deploys.runs <= 1
    rows = (await store.conversation("k")).rows
    results = [r.payload["tool_call_id"] for r in rows if r.kind == "tool_result"]
    assert len(results) == 1, [r.kind for r in rows]


async def test_a_takeover_given_back_late_is_never_set_back_under_another_resume(
    store: Store,
) -> None:
    """A resume cancelled while its takeover is in flight gives the pass back once the
    takeover lands (slowed here): until then no other resume in the process takes it, so
    the give-back never lands under a resume that runs it."""
    deploys = Deploys()
    first = await _waiting(store, deploys.tool)
    approve = {first.pending_approvals[0]["id"]: True}
    real_settle = store.backend.settle

    async def slow_settle(*args: Any, **kw: Any) -> None:
        await asyncio.sleep(0.05)
        await real_settle(*args, **kw)

    store.backend.settle = slow_settle  # type: ignore[method-assign]
    await _resume_cancelled_at_claim(store, first, deploys.tool)
    refused = 0
    for _ in range(100):  # at once, and until the give-back has landed
        try:
            await arun_session_loop(
                Session(), AGENT, executor=ScriptedExecutor(["Deployed."]),
                tools=[deploys.tool], store=store, conversation=first, approvals=approve,
            )  # fmt: skip
            break
        except ConflictError as err:
            assert "being resumed in this process" in str(err), err
            refused += 1
            await asyncio.sleep(0.01)
    assert refused >= 1  # the first try met the give-back still in flight
    await store.asettled()
    assert await store.apending("k") == []
    assert deploys.runs == 1


def test_a_resume_whose_loop_closed_mid_takeover_leaves_the_pass_resumable(url: str) -> None:
    """A resume on a loop that is closed (without cancelling its tasks) while its takeover is
    in flight: the process does not keep the pass as its own; a resume on another loop runs
    it."""
    store = Store.open(url)
    try:
        deploys = Deploys()
        first = None

        async def waiting() -> Any:
            await arun_session_loop(
                Session.from_user_message("deploy x"), AGENT,
                executor=ScriptedExecutor([tool_call("deploy", {"target": "x"})]),
                tools=[deploys.tool], store=store, conversation="k",
            )  # fmt: skip
            (found,) = await store.apending("k")
            return found

        first = asyncio.run(waiting())
        approve = {first.pending_approvals[0]["id"]: True}
        real = store.backend.claim
        started = threading.Event()

        async def claim(pass_id: str, key: str) -> Any:
            started.set()
            return await real(pass_id, key)

        store.backend.claim = claim  # type: ignore[method-assign]
        loop = asyncio.new_event_loop()
        resume = loop.create_task(
            arun_session_loop(
                Session(), AGENT, executor=ScriptedExecutor(["never"]), tools=[deploys.tool],
                store=store, conversation=first, approvals=approve,
            )
        )  # fmt: skip
        while not started.is_set():
            loop.run_until_complete(asyncio.sleep(0))
        KEEP.extend(asyncio.all_tasks(loop))  # see KEEP
        loop.close()  # its resume never runs again
        del resume
        store.backend.claim = real  # type: ignore[method-assign]

        async def resume() -> str:
            for _ in range(200):
                listed = await store.apending("k")
                if listed and listed[0].resumable:
                    break
                await asyncio.sleep(0.01)
            out = await arun_session_loop(
                Session(), AGENT, executor=ScriptedExecutor(["Deployed."]),
                tools=[deploys.tool], store=store, conversation=listed[0], approvals=approve,
            )  # fmt: skip
            return str(out.rows[-1].payload["content"])

        assert asyncio.run(resume()) == "Deployed."
        assert deploys.runs == 1
    finally:
        store.close(grace=5)


async def test_an_append_to_a_conversation_waiting_for_a_decision_is_refused(
    store: Store,
) -> None:
    deploys = Deploys()
    first = await _waiting(store, deploys.tool)
    with pytest.raises(ConflictError, match="waits for a decision on deploy"):
        await store.aappend("k", [ChunkRow.user("more")])
    assert [p.pass_id for p in await store.apending("k")] == [first.pass_id]
    await _resume_all(store, deploys)
    assert deploys.runs == 1


async def test_a_resume_with_a_new_message_and_calls_undecided_is_refused(store: Store) -> None:
    deploys = Deploys()
    first = await _waiting(store, deploys.tool)
    with pytest.raises(ConfigurationError, match="waits for decisions"):
        await arun_session_loop(
            Session.from_user_message("never mind"), AGENT, executor=ScriptedExecutor(["x"]),
            tools=[deploys.tool], store=store, conversation=first,
        )  # fmt: skip
    await store.asettled()
    (again,) = await store.apending("k")  # given back, still waiting
    assert again.pending_approvals == first.pending_approvals and again.resumable
    await _resume_all(store, deploys)
    assert deploys.runs == 1


async def test_a_started_call_is_not_reported_denied(store: Store) -> None:
    """A call recorded as started whose resume is then denied: it may have run, so the model is
    told its outcome is unknown, not that the user refused it."""
    deploys = Deploys()
    first = await _waiting(store, deploys.tool)
    call_id = first.pending_approvals[0]["id"]
    real = store.backend.record
    victim: dict[str, asyncio.Future[Any]] = {}

    async def record(*args: Any, **kw: Any) -> None:
        await real(*args, **kw)
        if any(e[0] == "intent" for e in args[4]) and (target := victim.pop("task", None)):
            target.cancel()  # once the intent is durable

    store.backend.record = record  # type: ignore[method-assign]
    task = asyncio.ensure_future(
        arun_session_loop(
            Session(), AGENT, executor=ScriptedExecutor(["Deployed."]), tools=[deploys.tool],
            store=store, conversation=first, approvals={call_id: True},
        )
    )  # fmt: skip
    victim["task"] = task
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await store.asettled()
    (listed,) = await store.apending("k")
    await arun_session_loop(
        Session(), AGENT, executor=ScriptedExecutor(["ok"]), tools=[deploys.tool],
        store=store, conversation=listed, approvals={call_id: False},
    )  # fmt: skip
    rows = (await store.conversation("k")).rows
    (result,) = [r for r in rows if r.kind == "tool_result"]
    assert "may or may not have run" in str(result.payload["content"])
    assert deploys.runs <= 1


async def test_settled_waits_for_the_takeover_of_a_cancelled_resume(store: Store) -> None:
    """The takeover of a resume cancelled while it is in flight (slowed here) lands after the
    resume is gone: `asettled()` waits for it and its give-back, so what `pending()` lists
    next is what a resume can take."""
    deploys = Deploys()
    first = await _waiting(store, deploys.tool)
    real = store.backend.claim

    async def slow_claim(pass_id: str, key: str) -> Any:
        await asyncio.sleep(0.08)
        return await real(pass_id, key)

    store.backend.claim = slow_claim  # type: ignore[method-assign]
    task = asyncio.ensure_future(
        arun_session_loop(
            Session(), AGENT, executor=ScriptedExecutor(["never"]), tools=[deploys.tool],
            store=store, conversation=first,
            approvals={first.pending_approvals[0]["id"]: True},
        )
    )  # fmt: skip
    await asyncio.sleep(0.01)  # in the takeover
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await store.asettled()
    (again,) = await store.apending("k")
    assert again.resumable
    await _resume_all(store, deploys)
    assert deploys.runs == 1


@pytest.mark.parametrize("value", [0, [], {"approve": False}, None])
def test_approvals_take_only_true_false_or_a_reason(value: Any) -> None:
    from treadle import run_session_loop

    with pytest.raises(ConfigurationError, match="approvals must map"):
        out = run_session_loop(
            Session.from_user_message("hi"), AGENT, executor=ScriptedExecutor(["x"]),
            approvals={"call_1": value},
        )  # fmt: skip
        assert out.rows  # validated at the call: never reached


async def test_decisions_made_on_a_resume_that_stops_again_are_kept(store: Store) -> None:
    """Two calls wait; a resume decides one and stops for the other: the next resume, given
    only the one `pending()` lists, runs both (the first decision was kept)."""
    ran: list[str] = []

    @tool(needs_approval=True)
    def deploy(target: str) -> str:
        """Deploy `target`."""
        ran.append(target)
        return f"deployed {target}"

    from treadle.testing.scripted import tool_calls

    await arun_session_loop(
        Session.from_user_message("deploy a and b"), AGENT,
        executor=ScriptedExecutor([tool_calls([("deploy", {"target": "a"}),
                                               ("deploy", {"target": "b"})])]),
        tools=[deploy], store=store, conversation="k",
    )  # fmt: skip
    (first,) = await store.apending("k")
    a, b = (c["id"] for c in first.pending_approvals)
    out = await arun_session_loop(
        Session(), AGENT, executor=ScriptedExecutor([]), tools=[deploy], store=store,
        conversation=first, approvals={a: True},
    )  # fmt: skip
    assert out.stop_reason == "interrupted"
    (second,) = await store.apending("k")
    assert [c["id"] for c in second.pending_approvals] == [b]
    out = await arun_session_loop(
        Session(), AGENT, executor=ScriptedExecutor(["both deployed"]), tools=[deploy],
        store=store, conversation=second, approvals={b: True},
    )  # fmt: skip
    assert out.rows[-1].payload["content"] == "both deployed"
    assert sorted(ran) == ["a", "b"]
    assert await store.apending("k") == []
