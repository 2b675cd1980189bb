"""Tool calls a conversation went on past without their results, and the rows that answer
them (`no_result`): used where a pass starts, with a store or without."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from treadle.errors import ConfigurationError
from treadle.session import ChunkRow, ToolCall
from treadle.tools.results import error_content

__all__ = ["answer_gaps", "no_result_rows"]


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


def answer_gaps(rows: Sequence[ChunkRow], after: Sequence[ChunkRow] = ()) -> Sequence[ChunkRow]:
    """`rows` with a "no result" row before each row that follows tool calls without results
    (every gap, not only the last: a whole transcript written before the rule, or appended
    rows); `after` is what `rows` continue (a conversation's rows so far: its last calls are
    answered too when `rows` go on with a message). Calls at the very end stay pending.
    `rows` itself (not a copy) when there is no gap.

    A tool result in `rows` must answer a call of the assistant row it follows, with only
    results between them, once: a result a message separates from its call, a second result
    for a call and a result for no call are a `ConfigurationError` (the model's API refuses
    such a transcript, and a gap filled before the message would answer the call twice)."""
    asker, calls, answered, open_round = _tail_state(after)
    fixed: list[ChunkRow] | None = None
    for i, row in enumerate(rows):
        kind = row.kind
        if kind == "tool_result":
            call_id = str(row.payload.get("tool_call_id"))
            if not open_round or call_id not in calls or call_id in answered:
                raise _misplaced(call_id, open_round, call_id in calls, i)
            answered.add(call_id)
            if fixed is not None:
                fixed.append(row)
            continue
        if open_round and calls and len(answered) < len(calls):
            missing = [c for c in asker.calls if c.id not in answered] if asker else []
            if missing:
                if fixed is None:
                    fixed = list(rows[:i])
                fixed.extend(no_result_rows(missing))
        open_round = kind == "assistant"
        if open_round:
            # Most assistant rows make no calls: their payload says so without parsing any;
            # the ids are read from the wire (typed calls are made only for a gap).
            wire = row.payload.get("tool_calls")
            calls = _call_ids(wire) if wire else _NO_CALLS
            asker = row
            answered = set()
        if fixed is not None:
            fixed.append(row)
    return rows if fixed is None else fixed


_NO_CALLS: frozenset[str] = frozenset()


def _call_ids(wire: Any) -> frozenset[str]:
    """The ids of a row's wire `tool_calls`, as `ToolCall.from_wire` reads them."""
    return frozenset(
        str(call.get("id")) if call.get("id") else f"call_{i}" for i, call in enumerate(wire)
    )


def _misplaced(call_id: str, open_round: bool, known: bool, at: int) -> ConfigurationError:
    if not open_round:
        why = (
            "does not follow the assistant row that made the call (a message or other row "
            "comes between them)"
        )
    elif known:
        why = "is a second result for that call"
    else:
        why = "answers no call of the assistant row before it"
    return ConfigurationError(
        f"input row {at}: the tool result for call {call_id[:80]!r} {why}; a call's results "
        "must come right after its assistant row, one per call, before any other message."
    )


def _tail_state(
    rows: Sequence[ChunkRow],
) -> tuple[ChunkRow | None, frozenset[str], set[str], bool]:
    """Where `rows` leave off: the last assistant row, its calls' ids and the ids answered
    after it, and whether only tool results follow it (more of them may come)."""
    answered: set[str] = set()
    for row in reversed(rows):
        if row.kind == "tool_result":
            answered.add(str(row.payload.get("tool_call_id")))
        elif row.kind == "assistant":
            wire = row.payload.get("tool_calls")
            return row, (_call_ids(wire) if wire else _NO_CALLS), answered, True
        else:
            break
    return None, _NO_CALLS, answered, False
