"""Tool results the caller supplies in a pass's input (answers to an assistant row's calls, such
as a result computed after an approval) are checked where the pass starts, with a store or
without, before a request is made or anything is committed:

- a result that a user message (or any other row) separates from the assistant row whose call
  it answers is a `ConfigurationError` (the model's API refuses such a transcript);
- so is a second result for one call, and a result for no call of the assistant row before it;
- a result that follows its assistant row is accepted, also across the stored conversation and
  the input (the conversation ends with calls, the input starts with their results).

Both store backends: a SQLite file and a database of the throwaway PostgreSQL cluster.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from treadle import Session, arun_session_loop, tool
from treadle.errors import ConfigurationError
from treadle.llm.request import CompletionRequest
from treadle.session import ChunkRow
from treadle.stores import Store
from treadle.testing import ScriptedExecutor

AGENT = Session.from_agent_prompt("Look things up.")


@tool
def look(target: str) -> str:
    """Look `target` up."""
    return f"found {target}"


@pytest.fixture
def store(url: str) -> Iterator[Store]:
    opened = Store.open(url)
    yield opened
    opened.close()


def _calls(*ids: str) -> ChunkRow:
    return ChunkRow.from_message(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": i, "type": "function", "function": {"name": "look", "arguments": "{}"}}
                for i in ids
            ],
        }
    )


def _result(call_id: str, text: str = "found it") -> ChunkRow:
    return ChunkRow.from_message({"role": "tool", "tool_call_id": call_id, "content": text})


def _recording(requests: list[list[dict[str, Any]]]) -> ScriptedExecutor:
    def answer(request: CompletionRequest) -> str:
        requests.append(request.messages())
        return "Noted."

    return ScriptedExecutor([answer])


#: Inputs whose caller-supplied results the model's API would refuse, with the error's words.
BAD = {
    "after_a_later_message": (
        [ChunkRow.user("look x up"), _calls("c1"), ChunkRow.user("never mind"), _result("c1")],
        "does not follow",
    ),
    "twice": (
        [ChunkRow.user("look x up"), _calls("c1"), _result("c1"), _result("c1", "again")],
        "second result",
    ),
    "for_no_call": (
        [ChunkRow.user("look x up"), _calls("c1"), _result("c1"), _result("c9")],
        "no call",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
async def test_misplaced_or_repeated_results_are_refused_without_a_store(case: str) -> None:
    rows, words = BAD[case]
    requests: list[list[dict[str, Any]]] = []
    with pytest.raises(ConfigurationError, match=words):
        await arun_session_loop(
            Session().append(*rows), AGENT, executor=_recording(requests), tools=[look]
        )
    assert requests == []


@pytest.mark.parametrize("case", sorted(BAD))
async def test_misplaced_or_repeated_results_are_refused_with_a_store(
    store: Store, case: str
) -> None:
    rows, words = BAD[case]
    requests: list[list[dict[str, Any]]] = []
    with pytest.raises(ConfigurationError, match=words):
        await arun_session_loop(
            Session().append(*rows), AGENT, executor=_recording(requests), tools=[look],
            store=store, conversation="k",
        )  # fmt: skip
    await store.asettled()
    assert requests == []
    assert (await store.conversation("k")).rows == ()
    assert await store.apending("k") == []


async def test_a_second_result_across_the_stored_conversation_is_refused(store: Store) -> None:
    await store.aappend("k", [ChunkRow.user("look x up"), _calls("c1", "c2"), _result("c1")])
    requests: list[list[dict[str, Any]]] = []
    with pytest.raises(ConfigurationError, match="second result"):
        await arun_session_loop(
            Session().append(_result("c1", "again"), _result("c2")), AGENT,
            executor=_recording(requests), tools=[look], store=store, conversation="k",
        )  # fmt: skip
    await store.asettled()
    assert requests == []
    assert len((await store.conversation("k")).rows) == 3


async def test_a_result_after_a_stored_message_is_refused(store: Store) -> None:
    await store.aappend("k", [ChunkRow.user("look x up"), _calls("c1"), _result("c1")])
    await store.aappend("k", [ChunkRow.user("thanks")])
    with pytest.raises(ConfigurationError, match="does not follow"):
        await arun_session_loop(
            Session().append(_result("c1")), AGENT, executor=ScriptedExecutor(["x"]),
            tools=[look], store=store, conversation="k",
        )  # fmt: skip
    assert len((await store.conversation("k")).rows) == 4


async def test_results_that_follow_their_calls_across_the_store_are_kept(store: Store) -> None:
    """The conversation ends with calls; the input starts with their results (one supplied by
    the caller per call), then goes on: the pass sends them as they are."""
    await store.aappend("k", [ChunkRow.user("look x and y up"), _calls("c1", "c2")])
    requests: list[list[dict[str, Any]]] = []
    await arun_session_loop(
        Session().append(_result("c1", "x"), _result("c2", "y"), ChunkRow.user("and?")),
        AGENT, executor=_recording(requests), tools=[look], store=store, conversation="k",
    )  # fmt: skip
    (sent,) = requests
    assert [m["role"] for m in sent][-4:] == ["assistant", "tool", "tool", "user"]
    assert [m["content"] for m in sent if m["role"] == "tool"] == ["x", "y"]
    kinds = [r.kind for r in (await store.conversation("k")).rows]
    assert kinds == ["user", "assistant", "tool_result", "tool_result", "user", "assistant"]


async def test_results_that_follow_their_calls_without_a_store_are_kept() -> None:
    requests: list[list[dict[str, Any]]] = []
    given = Session().append(ChunkRow.user("look x up"), _calls("c1", "c2"), _result("c2"))
    out = await arun_session_loop(given, AGENT, executor=_recording(requests), tools=[look])
    (sent,) = requests
    assert sorted(m["tool_call_id"] for m in sent if m["role"] == "tool") == ["c1", "c2"]
    assert out.rows[-1].kind == "assistant"


async def test_an_append_of_a_second_result_is_refused(store: Store) -> None:
    """`store.append` checks results as a pass's input is checked: rows of results only too."""
    await store.aappend("k", [ChunkRow.user("look x up"), _calls("c1", "c2"), _result("c1")])
    with pytest.raises(ConfigurationError, match="second result"):
        await store.aappend("k", [_result("c1", "again")])
    with pytest.raises(ConfigurationError, match="does not follow"):
        await store.aappend("k", [ChunkRow.user("and?"), _result("c2")])
    assert len((await store.conversation("k")).rows) == 3
    assert await store.aappend("k", [_result("c2")]) == 4  # its own result, once: kept


async def test_an_import_of_a_misplaced_result_is_refused(store: Store, tmp_path: Any) -> None:
    """A transcript whose result follows a later message (one a pass refused to send: its
    input rows were persisted first) is refused whole; nothing is written."""
    path = tmp_path / "old.jsonl"
    lines = [
        {"type": "header", "schema": 1, "session_id": "old", "parent_ids": [],
         "operator": "run_session_loop", "created_at": 1.0, "placement": None, "agent_rows": []},
        *({"type": "row", "kind": r.kind, "payload": r.payload}
          for r in BAD["after_a_later_message"][0]),
        {"type": "trailer", "rows": 4, "usage": {}, "stop_reason": "final_answer",
         "metadata": {}},
    ]  # fmt: skip
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(ConfigurationError, match="does not follow"):
        await store.aimport_jsonl(path)
    assert [c.key for c in await store.aconversations()] == []
