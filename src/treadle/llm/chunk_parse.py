"""Parsing the `data:` payloads of a streamed chat completion, checked against the chunk schema.

Two forms with the same checks: `parse_chunk` gives a typed `ChatCompletionChunk` (what
`ModelClient.stream` yields), `parse_event` a plain dict validated by the same schema (fields of
the same types, unknown fields kept), which the turn folds in without building models per event.
A payload that is not JSON or does not match the schema raises `MalformedResponse`; an event
carrying `error` (a bare `{"error": ...}`, or OpenRouter's chunk with an `error` field) raises the
typed `ProviderError` it reports, with the status it names (`ProviderError.status_code`).
Each parser also returns the event's `usage.total_tokens` (None when absent) and whether a
choice reported a finish reason.
"""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, TypeAdapter, ValidationError
from pydantic_core import from_json
from typing_extensions import TypedDict

from treadle.errors import ProviderError
from treadle.llm.http_errors import error_from_payload, malformed
from treadle.llm.inband import error_in, status_in
from treadle.llm.wire import ChatCompletionChunk

__all__ = ["ChunkEvent", "parse_chunk", "parse_event"]

_EXTRA = ConfigDict(extra="allow")


# The chunk schema of wire.py as TypedDicts: validated in pydantic-core, no model instances.
class _FunctionDelta(TypedDict, total=False):
    __pydantic_config__ = _EXTRA  # type: ignore[misc]
    name: str | None
    arguments: str | None


class _ToolCallDelta(TypedDict, total=False):
    __pydantic_config__ = _EXTRA  # type: ignore[misc]
    index: int | None
    id: str | None
    type: str | None
    function: _FunctionDelta | None


class _Delta(TypedDict, total=False):
    __pydantic_config__ = _EXTRA  # type: ignore[misc]
    role: str | None
    content: str | list[dict[str, Any]] | None
    tool_calls: list[_ToolCallDelta] | None


class _Choice(TypedDict, total=False):
    __pydantic_config__ = _EXTRA  # type: ignore[misc]
    index: int
    delta: _Delta
    finish_reason: str | None


class _Usage(TypedDict, total=False):
    __pydantic_config__ = _EXTRA  # type: ignore[misc]
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChunkEvent(TypedDict, total=False):
    """One stream event as a validated dict (the fields of `ChatCompletionChunk`, all optional)."""

    __pydantic_config__ = _EXTRA  # type: ignore[misc]
    id: str
    object: str
    created: int
    model: str
    choices: list[_Choice]
    usage: _Usage | None


_EVENT = TypeAdapter(ChunkEvent)


def parse_chunk(
    data: bytes, api_key: str | None, request_id: str | None
) -> tuple[ChatCompletionChunk, int | None, bool]:
    """`(chunk, usage total or None, finished)` of one payload, as a typed chunk."""
    try:
        chunk = ChatCompletionChunk.model_validate_json(data)
    except ValidationError as exc:
        raise _bad_event(data, api_key, request_id) from exc
    extra = chunk.model_extra
    if extra and "error" in extra:
        error = error_in(extra, request_id=chunk.id or request_id, api_key=api_key)
        if error is not None:
            raise error
    usage = chunk.usage
    finished = False
    for choice in chunk.choices:
        if choice.finish_reason is not None:
            finished = True
    return chunk, (usage.total_tokens if usage is not None else None), finished


def parse_event(
    data: bytes, api_key: str | None, request_id: str | None
) -> tuple[ChunkEvent, int | None, bool]:
    """`(event, usage total or None, finished)` of one payload, as a validated dict."""
    try:
        event = _EVENT.validate_json(data)
    except ValidationError as exc:
        raise _bad_event(data, api_key, request_id) from exc
    if "error" in event:
        error = error_in(event, request_id=event.get("id") or request_id, api_key=api_key)
        if error is not None:
            raise error
    usage = event.get("usage")
    finished = False
    for choice in event.get("choices", ()):
        if choice.get("finish_reason") is not None:
            finished = True
    return event, (usage.get("total_tokens", 0) if usage is not None else None), finished


def _bad_event(data: bytes, api_key: str | None, request_id: str | None) -> ProviderError:
    """The error of a payload the schema rejected: the error it reports, else malformed."""
    try:
        payload: Any = from_json(data)
    except ValueError:
        return malformed("a stream event is not JSON", data, request_id=request_id)
    if isinstance(payload, dict) and "error" in payload:
        # vLLM and OpenAI report mid-stream failures as an `{"error": ...}` event.
        status = status_in(payload["error"])
        return error_from_payload(status, payload, data, request_id=request_id, api_key=api_key)
    return malformed("a stream event does not match the schema", data)
