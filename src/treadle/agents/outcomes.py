"""How an agent run ends: output validators (`ModelRetry`), refusals, and error handlers.

- An output validator is `fn(output)` or `fn(session, output)`, sync or async; it returns the
  (possibly changed) output, or raises `ModelRetry(message)`: the message goes back to the model,
  which answers again, at most `output_retries` times in all (shared with schema failures).
- A reply carrying `refusal` is the model declining: `ModelRefusalError`, never retried.
- `error_handlers={"max_turns" | "refusal" | "invalid_output": fn}` turn that ending into a
  chosen result: `fn(AgentErrorContext)` returns the final output (text, or a value of the
  agent's `output_type`), which becomes the last assistant row.

This module only inspects and builds sessions; it never calls a model.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import pydantic

from treadle.agents.structured import output_json
from treadle.errors import ConfigurationError, ModelRefusalError
from treadle.loop.control import call_user
from treadle.session import ChunkRow, ChunkTable, Session

__all__ = [
    "ERROR_KINDS",
    "AgentErrorContext",
    "ErrorKind",
    "check_error_handlers",
    "check_validators",
    "handled",
    "refusal_error",
    "refusal_of",
    "replace_result",
    "run_validators",
]

ErrorKind = Literal["max_turns", "refusal", "invalid_output"]
#: The endings `error_handlers` may handle.
ERROR_KINDS: tuple[str, ...] = ("max_turns", "refusal", "invalid_output")


@dataclass(frozen=True, slots=True)
class AgentErrorContext:
    """What an error handler receives."""

    kind: ErrorKind
    """`max_turns`, `refusal` or `invalid_output`."""
    agent: str
    """The agent that was answering."""
    session: Session
    """The transcript when it happened."""
    error: BaseException | None = None
    """The error that would have been raised (None for `max_turns`, which is a stop)."""


def _positional(fn: Callable[..., Any]) -> int:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return 1
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return 2
    return len([p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)])


def check_validators(items: Sequence[Any] | None) -> tuple[tuple[Callable[..., Any], int], ...]:
    """Validators with how many arguments each takes (1: output; 2: session, output)."""
    out = []
    for fn in items or ():
        if not callable(fn):
            raise ConfigurationError("output_validators takes a list of callables.")
        count = _positional(fn)
        if count not in (1, 2):
            raise ConfigurationError(
                f"output validator {getattr(fn, '__name__', fn)!r} must take (output) or "
                "(session, output)."
            )
        out.append((fn, count))
    return tuple(out)


def check_error_handlers(
    handlers: Mapping[str, Callable[..., Any]] | None,
) -> dict[str, Callable[..., Any]]:
    """The handlers, keyed by known kinds only."""
    out = dict(handlers or {})
    for kind, fn in out.items():
        if kind not in ERROR_KINDS:
            raise ConfigurationError(
                f"error_handlers has no kind {kind!r}; use one of {list(ERROR_KINDS)}."
            )
        if not callable(fn):
            raise ConfigurationError(f"error_handlers[{kind!r}] must be callable.")
    return out


async def run_validators(
    validators: Sequence[tuple[Callable[..., Any], int]], session: Session, output: Any
) -> Any:
    """Run each validator in order on the output; `ModelRetry` propagates."""
    for fn, count in validators:
        output = await (call_user(fn, session, output) if count == 2 else call_user(fn, output))
    return output


def refusal_of(session: Session) -> str | None:
    """The refusal text of the last assistant row, if the model refused."""
    for row in reversed(session.data.table.rows):
        if row.kind == "assistant":
            value = row.payload.get("refusal")
            return value if isinstance(value, str) and value else None
    return None


def refusal_error(agent: str, text: str) -> ModelRefusalError:
    """The error for a refusal, naming the agent and quoting the model."""
    return ModelRefusalError(
        f"agent {agent!r}: the model refused ({text[:200]!r}); rephrase the request, or turn "
        "refusals into a result with error_handlers={'refusal': ...}.",
        refusal=text,
    )


def check_retries(value: Any) -> int:
    """`output_retries` as given, refused unless an int >= 0."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigurationError(f"output_retries must be an int >= 0, got {value!r}.")
    return value


async def handled(
    handler: Callable[..., Any],
    context: AgentErrorContext,
    model: type[pydantic.BaseModel] | None,
    stop_reason: str,
) -> Session:
    """The run's result chosen by an error handler: its answer as the last assistant row."""
    value = await call_user(handler, context)
    if model is not None and not isinstance(value, model):
        try:
            value = model.model_validate(value)
        except pydantic.ValidationError:
            name = getattr(handler, "__qualname__", None) or repr(handler)
            raise ConfigurationError(
                f"the {context.kind!r} error handler {name} of agent {context.agent!r} returned "
                f"{type(value).__name__}; it must return a {model.__name__} (or a dict that "
                "validates as one)."
            ) from None
    text = value if isinstance(value, str) else output_json(value)
    session = context.session
    data = session.data
    metadata = {
        k: v for k, v in data.metadata.items() if k not in ("interrupt_reason", "cancelled")
    }
    metadata["handled_error"] = context.kind
    if model is not None:
        metadata["output"] = value
    row = ChunkRow._trusted("assistant", {"role": "assistant", "content": text})
    return session.with_data(
        table=data.table.extend([row]), stop_reason=stop_reason, metadata=metadata
    )


def replace_result(session: Session, call_id: str, content: str) -> Session:
    """`session` with the tool result of `call_id` replaced by `content`."""
    data = session.data
    rows = [
        ChunkRow._trusted("tool_result", {**row.payload, "content": content})
        if row.kind == "tool_result" and row.payload.get("tool_call_id") == call_id
        else row
        for row in data.table.rows
    ]
    return session.with_data(table=ChunkTable(rows))
