"""The conversation store conformance suite, run on both backends (SQLite and PostgreSQL).

Real parts: a SQLite file, a throwaway PostgreSQL cluster (tests/pg_cluster.py), the fake
OpenAI server over HTTP, and real child processes (tests/store_worker.py) for everything that
must hold across processes: concurrent appenders, SIGKILL mid-write, resume elsewhere.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from treadle import Provider, Session, arun_session_loop, run_session_loop, stream_session_loop
from treadle import tool as make_tool
from treadle.errors import ConfigurationError, ConflictError
from treadle.session import ChunkRow
from treadle.stores import Store
from treadle.testing import FakeOpenAIServer, ScriptedExecutor
from treadle.testing.fake_replies import Reply
from treadle.testing.scripted import tool_call

WORKER = str(Path(__file__).with_name("store_worker.py"))
AGENT = Session.from_agent_prompt("Answer briefly.")
#: Generous: the suite must pass on a loaded 2-core machine.
CHILD_TIMEOUT = 240


@pytest.fixture
def store(url: str) -> Iterator[Store]:
    opened = Store.open(url)
    yield opened
    opened.close()


@pytest.fixture(scope="module")
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer(script="echo") as srv:
        yield srv


def _provider(server: FakeOpenAIServer) -> Provider:
    return Provider(model="fake-model", base_url=server.base_url, api_key="k")


def _child(*args: str, **kw: Any) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.Popen(
        [sys.executable, WORKER, *args], stdout=subprocess.PIPE, text=True, env=env, **kw
    )


def _texts(session: Session) -> list[tuple[str, str]]:
    return [(r.kind, str(r.content)) for r in session.rows]


# -- reading and committing ------------------------------------------------------------------


def test_a_new_key_is_an_empty_conversation_read_lazily(store: Store) -> None:
    convo = store.conversation("nobody-yet")
    assert isinstance(convo, Session)
    assert convo.rows == ()
    assert convo.metadata["version"] == 0


def test_each_pass_continues_the_conversation_and_commits_its_rows(
    store: Store, server: FakeOpenAIServer
) -> None:
    provider = _provider(server)
    first = run_session_loop(
        Session.from_user_message("one"), AGENT, provider=provider, store=store, conversation="c"
    )
    assert first.metadata["version"] == 2
    second = run_session_loop(
        Session.from_user_message("two"), AGENT, provider=provider, store=store, conversation="c"
    )
    assert second.metadata["version"] == 4
    sent = [m["content"] for m in server.requests[-1].body["messages"]]
    assert sent == ["Answer briefly.", "one", "one", "two"]  # the model saw the whole conversation
    assert _texts(store.conversation("c")) == [
        ("user", "one"), ("assistant", "one"), ("user", "two"), ("assistant", "two"),
    ]  # fmt: skip
    assert store.conversation("c").usage.requests == 2
    # A session read from the store and extended continues it without repeating rows.
    third = run_session_loop(
        store.conversation("c").add_user_message("three"),
        AGENT,
        provider=provider,
        store=store,
        conversation="c",
    )
    assert third.metadata["version"] == 6
    assert [t for _, t in _texts(store.conversation("c"))][-2:] == ["three", "three"]


async def test_async_entry_points_and_agent_calls_take_a_store(
    store: Store, server: FakeOpenAIServer
) -> None:
    from treadle import Agent

    provider = _provider(server)
    out = await arun_session_loop(
        Session.from_user_message("a"), AGENT, provider=provider, store=store, conversation="x"
    )
    assert out.metadata["version"] == 2
    events = [
        e
        async for e in stream_session_loop(
            Session.from_user_message("b"), AGENT, provider=provider, store=store, conversation="x"
        )
    ]
    assert events[-1].session.metadata["version"] == 4
    agent = Agent("helper", "Answer briefly.", provider=provider)
    assert (
        await agent.run(Session.from_user_message("c"), store=store, conversation="x")
    ).metadata["version"] == 6
    assert (await agent(Session.from_user_message("d"), store=store, conversation="x")).metadata[
        "version"
    ] == 8
    assert [t for _, t in _texts(await store.conversation("x"))] == [
        "a", "a", "b", "b", "c", "c", "d", "d",
    ]  # fmt: skip


def test_a_turn_committed_by_another_process_is_what_the_next_turn_continues(
    url: str, store: Store, server: FakeOpenAIServer
) -> None:
    # The store keeps what it last read or committed in memory: a commit by another process
    # meanwhile must still be seen by the next read and turn here (never a stale start that
    # only the commit's version check would catch).
    provider = _provider(server)
    turn = {"provider": provider, "store": store, "conversation": "shared"}
    assert (
        run_session_loop(Session.from_user_message("here 1"), AGENT, **turn).metadata["version"]
        == 2
    )
    assert store.conversation("shared").metadata["version"] == 2
    child = _child("append", url, "shared", "7", server.base_url)
    child.communicate(timeout=CHILD_TIMEOUT)
    assert child.returncode == 0
    assert [t for _, t in _texts(store.conversation("shared"))] == [
        "here 1", "here 1", "msg 7", "msg 7",
    ]  # fmt: skip
    # and its usage: the head's, not the one this process last committed (which it keeps)
    assert store.conversation("shared").usage.requests == 2
    out = run_session_loop(Session.from_user_message("here 2"), AGENT, **turn)
    assert out.metadata["version"] == 6
    sent = [m["content"] for m in server.requests[-1].body["messages"]]
    assert sent == ["Answer briefly.", "here 1", "here 1", "msg 7", "msg 7", "here 2"]
    store.delete("shared")  # and a delete by this process is seen as well
    assert store.conversation("shared").metadata["version"] == 0


def test_store_and_conversation_go_together(store: Store) -> None:
    user = Session.from_user_message("hi")
    with pytest.raises(ConfigurationError, match="go together"):
        run_session_loop(user, AGENT, executor=ScriptedExecutor(["x"]), store=store)
    with pytest.raises(ConfigurationError, match="non-empty key"):
        run_session_loop(
            user, AGENT, executor=ScriptedExecutor(["x"]), store=store, conversation=""
        )
    with pytest.raises(ConfigurationError, match="Store"):
        run_session_loop(
            user,
            AGENT,
            executor=ScriptedExecutor(["x"]),
            store="sqlite:///x.db",  # type: ignore[arg-type]
            conversation="k",
        )


# -- concurrent writers ------------------------------------------------------------------------


def test_a_pass_that_lost_the_race_writes_nothing_and_says_so(store: Store) -> None:
    release, started = threading.Event(), threading.Event()

    @make_tool
    def slow() -> str:
        """Say the loser has read, then wait for the test."""
        started.set()
        release.wait(CHILD_TIMEOUT)
        return "done"

    loser = run_session_loop(
        Session.from_user_message("first"),
        AGENT,
        executor=ScriptedExecutor([tool_call("slow", {}), "loser's answer"]),
        tools=[slow],
        store=store,
        conversation="race",
    )
    # Reads go out in up to two batches on separate connections: the loser has read (and is
    # in its tool) only once `slow` started, so the winner starts after it.
    assert started.wait(CHILD_TIMEOUT)
    winner = run_session_loop(
        Session.from_user_message("second"),
        AGENT,
        executor=ScriptedExecutor(["winner's answer"]),
        store=store,
        conversation="race",
    )
    assert winner.metadata["version"] == 2
    release.set()
    with pytest.raises(ConflictError) as caught:
        loser.synchronize()
    assert (caught.value.key, caught.value.expected, caught.value.actual) == ("race", 0, 2)
    assert [r.kind for r in caught.value.rows] == ["user", "assistant", "tool_result", "assistant"]
    assert _texts(store.conversation("race")) == [
        ("user", "second"), ("assistant", "winner's answer"),
    ]  # fmt: skip
    assert store.pending("race") == []


def test_a_session_read_from_an_older_version_is_a_conflict(store: Store) -> None:
    store.append("old", [ChunkRow.user("a"), ChunkRow("assistant", {"content": "b"})])
    stale = store.conversation("old").synchronize()
    store.append("old", [ChunkRow.user("c"), ChunkRow("assistant", {"content": "d"})])
    with pytest.raises(ConflictError, match="version 4, not 2"):
        run_session_loop(
            stale.add_user_message("e"),
            AGENT,
            executor=ScriptedExecutor(["never"]),
            store=store,
            conversation="old",
        ).synchronize()
    assert store.conversation("old").metadata["version"] == 4
    with pytest.raises(ConflictError):
        store.append("old", [ChunkRow.user("f")], expected_version=2)


@pytest.mark.timeout(900)
def test_fifty_appender_processes_lose_nothing_and_agree_on_the_order(
    url: str, server: FakeOpenAIServer
) -> None:
    # One launcher imports Treadle once and forks the 50 appenders before any thread starts:
    # 50 real processes without 50 interpreter start-ups on a 2-core machine.
    launcher = _child("fanout", url, "shared", server.base_url, "50")
    launcher.communicate(timeout=CHILD_TIMEOUT * 2)
    assert launcher.returncode == 0
    with Store.open(url) as store:
        rows = store.conversation("shared").rows
        again = store.conversation("shared").rows
    assert rows == again
    assert len(rows) == 100
    pairs = [(rows[i], rows[i + 1]) for i in range(0, 100, 2)]
    for user, answer in pairs:  # each turn is whole: its question, then its own answer
        assert (user.kind, answer.kind) == ("user", "assistant")
        assert answer.content == user.content
    assert sorted(u.content for u, _ in pairs) == sorted(f"msg {i}" for i in range(50))
    reader = subprocess.run(
        [sys.executable, "-c", _READ_ORDER, url],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert json.loads(reader.stdout) == [str(r.content) for r in rows]


_READ_ORDER = """
import json, sys
from treadle.stores import Store
with Store.open(sys.argv[1]) as store:
    print(json.dumps([str(r.content) for r in store.conversation("shared").rows]))
"""


# -- crashes -----------------------------------------------------------------------------------


def test_sigkill_mid_append_leaves_the_last_committed_version_readable(url: str) -> None:
    child = _child("spin", url, "spun")
    assert child.stdout is not None
    seen = [int(child.stdout.readline()) for _ in range(5)]  # five commits, then kill mid-way
    child.send_signal(signal.SIGKILL)
    child.communicate(timeout=CHILD_TIMEOUT)
    with Store.open(url) as store:
        convo = store.conversation("spun")
        version = convo.metadata["version"]
        assert version >= seen[-1]
        assert version % 20 == 0  # whole batches only: never a half-written commit
        assert [r.content for r in convo.rows[:20]] == [f"row {i} " + "x" * 2000 for i in range(20)]


def test_sigkill_mid_pass_leaves_a_pending_pass_another_process_resumes(
    url: str, server: FakeOpenAIServer
) -> None:
    server.enqueue(Reply.tool_call("wait_forever", {}))
    child = _child("hang", url, "crash", server.base_url)
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "tool started"
    child.send_signal(signal.SIGKILL)
    child.communicate(timeout=CHILD_TIMEOUT)
    with Store.open(url) as store:
        assert store.conversation("crash").rows == ()  # nothing committed by the dead pass
        (pending,) = store.pending("crash")
        assert pending.status == "running"

        @make_tool
        def wait_forever() -> str:
            """Must not run again: its outcome is unknown."""
            raise AssertionError("a call of unknown outcome ran again")

        server.enqueue(Reply.text("recovered"))
        out = run_session_loop(
            Session(),
            AGENT,
            provider=_provider(server),
            tools=[wait_forever],
            store=store,
            conversation=pending,
        )
        assert out.stop_reason == "final_answer"
        kinds = [r.kind for r in store.conversation("crash").rows]
        assert kinds == ["user", "assistant", "tool_result", "assistant"]
        result = json.loads(store.conversation("crash").rows[2].payload["content"])
        assert result["ok"] is False  # reported to the model as of unknown outcome
        assert store.pending("crash") == []


def _durable_tool_results(url: str) -> int:
    """Tool results in the store's journal (what a crash keeps of a pass that did not commit)."""
    if url.startswith("sqlite"):
        import sqlite3

        with sqlite3.connect(url.removeprefix("sqlite:///")) as conn:
            query = "SELECT count(*) FROM journal WHERE entry = 'row' AND kind = 'tool_result'"
            found: int = conn.execute(query).fetchone()[0]
            return found
    import psycopg

    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT count(*) FROM treadle_journal WHERE entry = 'row' AND kind = 'tool_result'"
        ).fetchone()
        return int(row[0]) if row else 0


def test_sigkill_after_a_tool_result_keeps_it_and_the_resume_does_not_run_it_again(
    url: str, server: FakeOpenAIServer
) -> None:
    server.enqueue(Reply.tool_calls_of([("quick", {}), ("wait_forever", {})]))
    child = _child("hang", url, "half", server.base_url)
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "tool started"
    deadline = time.monotonic() + CHILD_TIMEOUT
    while _durable_tool_results(url) < 1:  # the quick call's result, written as it finished
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    child.communicate(timeout=CHILD_TIMEOUT)

    @make_tool
    def quick() -> str:
        """Must not run again: its result is in the store."""
        raise AssertionError("a call with a durable result ran again")

    @make_tool
    def wait_forever() -> str:
        """Must not run again: its outcome is unknown."""
        raise AssertionError("a call of unknown outcome ran again")

    with Store.open(url) as store:
        assert store.conversation("half").rows == ()
        (pending,) = store.pending("half")
        server.enqueue(Reply.text("recovered"))
        run_session_loop(
            Session(),
            AGENT,
            provider=_provider(server),
            tools=[quick, wait_forever],
            store=store,
            conversation=pending,
        ).synchronize()
        rows = store.conversation("half").rows
        assert [r.kind for r in rows] == ["user", "assistant", "tool_result", "tool_result",
                                          "assistant"]  # fmt: skip
        assert "quick result" in rows[2].payload["content"]  # kept from before the crash
        assert json.loads(rows[3].payload["content"])["ok"] is False  # unknown outcome


def test_a_pending_approval_is_finished_by_another_process(
    store: Store, url: str, server: FakeOpenAIServer
) -> None:
    from store_worker import deploy

    server.enqueue(Reply.tool_call("deploy", {"target": "prod"}), Reply.text("deployed"))
    out = run_session_loop(
        Session.from_user_message("deploy it"),
        AGENT,
        provider=_provider(server),
        tools=[deploy],
        store=store,
        conversation="ops",
    )
    assert out.stop_reason == "interrupted"
    (pending,) = store.pending()
    assert (pending.key, pending.status) == ("ops", "interrupted")
    assert pending.pending_approvals[0]["name"] == "deploy"
    assert store.conversation("ops").pending_approvals == list(pending.pending_approvals)
    with pytest.raises(ConflictError, match="waits for a decision on deploy"):
        run_session_loop(  # a new turn cannot follow calls that have no results
            Session.from_user_message("and another thing"),
            AGENT,
            executor=ScriptedExecutor(["x"]),
            store=store,
            conversation="ops",
        ).synchronize()
    child = _child("resume", url, "ops", server.base_url)
    stdout, _ = child.communicate(timeout=CHILD_TIMEOUT)
    assert child.returncode == 0
    assert stdout.split() == ["final_answer", "4"]
    rows = store.conversation("ops").rows
    assert [r.kind for r in rows] == ["user", "assistant", "tool_result", "assistant"]
    assert "deployed to prod" in str(rows[2].payload["content"])
    assert store.pending() == []
    with pytest.raises(ConflictError, match="not pending"):  # a second resume finds it taken
        run_session_loop(
            Session(), AGENT, executor=ScriptedExecutor(["x"]), store=store, conversation=pending
        ).synchronize()


def test_each_commit_on_a_key_moves_what_a_read_gives_of_its_last_pass(store: Store) -> None:
    # One process, one key, read after every commit: each read gives the last pass's stop
    # reason and metadata (SQLite moves its cached head in place; a field left behind would
    # show the previous pass's).
    from store_worker import deploy

    def turn(text: str, *replies: Any, **kw: Any) -> Session:
        return run_session_loop(
            Session.from_user_message(text) if text else Session(),
            AGENT,
            executor=ScriptedExecutor(list(replies)),
            tools=[deploy],
            store=store,
            **kw,
        )

    assert turn("hello", "hi", conversation="m").stop_reason == "final_answer"
    first = store.conversation("m")
    assert (first.stop_reason, first.pending_approvals) == ("final_answer", [])
    assert "interrupt_reason" not in first.metadata
    call = tool_call("deploy", {"target": "prod"}, id="d1")
    assert turn("deploy", call, conversation="m").stop_reason == "interrupted"
    waiting = store.conversation("m")
    assert (waiting.stop_reason, waiting.metadata["version"]) == ("interrupted", 4)
    assert waiting.metadata["interrupt_reason"] == "approval required for deploy"
    assert [a["id"] for a in waiting.pending_approvals] == ["d1"]
    (pending,) = store.pending("m")
    resumed = turn("", "deployed", conversation=pending, approvals={"d1": True})
    assert resumed.stop_reason == "final_answer"
    done = store.conversation("m")
    assert (done.stop_reason, done.metadata["version"]) == ("final_answer", 6)
    assert done.pending_approvals == []
    assert "interrupt_reason" not in done.metadata
    # The approval is settled: the next turn follows it (no "waits for a decision on deploy").
    after = turn("and then?", "fine", conversation="m")
    assert [t for _, t in _texts(after)][-2:] == ["and then?", "fine"]
    assert store.conversation("m").stop_reason == "final_answer"


# -- lineage and retention -------------------------------------------------------------------


def test_fork_branches_a_conversation_and_keeps_its_parent(store: Store) -> None:
    store.append("trunk", [ChunkRow.user("a"), ChunkRow("assistant", {"content": "b"})])
    store.append("trunk", [ChunkRow.user("c")])
    branch = store.fork("trunk", "branch", version=2)
    assert [r.content for r in branch.rows] == ["a", "b"]
    assert branch.lineage.operator == "fork:trunk@2"
    store.append("branch", [ChunkRow.user("z")])
    assert [r.content for r in store.conversation("trunk").rows] == ["a", "b", "c"]
    assert [r.content for r in store.conversation("branch").rows] == ["a", "b", "z"]
    infos = {i.key: i for i in store.conversations()}
    assert infos["branch"].parent_key == "trunk"
    with pytest.raises(ConflictError, match="already exists"):
        store.fork("trunk", "branch")
    with pytest.raises(ConfigurationError, match="versions 0 to 3"):
        store.fork("trunk", "other", version=9)


def test_a_fork_starts_from_its_parents_whole_usage_as_documented(
    store: Store, server: FakeOpenAIServer
) -> None:
    # The store keeps one running usage total a conversation, none a pass or a row: a fork
    # cannot tell what the passes up to its fork point used, and starts from the parent's total
    # when it was made (docs/stores.md, StoredConversation.usage).
    for text in ("one", "two"):
        run_session_loop(
            Session.from_user_message(text),
            AGENT,
            provider=_provider(server),
            store=store,
            conversation="spent",
        ).synchronize()
    assert store.conversation("spent").usage.requests == 2
    branch = store.fork("spent", "spent-branch", version=2)  # the first pass's rows only
    assert [t for _, t in _texts(branch)] == ["one", "one"]  # the echo server's reply
    assert branch.usage == store.conversation("spent").usage  # both passes', not the first's
    run_session_loop(
        Session.from_user_message("three"),
        AGENT,
        provider=_provider(server),
        store=store,
        conversation="spent-branch",
    ).synchronize()
    assert store.conversation("spent-branch").usage.requests == 3  # its own passes add to it
    assert store.conversation("spent").usage.requests == 2  # and never to the parent's


def test_delete_and_prune(store: Store) -> None:
    store.append("a", [ChunkRow.user("x")])
    store.append("b", [ChunkRow.user("y")])
    assert store.delete("a") is True
    assert store.delete("a") is False
    assert store.conversation("a").rows == ()
    assert store.prune(older_than_days=1) == 0  # b changed just now
    assert store.prune(older_than_days=0) == 1
    assert store.conversations() == []
    with pytest.raises(ConfigurationError, match="negative"):
        store.prune(older_than_days=-1)


def test_a_failed_pass_stays_resumable_with_what_it_made_durable(
    store: Store,
) -> None:
    from store_worker import deploy
    from treadle.errors import ProviderError

    boom = ProviderError("the model endpoint failed", status_code=500)
    failed = run_session_loop(
        Session.from_user_message("hello?"),
        AGENT,
        executor=ScriptedExecutor([boom]),
        store=store,
        conversation="f",
    )
    with pytest.raises(ProviderError):
        failed.synchronize()
    (pending,) = store.pending("f")
    assert pending.status == "failed"  # its input is kept for a resume
    out = run_session_loop(
        Session(), AGENT, executor=ScriptedExecutor(["hi!"]), store=store, conversation=pending
    )
    assert [t for _, t in _texts(out)] == ["hello?", "hi!"]
    assert store.pending("f") == []
    # A resume of an approval that fails gives the approval back, still pending.
    model = ScriptedExecutor([tool_call("deploy", {"target": "prod"}, id="d1")])
    run_session_loop(
        Session.from_user_message("deploy"),
        AGENT,
        executor=model,
        tools=[deploy],
        store=store,
        conversation="g",
    ).synchronize()
    (waiting,) = store.pending("g")
    with pytest.raises(ProviderError):
        run_session_loop(
            Session(),
            AGENT,
            executor=ScriptedExecutor([boom]),
            tools=[deploy],
            store=store,
            conversation=waiting,
            approvals={"d1": True},
        ).synchronize()
    # The approved call ran and its result is durable: the failed resume is what is pending
    # now, and resuming it finishes without running the call again.
    (again,) = store.pending("g")
    assert (again.status, again.pass_id != waiting.pass_id) == ("failed", True)
    done = run_session_loop(
        Session(),
        AGENT,
        executor=ScriptedExecutor(["deployed"]),
        tools=[deploy],
        store=store,
        conversation=again,
    )
    assert [r.kind for r in done.rows] == ["user", "assistant", "tool_result", "assistant"]
    assert store.pending("g") == []
