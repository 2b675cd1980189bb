"""Session values: constructors, interop with message lists, fork/merge and lineage."""

from __future__ import annotations

import gc
import json
from typing import Any

import pytest

from treadle import ChunkRow, ConfigurationError, Session, Usage


def test_constructors() -> None:
    agent = Session.from_agent_prompt("be brief")
    user = Session.from_user_message("hello")
    assert agent.chunk_table.kinds() == ["system"]
    assert user.chunk_table.kinds() == ["user"]
    assert agent.lineage.kind == "agent"
    assert user.lineage.operator == "from_user_message"
    assert len(agent.id) == 32 and agent.id != user.id
    assert user.usage == Usage()
    assert user.stop_reason is None
    assert user.done()


def test_constructors_validate_input() -> None:
    with pytest.raises(ConfigurationError, match="must be a str"):
        Session.from_user_message(42)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="message 1: field 'role'"):
        Session.from_messages([{"role": "user", "content": "x"}, {"content": "no role"}])
    with pytest.raises(ConfigurationError, match="list of message dicts"):
        Session.from_messages({"role": "user", "content": "x"})  # type: ignore[arg-type]


def test_messages_round_trip() -> None:
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "add 2 and 3"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "name": "add", "content": '{"ok": true}'},
        {"role": "assistant", "content": "5"},
    ]
    session = Session.from_messages(messages)
    assert session.chunk_table.kinds() == [
        "system",
        "user",
        "assistant",
        "tool_result",
        "assistant",
    ]
    assert session.to_messages() == messages
    assert session.final_text == "5"


def test_add_user_message_and_append_make_new_values() -> None:
    first = Session.from_user_message("one")
    second = first.add_user_message("two")
    third = second.append(ChunkRow("assistant", {"content": "ok"}))
    assert len(first.chunk_table) == 1
    assert [r.content for r in third.rows] == ["one", "two", "ok"]
    assert third.lineage.parents[0] is second.lineage


def test_fork_and_merge() -> None:
    base = Session.from_user_message("root")
    left = base.fork().append(ChunkRow.user("left"))
    right = base.fork().append(ChunkRow.user("right"))
    merged = left.merge(right)
    assert [r.content for r in merged.rows] == ["root", "left", "right"]
    assert merged.lineage.operator == "merge"
    assert set(merged.lineage.parent_ids) == {left.id, right.id}


def test_lineage_walks_and_exports() -> None:
    root = Session.from_user_message("root")
    child = root.fork()
    grandchild = child.add_user_message("more")
    assert [n.id for n in grandchild.ancestors()] == [child.id, root.id]
    assert [n.id for n in root.descendants()] == [child.id, grandchild.id]
    text = child.lineage_mermaid()
    assert text.startswith("graph TD")
    assert f"s_{root.id} --> s_{child.id}" in text
    assert f"s_{child.id} --> s_{grandchild.id}" in text


def test_descendants_do_not_outlive_their_sessions() -> None:
    root = Session.from_user_message("root")
    for _ in range(100):
        root.fork()
    gc.collect()
    assert root.descendants() == []


def test_with_data_keeps_identity() -> None:
    session = Session.from_user_message("x")
    changed = session.with_data(stop_reason="final_answer")
    assert changed.id == session.id and changed.stop_reason == "final_answer"
    assert session.stop_reason is None


def test_require_sandbox_without_placement_is_a_clear_error() -> None:
    with pytest.raises(ConfigurationError, match=r"to\('local'\)"):
        Session.from_user_message("x").require_sandbox()


# Every message shape the Chat Completions API accepts (OpenAI API reference, "messages").
CHAT_COMPLETIONS_MESSAGES: list[dict[str, Any]] = [
    {"role": "developer", "content": "Answer in French."},
    {"role": "system", "content": [{"type": "text", "text": "Be brief."}], "name": "ops"},
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "What is in this picture?"},
            {
                "type": "image_url",
                "image_url": {"url": "data:image/png;base64,AA", "detail": "low"},
            },
            {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
            {"type": "file", "file": {"file_id": "file-1"}},
        ],
        "name": "ana",
    },
    {"role": "assistant", "content": None, "refusal": "I can't help with that."},
    {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
    {"role": "assistant", "content": [{"type": "text", "text": "Looking."}], "audio": {"id": "a1"}},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}},
            {"id": "c2", "type": "custom", "custom": {"name": "grep", "input": "foo"}},
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": '{"ok": true}'},
    {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "found"}]},
    {"role": "assistant", "content": "Voilà.", "name": "bot"},
]


def test_from_messages_round_trips_every_chat_completions_message() -> None:
    session = Session.from_messages(CHAT_COMPLETIONS_MESSAGES)
    assert session.to_messages() == CHAT_COMPLETIONS_MESSAGES
    assert [r.kind for r in session.rows][:2] == ["system", "system"]
    assert session.rows[0].role == "developer"
    # the standard tool message (no `name`) answers its call: nothing is pending on resume
    assert [r.kind for r in session.rows[7:9]] == ["tool_result", "tool_result"]
    # and the bytes sent on the wire are the messages as given
    assert [json.loads(r.message_json()) for r in session.rows] == CHAT_COMPLETIONS_MESSAGES


def test_merge_counts_a_shared_ancestors_usage_once() -> None:
    from treadle.loop import run_session_loop
    from treadle.testing.scripted import ScriptedExecutor, text

    agent = Session.from_agent_prompt("Answer.")

    def spent(prompt: int, completion: int) -> ScriptedExecutor:
        usage = {"prompt_tokens": prompt, "completion_tokens": completion}
        return ScriptedExecutor([text("ok", usage=usage)])

    base = run_session_loop(Session.from_user_message("start"), agent, executor=spent(80, 20))
    left = run_session_loop(base.add_user_message("left"), agent, executor=spent(10, 5))
    right = run_session_loop(base.add_user_message("right"), agent, executor=spent(10, 5))
    merged = left.merge(right)
    # spent: 100 (base) + 15 (left) + 15 (right); both sides carry the base's 100
    assert merged.usage == Usage(100, 30, 130, 3)
    assert left.merge(left).usage == left.usage  # a session merged with itself adds nothing
    unrelated = Session.from_user_message("x").with_data(usage=Usage(1, 1, 2, 1))
    assert left.merge(unrelated).usage == left.usage + unrelated.usage
