"""`ToolCall`: one tool call an assistant row asks for, as a typed value. Pure, no I/O.

Rows keep the OpenAI wire shape (`{"id", "type", "function": {"name", "arguments"}}`) because
that is what is sent back to the provider; every layer that acts on a call reads it through this
value instead of probing the dict.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pydantic_core

from treadle._frozen import quick_init

__all__ = ["ToolCall", "tool_calls_of"]


@quick_init
@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call the model asked for: its id, the tool name and the raw JSON arguments text."""

    id: str
    """The call id the `tool_result` row answers (`call_<index>` when the provider sent none)."""
    name: str
    """The tool name as the model sent it (possibly unknown)."""
    arguments: str
    """The arguments exactly as sent: JSON object text (empty means `{}`)."""

    @classmethod
    def from_wire(cls, call: Mapping[str, Any], index: int = 0) -> ToolCall:
        """The value of one wire-shaped call; missing fields become empty, never an error."""
        function = call.get("function")
        name = arguments = ""
        if type(function) is dict or isinstance(function, Mapping):  # a dict: no ABC check
            name = str(function.get("name") or "")
            raw = function.get("arguments")
            if isinstance(raw, str):
                arguments = raw
            elif raw is not None:  # a non-conforming server sent an object: keep it as JSON
                arguments = pydantic_core.to_json(raw, fallback=str).decode()
        call_id = call.get("id")
        return cls(str(call_id) if call_id else f"call_{index}", name, arguments)


def tool_calls_of(calls: Sequence[Mapping[str, Any]] | None) -> tuple[ToolCall, ...]:
    """Typed values of a row's wire `tool_calls` (empty for none)."""
    if not calls:
        return ()
    return tuple(ToolCall.from_wire(call, i) for i, call in enumerate(calls))
