"""Property tests (hypothesis) for bad input: tool arguments and persisted rows.

Stream chunking (any split of an SSE reply accumulates to the same message) is covered in
`tests/test_llm_stream.py::test_any_chunking_accumulates_to_the_whole_reply` and not repeated here.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from treadle import Session, run_session_loop, tool
from treadle.persist import SessionWriter, load_session
from treadle.session import ChunkRow
from treadle.testing import ScriptedExecutor
from treadle.testing.scripted import tool_call, tool_calls

AGENT = Session.from_agent_prompt("Call the tool.")


@tool
def probe(x: int, label: str = "") -> str:
    """Echo the arguments."""
    return f"{x}:{label}"


def _run_with_arguments(arguments: str) -> dict[str, Any]:
    ex = ScriptedExecutor([tool_call("probe", arguments, id="c1"), "done"])
    out = run_session_loop(Session.from_user_message("go"), AGENT, executor=ex, tools=[probe])
    assert out.stop_reason == "final_answer" and out.final_text == "done"
    assert out.chunk_table.kinds() == ["user", "assistant", "tool_result", "assistant"]
    result = json.loads(out.rows[2].payload["content"])
    assert isinstance(result, dict)
    return result


_json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
)
json_values = st.recursive(
    _json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None)
@given(arguments=st.text())
def test_any_argument_string_ends_in_a_result_never_a_crash(arguments: str) -> None:
    result = _run_with_arguments(arguments)
    if result["ok"] is False:
        assert result["error_kind"] == "invalid_tool_arguments"
        assert result["message"]
    else:
        assert isinstance(result["result"], str)


@settings(max_examples=100, deadline=None)
@given(arguments=st.dictionaries(st.text(max_size=8), json_values, max_size=4))
def test_any_json_object_of_arguments_is_validated(arguments: dict[str, Any]) -> None:
    result = _run_with_arguments(json.dumps(arguments))
    assert result["ok"] is True or result["error_kind"] == "invalid_tool_arguments"


@settings(max_examples=50, deadline=None)
@given(names=st.lists(st.text(max_size=20), min_size=1, max_size=4))
def test_any_tool_names_get_one_result_each(names: list[str]) -> None:
    ex = ScriptedExecutor([tool_calls([(n, "{}") for n in names]), "done"])
    out = run_session_loop(Session.from_user_message("go"), AGENT, executor=ex, tools=[probe])
    assert out.stop_reason == "final_answer"
    results = [json.loads(r.payload["content"]) for r in out.rows if r.kind == "tool_result"]
    assert len(results) == len(names)
    for name, result in zip(names, results, strict=True):
        assert result["ok"] is False
        expected = "invalid_tool_arguments" if name == "probe" else "unknown_tool"
        assert result["error_kind"] == expected


_extras = st.dictionaries(
    st.text(min_size=1, max_size=8).map(lambda k: "x_" + k), json_values, max_size=3
)
_call = st.fixed_dictionaries(
    {
        "id": st.text(min_size=1, max_size=12),
        "type": st.just("function"),
        "function": st.fixed_dictionaries({"name": st.text(max_size=12), "arguments": st.text()}),
    }
)


@st.composite
def rows(draw: st.DrawFn) -> ChunkRow:
    kind = draw(st.sampled_from(["system", "user", "assistant", "tool_result"]))
    payload: dict[str, Any] = dict(draw(_extras))
    if kind in ("system", "user"):
        payload["content"] = draw(st.text())
    elif kind == "assistant":
        payload["content"] = draw(st.none() | st.text())
        calls = draw(st.lists(_call, max_size=3))
        if calls:
            payload["tool_calls"] = calls
    else:
        payload.update(
            tool_call_id=draw(st.text(min_size=1)), name=draw(st.text()), content=draw(st.text())
        )
    return ChunkRow(kind, payload)


async def _write(path: Path, head: list[ChunkRow], tail: list[ChunkRow]) -> None:
    writer = SessionWriter(path)
    await writer.open(
        session_id="s1",
        parent_ids=("u", "a"),
        operator="test",
        placement=None,
        agent_rows=(),
        rows=head,
    )
    await writer.rows(tail, turn_boundary=True)
    await writer.aclose()


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(head=st.lists(rows(), max_size=4), tail=st.lists(rows(), max_size=4))
def test_any_rows_round_trip_through_the_session_file(
    tmp_path: Path, head: list[ChunkRow], tail: list[ChunkRow]
) -> None:
    path = tmp_path / "rows.jsonl"
    asyncio.run(_write(path, head, tail))
    loaded = load_session(path)
    assert not loaded.closed
    got = [(r.kind, r.payload) for r in loaded.session.rows]
    assert got == [(r.kind, r.payload) for r in (*head, *tail)]
    # The wire form (what is sent to the model on resume) is unchanged too.
    assert [r.message_json() for r in loaded.session.rows] == [
        r.message_json() for r in (*head, *tail)
    ]
