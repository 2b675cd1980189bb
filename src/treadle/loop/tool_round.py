"""One tool round of a pass: record intents, run the calls, turn outcomes into `tool_result` rows.

Every call goes through the one dispatcher, `treadle.tools.run_tool_calls` (concurrent, owned by a
task group, errors reported to the model), whether the tools run themselves or a custom
executor's `dispatch_tool` runs them. Before any tool runs the persisted file records an intent
per call, so a resume after a crash can tell a call whose outcome is unknown from one that never
started.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from treadle.persist.writer import SessionWriter
from treadle.session import ChunkRow, ChunkTable, ToolCall
from treadle.tools import ToolContext, ToolSet, run_tool_calls

__all__ = ["pending_tool_calls", "run_round"]


def pending_tool_calls(table: ChunkTable) -> list[ToolCall]:
    """Tool calls of the last assistant row that have no `tool_result` row yet (for resume)."""
    answered: set[str] = set()
    for i in range(len(table) - 1, -1, -1):
        row = table[i]
        if row.kind == "tool_result":
            answered.add(str(row.payload.get("tool_call_id")))
        elif row.kind == "assistant":
            return [c for c in row.calls if c.id not in answered]
        else:
            return []
    return []


async def run_round(
    calls: Sequence[ToolCall],
    tools: ToolSet,
    executor: object,
    context: ToolContext,
    writer: SessionWriter | None,
    unknown_outcome: Collection[str],
    denied: Mapping[str, str],
) -> list[ChunkRow]:
    """Run `calls` and return one `tool_result` row per call, in call order."""
    if writer is not None:
        await writer.intents([(c.id, c.name) for c in calls if c.id not in denied])
    outcomes = await run_tool_calls(
        calls,
        tools,
        context=context,
        executor=executor,
        denied=denied,
        unknown_outcome=unknown_outcome,
    )
    return [
        ChunkRow._trusted(
            "tool_result",
            {"tool_call_id": call.id, "name": call.name, "content": outcome.content},
        )
        for call, outcome in zip(calls, outcomes, strict=True)
    ]
