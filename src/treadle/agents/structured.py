"""Structured output: validate an agent's answer against a pydantic model, with bounded retries.

Two modes. `"tool"` (the default, works with every OpenAI-compatible server) offers a tool named
`final_result` whose parameters are the model's JSON schema; the model's call to it ends the pass
and its arguments are the output. `"native"` sends `response_format = {"type": "json_schema",
"json_schema": {"name", "schema", "strict"}}` and validates the final text. Both send the schema
in strict mode when it allows (see `OutputSpec.strict`). A reply that
does not validate goes back to the model with the validation errors, at most `output_retries`
times; after that `StructuredOutputError` is raised.

This module only builds values and inspects finished sessions; it never calls a model itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import pydantic
import pydantic_core

from treadle.errors import ConfigurationError, StructuredOutputError, ToolArgumentsError
from treadle.tools import Tool, ToolContext
from treadle.tools.results import error_content, success_content
from treadle.tools.schema import resolve_strict

if TYPE_CHECKING:
    from treadle.llm.provider import Provider
    from treadle.loop.control import PassControl
    from treadle.session import ChunkRow, Session

__all__ = [
    "DEFAULT_OUTPUT_RETRIES",
    "FINAL_RESULT_TOOL",
    "OutputSpec",
    "StructuredMode",
    "StructuredOutputError",
]

StructuredMode = Literal["tool", "native"]

#: Times a reply that fails validation is sent back to the model before giving up.
DEFAULT_OUTPUT_RETRIES = 2
#: Name of the final-answer tool offered in tool mode.
FINAL_RESULT_TOOL = "final_result"

# Interrupt reasons the agent's `on_message` hook uses to end a pass (never shown to users).
_ACCEPTED = "treadle:final_result"
_GAVE_UP = "treadle:output_retries_exhausted"


def _format_errors(error: pydantic.ValidationError) -> str:
    parts = []
    for item in error.errors(include_url=False, include_input=False):
        path = ".".join(str(p) for p in item["loc"]) or "(root)"
        parts.append(f"{path}: {item['msg']}")
    return "; ".join(parts)


class _FinalResultTool(Tool):
    """The tool-mode final answer: its arguments are the output; invalid ones go back as errors."""

    def __init__(self, spec: OutputSpec) -> None:
        self.name = spec.tool_name
        self.description = (
            "Give your final answer by calling this tool with the result. "
            "Call it once, when you are done."
        )
        self.parameters = spec.schema
        self.strict = spec.strict
        self._wire = (spec.wire_schema, spec.sent_strict)  # decided once, by the spec
        self._spec = spec

    def validate(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """Validate against the output model; `ToolArgumentsError` lists the bad fields."""
        try:
            self._spec.model.model_validate(dict(arguments))
        except pydantic.ValidationError as err:
            raise ToolArgumentsError(
                f"the final result does not match its schema: {_format_errors(err)}",
                detail="fix these fields and call final_result again",
            ) from None
        return dict(arguments)

    async def invoke(self, arguments: Mapping[str, Any], *, context: ToolContext) -> Any:
        """Reached only when the pass was not ended by the agent (e.g. used outside an Agent)."""
        return {"accepted": True}


@dataclass
class OutputState:
    """What one agent run learned about its output so far (one per run, never shared)."""

    failures: int = 0
    last_error: str = ""
    output: Any = None
    call_id: str | None = None


@dataclass(frozen=True)
class OutputSpec:
    """How an agent validates its output: the model type, the mode and the retry bound."""

    model: type[pydantic.BaseModel]
    mode: StructuredMode = "tool"
    retries: int = DEFAULT_OUTPUT_RETRIES
    tool_name: str = FINAL_RESULT_TOOL
    strict: bool | None = None
    """Strict mode for the output schema: None (default) when the schema allows it (optional
    fields become required: the model then fills every field), True always (an error where it
    cannot be), False never."""
    schema: dict[str, Any] = field(init=False)
    wire_schema: dict[str, Any] = field(init=False)
    """The schema as sent (the strict form when `sent_strict`)."""
    sent_strict: bool = field(init=False)
    tool: Tool = field(init=False)

    def __post_init__(self) -> None:
        if not (isinstance(self.model, type) and issubclass(self.model, pydantic.BaseModel)):
            raise ConfigurationError(
                f"output_type must be a pydantic BaseModel subclass, got {self.model!r}."
            )
        if self.mode not in ("tool", "native"):
            raise ConfigurationError(
                f"structured_mode must be 'tool' or 'native', got {self.mode!r}."
            )
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) or self.retries < 0:
            raise ConfigurationError("output_retries must be an int >= 0.")
        if self.strict not in (None, True, False):
            raise ConfigurationError("strict_output must be True, False or None.")
        schema = self.model.model_json_schema()
        schema.pop("title", None)
        what = f"output_type {self.model.__name__}"
        wire, strict = resolve_strict(what, schema, self.strict, required_ok=True)
        object.__setattr__(self, "schema", schema)
        object.__setattr__(self, "wire_schema", wire)
        object.__setattr__(self, "sent_strict", strict)
        object.__setattr__(self, "tool", _FinalResultTool(self))

    # -- request side ------------------------------------------------------------------------
    def response_format(self) -> dict[str, Any]:
        """The native-mode `response_format` request field."""
        return {
            "type": "json_schema",
            "json_schema": {
                "name": self.model.__name__,
                "schema": self.wire_schema,
                "strict": self.sent_strict,
            },
        }

    def provider_for(self, provider: Provider | None) -> Provider | None:
        """The provider to send requests with (native mode adds `response_format`)."""
        if self.mode != "native" or provider is None:
            return provider
        return dataclasses.replace(provider, response_format=self.response_format())

    def on_message(self, state: OutputState) -> Any:
        """An `on_message` hook that ends the pass when the model calls the final-result tool."""

        async def hook(row: ChunkRow, control: PassControl) -> None:
            if row.kind != "assistant":
                return
            calls = [
                c for c in row.tool_calls if c.get("function", {}).get("name") == self.tool_name
            ]
            if not calls:
                return
            call = calls[0]
            raw = call.get("function", {}).get("arguments") or "{}"
            try:
                state.output = self.model.model_validate_json(raw)
            except pydantic.ValidationError as err:
                state.failures += 1
                state.last_error = _format_errors(err)
                if state.failures > self.retries:
                    control.interrupt(_GAVE_UP)
                return  # the tool round reports the error to the model, which tries again
            state.call_id = str(call.get("id", ""))
            control.interrupt(_ACCEPTED)

        return hook

    # -- reply side --------------------------------------------------------------------------
    def finish(self, out: Session, state: OutputState) -> Session | str:
        """The final session with `metadata["output"]`, or a correction to send back.

        Returns a `Session` when the pass is done (validated, or stopped by a limit: no output),
        or the text of a user message asking the model to fix its answer. Raises
        `StructuredOutputError` once the retries are used up.
        """
        data = out.data
        reason = out.interrupt_reason
        if out.stop_reason == "interrupted" and reason == _ACCEPTED:
            return self._accept_tool_call(out, state)
        if out.stop_reason == "interrupted" and reason == _GAVE_UP:
            raise self._error(state)
        if out.stop_reason != "final_answer":
            return out  # a limit, a guardrail or a cancellation: nothing to validate
        text = out.final_text or ""
        try:
            value = self.model.model_validate_json(text)
        except pydantic.ValidationError as err:
            state.failures += 1
            state.last_error = _format_errors(err)
            if state.failures > self.retries:
                raise self._error(state) from None
            if self.mode == "tool":
                return (
                    f"Give your final answer by calling the `{self.tool_name}` tool "
                    "(plain text is not accepted)."
                )
            return (
                "Your answer is not valid JSON for the required schema: "
                f"{state.last_error}. Answer again with only the corrected JSON."
            )
        metadata = {**data.metadata, "output": value}
        return out.with_data(metadata=metadata)

    def _accept_tool_call(self, out: Session, state: OutputState) -> Session:
        from treadle.session import ChunkRow

        data = out.data
        last = data.table.rows[-1]
        rows = []
        for call in last.tool_calls:  # every call of the row gets its result: no orphans
            cid = str(call.get("id", ""))
            name = str(call.get("function", {}).get("name", ""))
            if cid == state.call_id and name == self.tool_name:
                content = success_content({"accepted": True})
            else:
                content = error_content(
                    "not_run",
                    "the final result was given in the same reply; this call did not run.",
                )
            rows.append(
                ChunkRow._trusted(
                    "tool_result", {"tool_call_id": cid, "name": name, "content": content}
                )
            )
        metadata = {
            k: v for k, v in data.metadata.items() if k not in ("interrupt_reason", "cancelled")
        }
        metadata["output"] = state.output
        return out.with_data(
            table=data.table.extend(rows), stop_reason="final_answer", metadata=metadata
        )

    def _error(self, state: OutputState) -> StructuredOutputError:
        return StructuredOutputError(
            f"the model gave no valid {self.model.__name__} after {self.retries} retries "
            f"(last problem: {state.last_error or 'no answer'}); raise output_retries or "
            "simplify the output type."
        )


def output_json(value: Any) -> str:
    """A validated output as JSON text (for handing it to the next agent or a tool result)."""
    if isinstance(value, pydantic.BaseModel):
        return value.model_dump_json()
    return pydantic_core.to_json(value).decode()
