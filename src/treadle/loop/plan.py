"""`PassPlan`: everything one pass needs, validated at the call; and the small pure helpers the
pass uses on its rows and metadata. No I/O here."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from treadle.llm.provider import Provider
from treadle.llm.turn import ModelExecutor
from treadle.loop.control import Guardrail, Limits, ToolGuardrail, Tripwire
from treadle.loop.events import Event
from treadle.loop.hooks import Hooks
from treadle.loop.request_usage import RequestUsage
from treadle.loop.soft_stop import StopRequest
from treadle.loop.tooling import ToolUseBehavior
from treadle.session import ChunkTable, Session, ToolCall
from treadle.session.rows import valid_text
from treadle.telemetry import TraceParent
from treadle.tools import ToolSet

if TYPE_CHECKING:  # the stores load with the first pass that uses one
    from treadle.stores import PendingPass, Store

__all__ = ["PassPlan", "pending_tool_calls", "plain_metadata", "unique_call_ids"]


@dataclass(slots=True)
class PassPlan:
    """Everything a pass needs, validated at the call (before anything runs)."""

    user: Session
    agent: Session
    provider: Provider | None
    tools: ToolSet
    executor: ModelExecutor
    max_tool_rounds: int
    on_event: Callable[[Any], Any] | None
    persist_path: Path | None
    stream: bool
    limits: Limits = field(default_factory=Limits)
    guardrails: Sequence[Guardrail] = ()
    on_message: Callable[..., Any] | None = None
    approvals: Mapping[str, bool | str] | None = None
    """The pass's own copy of `approvals=`: each decided round spends its calls' ids."""
    emit: Callable[[Event], None] | None = None
    trace_parent: TraceParent | None = None
    """The caller's tracing context (None when tracing is off)."""
    agent_name: str | None = None
    """The agent's name, for traces."""
    hooks: Hooks | None = None
    """Lifecycle hooks (None: none, and no cost)."""
    stop: StopRequest = field(default_factory=StopRequest)
    """Set by a soft cancel: stop after the current turn."""
    tool_guardrails: Sequence[ToolGuardrail] = ()
    """Checks on tool calls and their results."""
    tool_use_behavior: ToolUseBehavior = "run_llm_again"
    """Whether a tool round ends the pass (see `ToolUseBehavior`)."""
    reset_tool_choice: bool = True
    """A forced `tool_choice` becomes `"auto"` once a tool ran (so a pass cannot loop)."""
    on_message_context: str | None = None
    """`on_message`'s parameter that receives the `ToolContext`, if it asks for one."""
    deps: Any = None
    """The caller's dependencies for this pass (`ToolContext.deps`); held in memory only, never
    written to the transcript or a persisted file."""
    store: Store | None = None
    """The conversation store the pass continues and commits to (with `conversation`)."""
    conversation: str | PendingPass | None = None
    """The conversation's key, or a pending pass of the store to resume."""


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


def unique_call_ids(payload: dict[str, Any]) -> dict[str, Any]:
    """An assistant payload whose tool calls have distinct, non-empty ids: a repeated id gets
    `<id>_<position>` and an empty one `call_<position>` (as `turn_of` names them), so each
    call gets its own result row and only the first of two transfers sharing an id takes
    effect. The payload itself when every id is already distinct (the usual case, no copy)."""
    calls = payload.get("tool_calls")
    if not calls:
        return payload
    ids = [c.get("id") if isinstance(c, dict) else None for c in calls]
    if all(ids) and len(set(ids)) == len(ids):
        return payload
    given_ids = {i for i in ids if isinstance(i, str) and i}
    seen: set[str] = set()
    fixed = []
    for i, call in enumerate(calls):
        given = ids[i]
        if isinstance(given, str) and given and given not in seen:
            new = given  # the first call with an id keeps it
        else:
            new = f"{given}_{i}" if isinstance(given, str) and given else f"call_{i}"
            while new in seen or new in given_ids:
                new += "_"
        seen.add(new)
        fixed.append(call if new == given or not isinstance(call, dict) else {**call, "id": new})
    return {**payload, "tool_calls": fixed}


def plain_metadata(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """Metadata as JSON-friendly values for the trailer and the store's commit (their text
    through `valid_text`, so both hold the same)."""
    out: dict[str, Any] = {}
    for key, value in metadata.items():
        if isinstance(value, Tripwire):
            out[key] = {"reason": value.reason, "guardrail": value.guardrail, "when": value.when}
        elif key == "request_usage" and isinstance(value, tuple):
            out[key] = [_plain_entry(v) for v in value if isinstance(v, RequestUsage)]
        elif isinstance(value, (str, int, float, bool, list, dict)) or value is None:
            out[key] = value
    return valid_text(out)  # type: ignore[no-any-return]


def _plain_entry(entry: RequestUsage) -> dict[str, Any]:
    return {
        "input_tokens": entry.input_tokens,
        "output_tokens": entry.output_tokens,
        "cached_tokens": entry.cached_tokens,
        "reasoning_tokens": entry.reasoning_tokens,
        "response_id": entry.response_id,
        "latency_seconds": entry.latency_seconds,
        "agent": entry.agent,
        "request_id": entry.request_id,
    }
