"""What a stored conversation's next pass is handed, when it is not what the store wrote:

- a `PendingPass` whose key was changed (`dataclasses.replace`) is refused: it never takes a
  pass of one conversation over into another;
- one damaged pass record leaves `pending()` working for every other conversation (and is an
  error naming its own conversation there);
- rows that end in tool calls without results (a session imported or appended so, a fork cut
  inside a round, a pass interrupted mid-round) followed by a new message: the calls are
  answered "no result" first, so the transcript sent to the model is one it accepts;
- queue mode: a pass waiting for its turn when the store is closed fails with `StoreError`
  instead of waiting for the holder.

Both backends: a SQLite file and a database of the throwaway PostgreSQL cluster.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import sqlite3
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from treadle import Session, arun_session_loop, run_session_loop, tool
from treadle.errors import ConfigurationError, StoreError
from treadle.llm.request import CompletionRequest
from treadle.session import ChunkRow
from treadle.stores import Store
from treadle.testing import ScriptedExecutor
from treadle.testing.scripted import tool_call

AGENT = Session.from_agent_prompt("Deploy when asked.")
#: Generous: the suite must pass on a loaded 2-core machine.
WAIT = 120


@tool(needs_approval=True)
def deploy(target: str) -> str:
    """Deploy `target`."""
    return f"deployed {target}"


@tool
def look(target: str) -> str:
    """Look `target` up."""
    return f"found {target}"


@pytest.fixture
def store(url: str) -> Iterator[Store]:
    opened = Store.open(url)
    yield opened
    opened.close()


async def _waiting(store: Store, key: str) -> Any:
    """Conversation `key` after a pass that stopped for an approval: its pending pass."""
    await arun_session_loop(
        Session.from_user_message("deploy x"), AGENT,
        executor=ScriptedExecutor([tool_call("deploy", {"target": "x"})]), tools=[deploy],
        store=store, conversation=key,
    )  # fmt: skip
    (pending,) = await store.apending(key)
    return pending


def _set_pass_record(url: str, pass_id: str, status: str, metadata: str) -> None:
    """Overwrite the stored status and metadata of pass `pass_id`."""
    if url.startswith("sqlite:///"):
        with sqlite3.connect(url.removeprefix("sqlite:///")) as conn:
            conn.execute(
                "UPDATE passes SET status = ?, metadata = ? WHERE pass_id = ?",
                (status, metadata, pass_id),
            )
        return
    import psycopg

    with psycopg.connect(url, autocommit=True) as pg:
        pg.execute(
            "UPDATE treadle_passes SET status = %s, metadata = %s WHERE pass_id = %s",
            (status, metadata, pass_id),
        )


def _damage_pass_record(url: str, pass_id: str) -> None:
    """Overwrite the stored metadata of pass `pass_id` with text that is not JSON."""
    _set_pass_record(url, pass_id, "interrupted", "{not json")


async def test_a_pending_pass_given_another_key_is_refused(store: Store) -> None:
    first = await _waiting(store, "k")
    forged = dataclasses.replace(first, key="other")
    with pytest.raises(ConfigurationError, match="belongs to conversation 'k'"):
        await arun_session_loop(
            Session(), AGENT, executor=ScriptedExecutor(["Deployed."]), tools=[deploy],
            store=store, conversation=forged, approvals={first.pending_approvals[0]["id"]: True},
        )  # fmt: skip
    await store.asettled()
    assert (await store.conversation("other")).rows == ()
    (still,) = await store.apending("k")
    assert still.pass_id == first.pass_id and still.resumable


async def test_one_damaged_pass_record_leaves_the_others_listed(url: str, store: Store) -> None:
    damaged = await _waiting(store, "a")
    sound = await _waiting(store, "b")
    _damage_pass_record(url, damaged.pass_id)
    assert [p.pass_id for p in await store.apending()] == [sound.pass_id]
    assert [p.pass_id for p in await store.apending("b")] == [sound.pass_id]
    with pytest.raises(StoreError, match="'a'"):
        await store.apending("a")


def _answers(requests: list[list[dict[str, Any]]]) -> Any:
    def answer(request: CompletionRequest) -> str:
        requests.append(request.messages())
        return "Noted."

    return answer


def _assert_every_call_answered_before_the_next_message(messages: list[dict[str, Any]]) -> None:
    waiting: set[str] = set()
    for m in messages:
        if m["role"] == "tool":
            waiting.discard(m["tool_call_id"])
            continue
        assert not waiting, f"{m['role']} message after unanswered calls {waiting}"
        if m["role"] == "assistant":
            waiting = {c["id"] for c in m.get("tool_calls") or ()}
    assert not waiting


async def test_a_new_message_after_unanswered_calls_answers_them_first(store: Store) -> None:
    call = ChunkRow.from_message(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": f"c{i}",
                    "type": "function",
                    "function": {"name": "deploy", "arguments": "{}"},
                }
                for i in (1, 2)
            ],
        }
    )
    # An imported session that stopped mid-round: the first call answered, the second not.
    answered = ChunkRow.from_message({"role": "tool", "tool_call_id": "c1", "content": "deployed"})
    await store.aappend("k", [ChunkRow.user("deploy twice"), call, answered])
    requests: list[list[dict[str, Any]]] = []
    out = await arun_session_loop(
        Session.from_user_message("what happened?"), AGENT,
        executor=ScriptedExecutor([_answers(requests)]), tools=[deploy],
        store=store, conversation="k",
    )  # fmt: skip
    (sent,) = requests
    _assert_every_call_answered_before_the_next_message(sent)
    (filled,) = [m for m in sent if m["role"] == "tool" and m["tool_call_id"] == "c2"]
    assert "no result" in filled["content"]
    assert [r.kind for r in out.rows][-3:] == ["tool_result", "user", "assistant"]
    rows = (await store.conversation("k")).rows
    assert [r.kind for r in rows] == [
        "user", "assistant", "tool_result", "tool_result", "user", "assistant",
    ]  # fmt: skip


async def test_a_fork_cut_inside_a_round_then_a_new_message(store: Store) -> None:
    await arun_session_loop(
        Session.from_user_message("deploy x"), AGENT,
        executor=ScriptedExecutor([tool_call("look", {"target": "x"}), "Done."]),
        tools=[look], store=store, conversation="k",
    )  # fmt: skip
    await store.afork("k", "f", version=2)  # the user message and the call, not its result
    requests: list[list[dict[str, Any]]] = []
    await arun_session_loop(
        Session.from_user_message("again?"), AGENT, executor=ScriptedExecutor([_answers(requests)]),
        tools=[look], store=store, conversation="f",
    )  # fmt: skip
    (sent,) = requests
    _assert_every_call_answered_before_the_next_message(sent)


def test_closing_the_store_fails_a_pass_waiting_for_its_turn(url: str) -> None:
    store = Store.open(url, on_conflict="queue")
    started, release = threading.Event(), threading.Event()

    @tool
    def slow() -> str:
        """Wait for the test."""
        started.set()
        release.wait(WAIT)
        return "done"

    try:
        first = run_session_loop(
            Session.from_user_message("first"), AGENT,
            executor=ScriptedExecutor([tool_call("slow", {}), "first answer"]), tools=[slow],
            store=store, conversation="q",
        )  # fmt: skip
        assert started.wait(WAIT)
        second = run_session_loop(
            Session.from_user_message("second"), AGENT, executor=ScriptedExecutor(["second"]),
            store=store, conversation="q",
        )  # fmt: skip
        waited = threading.Event()

        def read_second() -> None:
            with pytest.raises(StoreError, match="closed"):
                second.synchronize(WAIT)
            waited.set()

        reader = threading.Thread(target=read_second)
        reader.start()
        store.close(grace=5)
        assert waited.wait(WAIT), "the waiting pass still waits for the holder"
        assert not release.is_set()  # the holder still holds: the close, not it, ended the wait
        reader.join(WAIT)
    finally:
        release.set()
        with pytest.raises(StoreError):
            first.synchronize(WAIT)
        store.close()


@pytest.mark.parametrize("through", ["key", "pending"])
async def test_a_pass_interrupted_mid_round_then_a_new_message(store: Store, through: str) -> None:
    await _interrupted_at_its_calls(store)
    (interrupted,) = await store.apending("k")
    requests: list[list[dict[str, Any]]] = []
    await arun_session_loop(
        Session.from_user_message("never mind, what is 2+2?"), AGENT,
        executor=ScriptedExecutor([_answers(requests)]), tools=[look], store=store,
        conversation="k" if through == "key" else interrupted,
    )  # fmt: skip
    (sent,) = requests
    _assert_every_call_answered_before_the_next_message(sent)
    assert await store.apending("k") == []


@pytest.mark.parametrize("key", ["k\x00", "k" * 600])
async def test_a_pending_pass_with_an_unusable_key_is_refused(store: Store, key: str) -> None:
    first = await _waiting(store, "k")
    with pytest.raises(ConfigurationError, match="conversation key"):
        await arun_session_loop(
            Session(), AGENT, executor=ScriptedExecutor(["x"]), tools=[deploy], store=store,
            conversation=dataclasses.replace(first, key=key),
        )  # fmt: skip
    assert [p.pass_id for p in await store.apending("k")] == [first.pass_id]


async def test_a_running_record_with_an_impossible_pid_is_resumable(url: str, store: Store) -> None:
    """An owner pid past the C int's range (`os.kill` raises OverflowError): no process has it,
    so the pass is resumable, and `pending()` still lists every conversation."""
    bad = await _waiting(store, "a")
    good = await _waiting(store, "b")
    owner = json.dumps({"owner": {"pid": 2**70, "host": socket.gethostname(), "start": "x"}})
    _set_pass_record(url, bad.pass_id, "running", owner)
    listed = {p.key: p for p in await store.apending()}
    assert set(listed) == {"a", "b"} and listed["a"].resumable
    assert listed["b"].pass_id == good.pass_id


@pytest.mark.parametrize("stored", [False, True])
async def test_input_with_a_gap_of_its_own_is_answered_first(store: Store, stored: bool) -> None:
    """The no-store flow (a pass interrupted at its calls, then `add_user_message`) with a
    store added: the input itself holds calls without results before a message."""
    if stored:
        await store.aappend("k", [ChunkRow.user("hello"), _assistant("earlier")])
    call = ChunkRow.from_message(
        {"role": "assistant", "content": None, "tool_calls": [_call("q", "look")]}
    )
    given = Session.from_messages([{"role": "user", "content": "look q up"}]).append(
        call, ChunkRow.user("never mind")
    )
    requests: list[list[dict[str, Any]]] = []
    await arun_session_loop(
        given, AGENT, executor=ScriptedExecutor([_answers(requests)]), tools=[look],
        store=store, conversation="k",
    )  # fmt: skip
    (sent,) = requests
    _assert_every_call_answered_before_the_next_message(sent)
    kinds = [r.kind for r in (await store.conversation("k")).rows]
    assert kinds[-5:] == ["user", "assistant", "tool_result", "user", "assistant"]


def _call(call_id: str, name: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": "{}"}}


def _assistant(text: str) -> ChunkRow:
    return ChunkRow.from_message({"role": "assistant", "content": text})


async def test_an_append_after_calls_without_results_answers_them_first(store: Store) -> None:
    await _interrupted_at_its_calls(store)
    assert await store.aappend("k", [ChunkRow.user("never mind")]) == 4
    kinds = [r.kind for r in (await store.conversation("k")).rows]
    assert kinds == ["user", "assistant", "tool_result", "user"]
    requests: list[list[dict[str, Any]]] = []
    await arun_session_loop(
        Session.from_user_message("2+2?"), AGENT, executor=ScriptedExecutor([_answers(requests)]),
        tools=[look], store=store, conversation="k",
    )  # fmt: skip
    _assert_every_call_answered_before_the_next_message(requests[0])


async def test_a_transcript_with_a_gap_is_imported_answered(store: Store, tmp_path: Any) -> None:
    """A session file written before passes answered such calls: user, calls, user, answer."""
    lines = [
        {"type": "header", "schema": 1, "session_id": "old", "parent_ids": [],
         "operator": "run_session_loop", "created_at": 1.0, "placement": None, "agent_rows": []},
        {"type": "row", "kind": "user", "payload": {"content": "look q up"}},
        {"type": "row", "kind": "assistant", "payload": {"content": None,
                                                         "tool_calls": [_call("q", "look")]}},
        {"type": "row", "kind": "user", "payload": {"content": "never mind"}},
        {"type": "row", "kind": "assistant", "payload": {"content": "ok"}},
        {"type": "trailer", "rows": 4, "usage": {}, "stop_reason": "final_answer",
         "metadata": {}},
    ]  # fmt: skip
    path = tmp_path / "old.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert await store.aimport_jsonl(path, key="old") == ("old", 5)
    rows = (await store.conversation("old")).rows
    assert [r.kind for r in rows] == ["user", "assistant", "tool_result", "user", "assistant"]


async def _interrupted_at_its_calls(store: Store) -> None:
    """Conversation `k` after a pass interrupted (`on_message`) once the model asked for a call:
    user, then the assistant's call without a result."""

    def stop_at_calls(row: ChunkRow, control: Any) -> None:
        if row.kind == "assistant" and row.calls:
            control.interrupt("the user interrupted")

    await arun_session_loop(
        Session.from_user_message("look x up"), AGENT,
        executor=ScriptedExecutor([tool_call("look", {"target": "x"})]), tools=[look],
        store=store, conversation="k", on_message=stop_at_calls,
    )  # fmt: skip
