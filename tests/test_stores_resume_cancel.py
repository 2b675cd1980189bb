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
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from treadle import Session, arun_session_loop, tool
from treadle.stores import Store
from treadle.testing import ScriptedExecutor
from treadle.testing.scripted import tool_call

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


async def _waiting_for_approval(store: Store) -> Any:
    await arun_session_loop(
        Session.from_user_message("deploy x"),
        AGENT,
        executor=ScriptedExecutor([tool_call("deploy", {"target": "x"})]),
        tools=[deploy],
        store=store,
        conversation="k",
    )
    (pending,) = await store.apending("k")
    return pending


async def test_a_resume_cancelled_at_its_takeover_leaves_the_pass_resumable(store: Store) -> None:
    pending = await _waiting_for_approval(store)
    call_id = pending.pending_approvals[0]["id"]
    victim = _cancel_at(store, "claim")
    task = asyncio.ensure_future(
        arun_session_loop(
            Session(),
            AGENT,
            executor=ScriptedExecutor(["never"]),
            tools=[deploy],
            store=store,
            conversation=pending,
            approvals={call_id: True},
        )
    )
    victim["task"] = task
    with pytest.raises(asyncio.CancelledError):
        await task
    await store.asettled()
    await asyncio.sleep(0.05)  # let the takeover land wherever it runs
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
    pending = await _waiting_for_approval(store)
    victim = _cancel_at(store, "claim")
    task = asyncio.ensure_future(
        arun_session_loop(
            Session(),
            AGENT,
            executor=ScriptedExecutor(["never"]),
            tools=[deploy],
            store=store,
            conversation=pending,
            approvals={pending.pending_approvals[0]["id"]: True},
        )
    )
    victim["task"] = task
    with pytest.raises(asyncio.CancelledError):
        await task
    await store.asettled()
    await asyncio.sleep(0.05)
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
