"""ChunkRow validation and ChunkTable's immutable, O(1)-append behaviour."""

from __future__ import annotations

import pydantic_core
import pytest

from treadle import ChunkRow, ChunkTable, ConfigurationError


def test_row_kinds_and_roles() -> None:
    assert ChunkRow.system("s").role == "system"
    assert ChunkRow.user("u").role == "user"
    row = ChunkRow("tool_result", {"tool_call_id": "c1", "name": "t", "content": "{}"})
    assert row.role == "tool"
    assert row.to_message() == {"role": "tool", "tool_call_id": "c1", "name": "t", "content": "{}"}


def test_bad_kind_is_a_clear_value_error() -> None:
    with pytest.raises(ValueError, match="row kind 'robot'"):
        ChunkRow("robot", {"content": "x"})


@pytest.mark.parametrize(
    ("kind", "payload", "field"),
    [
        ("user", {}, "content"),
        ("user", {"content": 3}, "content"),
        # a tool message needs the id of the call it answers (its `name` is optional)
        ("tool_result", {"name": "t", "content": "{}"}, "tool_call_id"),
        (
            "assistant",
            {"content": None, "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]},
            "tool_calls.0.function.name",
        ),
    ],
)
def test_bad_payload_names_the_field(kind: str, payload: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=f"field '{field}'"):
        ChunkRow(kind, payload)


def test_unknown_provider_fields_are_kept() -> None:
    row = ChunkRow("assistant", {"content": "hi", "reasoning_content": "because"})
    assert row.payload["reasoning_content"] == "because"
    assert ChunkRow.from_message(row.to_message()) == row


def test_from_message_rejects_unknown_role() -> None:
    with pytest.raises(ConfigurationError, match="'role'"):
        ChunkRow.from_message({"role": "wizard", "content": "x"})


def test_message_json_is_encoded_once() -> None:
    row = ChunkRow.user("hello")
    first = row.message_json()
    assert pydantic_core.from_json(first) == {"role": "user", "content": "hello"}
    assert row.message_json() is first


def test_table_append_returns_new_table_and_shares_storage() -> None:
    t0 = ChunkTable()
    t1 = t0.append(ChunkRow.user("a"))
    t2 = t1.append(ChunkRow.user("b"))
    assert (len(t0), len(t1), len(t2)) == (0, 1, 2)
    assert t2._store is t1._store  # appended in place at the tip: O(1)
    assert [r.content for r in t2] == ["a", "b"]


def test_table_branching_copies_and_keeps_both_views_intact() -> None:
    base = ChunkTable([ChunkRow.user("a")])
    left = base.append(ChunkRow.user("left"))
    right = base.append(ChunkRow.user("right"))
    assert [r.content for r in left] == ["a", "left"]
    assert [r.content for r in right] == ["a", "right"]
    assert [r.content for r in base] == ["a"]


def test_table_appends_scale_linearly() -> None:
    table = ChunkTable()
    for i in range(20_000):
        table = table.append(ChunkRow._trusted("user", {"content": str(i)}))
    assert len(table) == 20_000
    assert table[-1].content == "19999"
    assert table[5].content == "5"
    with pytest.raises(IndexError):
        table[20_000]


def test_table_rejects_non_rows() -> None:
    with pytest.raises(ConfigurationError, match="not a ChunkRow"):
        ChunkTable([{"role": "user", "content": "x"}])  # type: ignore[list-item]


def test_table_views() -> None:
    table = ChunkTable([ChunkRow.system("s"), ChunkRow.user("u")])
    assert table.kinds() == ["system", "user"]
    assert table.rows[1].content == "u"
    assert table[0:1] == (table[0],)
    assert table.to_messages() == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
    ]
    assert table == ChunkTable([ChunkRow.system("s"), ChunkRow.user("u")])
