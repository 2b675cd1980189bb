"""One tool round of a pass: record intents, run the calls, turn outcomes into `tool_result` rows.

Tools run through `treadle.tools.run_tool_calls` (concurrent, owned by a task group, errors
reported to the model), or through a custom executor's own `dispatch_tool`. Before any tool runs
the persisted file records an intent per call, so a resume after a crash can tell a call whose
outcome is unknown from one that never started.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import anyio
import pydantic_core

from treadle.loop.executor import call_dispatch, has_custom_dispatch
from treadle.persist.writer import SessionWriter
from treadle.session import ChunkRow, ChunkTable, Session
from treadle.tools import ToolSet, run_tool_calls
from treadle.tools.results import error_content, exception_detail, success_content

__all__ = ["call_name", "pending_tool_calls", "run_round"]


def pending_tool_calls(table: ChunkTable) -> list[dict[str, Any]]:
    """Tool calls of the last assistant row that have no `tool_result` row yet (for resume)."""
    answered: set[str] = set()
    for i in range(len(table) - 1, -1, -1):
        row = table[i]
        if row.kind == "tool_result":
            answered.add(str(row.payload.get("tool_call_id")))
        elif row.kind == "assistant":
            return [c for c in row.tool_calls if c.get("id") not in answered]
        else:
            return []
    return []


def call_name(call: Mapping[str, Any]) -> str:
    function = call.get("function")
    return str(function.get("name", "")) if isinstance(function, Mapping) else ""


async def run_round(
    calls: Sequence[Mapping[str, Any]],
    tools: ToolSet,
    executor: object,
    session: Session,
    writer: SessionWriter | None,
    unknown_outcome: set[str],
    denied: Mapping[str, str] | None = None,
) -> list[ChunkRow]:
    """Run `calls` and return one `tool_result` row per call, in call order.

    Calls listed in `unknown_outcome` (an intent was recorded before a crash, no result) are not
    run again unless their tool is declared `idempotent`; the model is told the outcome is unknown.
    Calls in `denied` (a human refused approval) are not run; the model gets a `denied` error.
    """
    denied = denied or {}
    if writer is not None:
        await writer.intents(
            [(str(c.get("id", "")), call_name(c)) for c in calls if str(c.get("id")) not in denied]
        )
    contents: dict[int, str] = {}
    to_run: list[tuple[int, Mapping[str, Any]]] = []
    for i, call in enumerate(calls):
        name = call_name(call)
        if str(call.get("id")) in denied:
            why = denied[str(call.get("id"))]
            contents[i] = error_content(
                "denied",
                f"the user did not approve this call to {name}" + (f": {why}" if why else "."),
            )
        elif str(call.get("id")) in unknown_outcome and not (
            name in tools and getattr(tools[name], "idempotent", False)
        ):
            contents[i] = error_content(
                "unknown_outcome",
                f"the call to {name} was interrupted by a crash; it may or may not have run. "
                "Check its effects before calling it again.",
            )
        else:
            to_run.append((i, call))
    if to_run:
        batch = [call for _, call in to_run]
        if has_custom_dispatch(executor):
            results = await _dispatch_custom(batch, tools, executor, session)
        else:
            results = [o.content for o in await run_tool_calls(batch, tools, session=session)]
        for (i, _), content in zip(to_run, results, strict=True):
            contents[i] = content
    return [
        ChunkRow._trusted(
            "tool_result",
            {
                "tool_call_id": str(call.get("id", "")),
                "name": call_name(call),
                "content": contents[i],
            },
        )
        for i, call in enumerate(calls)
    ]


async def _dispatch_custom(
    calls: Sequence[Mapping[str, Any]], tools: ToolSet, executor: object, session: Session
) -> list[str]:
    out: list[str] = [""] * len(calls)

    async def one(i: int, call: Mapping[str, Any]) -> None:
        name = call_name(call)
        if name not in tools:
            out[i] = error_content("unknown_tool", f"no tool named {name!r}.")
            return
        tool = tools[name]
        raw = call.get("function", {}).get("arguments") or "{}"
        try:
            arguments = pydantic_core.from_json(raw) if raw.strip() else {}
        except ValueError as err:
            out[i] = error_content("invalid_tool_arguments", f"arguments are not JSON: {err}")
            return
        if not isinstance(arguments, dict):
            out[i] = error_content("invalid_tool_arguments", "arguments must be a JSON object.")
            return
        try:
            result = await call_dispatch(executor, session, tool, arguments)
        except Exception as err:  # a tool's failure is the model's to handle, not the pass's
            out[i] = error_content(
                "tool_execution_exception", f"{type(err).__name__}: {err}", exception_detail(err)
            )
            return
        out[i] = success_content(result, max_chars=getattr(tool, "max_result_chars", None))

    async with anyio.create_task_group() as tg:
        for i, call in enumerate(calls):
            tg.start_soon(one, i, call)
    return out
