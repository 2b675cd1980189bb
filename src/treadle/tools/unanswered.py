"""Tool calls a conversation went on past without their results, and the rows that answer
them (`no_result`): used where a pass starts, with a store or without."""

from __future__ import annotations

from collections.abc import Sequence

from treadle.session import ChunkRow, ToolCall
from treadle.tools.results import error_content

__all__ = ["answer_gaps", "no_result_rows", "unanswered_gap"]


def unanswered_gap(rows: Sequence[ChunkRow]) -> tuple[int, list[ToolCall]] | None:
    """Where `rows` go on past tool calls that have no result: the index of the first row after
    the last assistant row's calls (and their results) that is not a tool result, with the calls
    still unanswered; None when there is no such gap (calls at the very end are pending: a
    resume runs them). Scans back only to the last assistant row."""
    last = next((i for i in range(len(rows) - 1, -1, -1) if rows[i].kind == "assistant"), None)
    if last is None or not rows[last].calls:
        return None
    after = rows[last + 1 :]
    answered = {str(r.payload.get("tool_call_id")) for r in after if r.kind == "tool_result"}
    missing = [c for c in rows[last].calls if c.id not in answered]
    at = next((i for i, r in enumerate(after) if r.kind != "tool_result"), None)
    if not missing or at is None:
        return None
    return last + 1 + at, missing


def no_result_rows(calls: Sequence[ToolCall]) -> list[ChunkRow]:
    """A "no result" tool result for each of `calls`: a conversation went on with a new message
    past calls without results (a session imported or appended so, a fork cut between a call
    and its result, a pass interrupted mid-round), and a message after calls without results is
    a transcript OpenAI-style APIs refuse."""
    content = error_content(
        "no_result",
        "no result: the conversation went on with a new message before this call returned "
        "(it may not have run, or its outcome is unknown)",
    )
    return [
        ChunkRow._trusted("tool_result", {"tool_call_id": c.id, "name": c.name, "content": content})
        for c in calls
    ]


def answer_gaps(rows: Sequence[ChunkRow], after: Sequence[ChunkRow] = ()) -> list[ChunkRow]:
    """`rows` with a "no result" row before each row that follows tool calls without results
    (every gap, not only the last: a whole transcript written before the rule, or appended
    rows); `after` is what `rows` continue (a conversation's rows so far: its last calls are
    answered too when `rows` go on with a message). Calls at the very end stay pending."""
    waiting = unanswered_tail(after)
    fixed: list[ChunkRow] = []
    for row in rows:
        if row.kind == "tool_result":
            waiting.pop(str(row.payload.get("tool_call_id")), None)
        elif waiting:
            fixed.extend(no_result_rows(list(waiting.values())))
            waiting = {}
        if row.kind == "assistant":
            waiting = {c.id: c for c in row.calls}
        fixed.append(row)
    return fixed


def unanswered_tail(rows: Sequence[ChunkRow]) -> dict[str, ToolCall]:
    """The calls of the last assistant row of `rows` that no later row answers, when only tool
    results follow it (by id; empty otherwise)."""
    answered: set[str] = set()
    for row in reversed(rows):
        if row.kind == "tool_result":
            answered.add(str(row.payload.get("tool_call_id")))
        elif row.kind == "assistant":
            return {c.id: c for c in row.calls if c.id not in answered}
        else:
            return {}
    return {}
