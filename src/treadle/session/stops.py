"""`StopReason`: why a pass ended, as a `Literal` so a misspelled comparison fails type checks.

| value | when |
| --- | --- |
| `final_answer` | the model answered without a tool call (or a tool's result ended the pass) |
| `max_steps` | `Limits.max_steps` / `max_tool_rounds` / `Limits.max_tool_calls` reached |
| `budget` | `Limits.max_total_tokens` reached, or `on_budget_exceeded` raised to stop |
| `deadline` | `Limits.deadline_seconds` passed |
| `interrupted` | `PassControl.interrupt(...)`, or a tool call waits for approval |
| `blocked` | a guardrail tripped |
| `cancelled` | the pass was cancelled |
"""

from __future__ import annotations

from typing import Literal, cast

__all__ = ["STOP_REASONS", "StopReason", "as_stop_reason"]

StopReason = Literal[
    "final_answer", "max_steps", "budget", "deadline", "interrupted", "blocked", "cancelled"
]
"""Why a pass ended (`Session.stop_reason`)."""

STOP_REASONS: frozenset[str] = frozenset(
    ("final_answer", "max_steps", "budget", "deadline", "interrupted", "blocked", "cancelled")
)
"""Every `StopReason` value, for checks at run time."""


def as_stop_reason(value: object) -> StopReason | None:
    """`value` as a `StopReason` when it is one (e.g. read from a saved file), else None."""
    return cast(StopReason, value) if isinstance(value, str) and value in STOP_REASONS else None
