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
        # The validator itself: `model_validate_json` adds keyword passing (about 3 µs) per event.
        chunk: ChatCompletionChunk = ChatCompletionChunk.__pydantic_validator__.validate_json(data)
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
    """`(event, usage total or None, finished)` of one payload, as a validated dict.

    An event that already has the schema's exact types (what real servers send) is taken as
    parsed (`_scan`, a few type checks against a validator run per event, which also finds the
    finish reason); any other one goes through the schema, which coerces or rejects it as before.
    """
    try:
        parsed = from_json(data)
    except ValueError:
        parsed = None
    scanned = _scan(parsed) if type(parsed) is dict else None
    if scanned is None:  # not exact: the validator coerces or rejects it
        try:
            event: Any = _EVENT.validate_json(data)
        except ValidationError as exc:
            raise _bad_event(data, api_key, request_id) from exc
        finished = any(c.get("finish_reason") is not None for c in event.get("choices", ()))
    else:
        event, finished = parsed, scanned
    if "error" in event:
        error = error_in(event, request_id=event.get("id") or request_id, api_key=api_key)
        if error is not None:
            raise error
    usage = event.get("usage")
    return event, (usage.get("total_tokens", 0) if usage is not None else None), finished


_STR, _INT, _DICT, _LIST, _NONE = str, int, dict, list, type(None)


def _scan(event: dict[str, Any]) -> bool | None:
    """Whether `event` reports a finish reason; None when it is not exact (needs the validator).

    Exact means every field the schema types has its exact type (what the validator would pass
    unchanged); fields the schema leaves open (extra ones) are kept either way. `bool` is not an
    `int` here (the validator would refuse it), hence `type(...) is`, not `isinstance`. One pass
    over the event, with local lookups: this runs for every event of every streamed reply.
    """
    get = event.get
    if (
        type(get("id", "")) is not _STR
        or type(get("object", "")) is not _STR
        or type(get("created", 0)) is not _INT
        or type(get("model", "")) is not _STR
    ):
        return None
    usage = get("usage")
    if usage is not None and (
        type(usage) is not _DICT
        or any(type(v) is not _INT for k, v in usage.items() if k in _USAGE_INTS)
    ):
        return None
    choices = get("choices", ())
    if type(choices) is not _LIST:
        return False if choices == () else None
    finished = False
    for choice in choices:
        if type(choice) is not _DICT:
            return None
        cget = choice.get
        delta = cget("delta", _NO_DELTA)
        if type(cget("index", 0)) is not _INT or type(delta) is not _DICT:
            return None
        reason = cget("finish_reason")
        if reason is not None:
            if type(reason) is not _STR:
                return None
            finished = True
        if delta:
            role = delta.get("role")
            content = delta.get("content")
            if (role is not None and type(role) is not _STR) or (
                content is not None
                and type(content) is not _STR
                and (type(content) is not _LIST or any(type(p) is not _DICT for p in content))
            ):
                return None
            calls = delta.get("tool_calls")
            if calls is not None and not _exact_calls(calls):
                return None
    return finished


_NO_DELTA: dict[str, Any] = {}
_USAGE_INTS = frozenset({"prompt_tokens", "completion_tokens", "total_tokens"})
_NULLABLE_TEXT = (str, type(None))


def _exact_calls(calls: Any) -> bool:
    """True when a delta's `tool_calls` need no coercion (see `_scan`)."""
    if type(calls) is not list:
        return False
    for call in calls:
        if type(call) is not dict:
            return False
        index = call.get("index")
        if index is not None and type(index) is not int:
            return False
        if (
            type(call.get("id")) not in _NULLABLE_TEXT
            or type(call.get("type")) not in _NULLABLE_TEXT
        ):
            return False
        fn = call.get("function")
        if fn is not None and (
            type(fn) is not dict
            or type(fn.get("name")) not in _NULLABLE_TEXT
            or type(fn.get("arguments")) not in _NULLABLE_TEXT
        ):
            return False
    return True


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
