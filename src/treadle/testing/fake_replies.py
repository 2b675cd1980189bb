"""Replies and scripts for `FakeOpenAIServer`: what the fake model answers, and how it misbehaves.

A `Reply` describes one answer (text, tool calls, usage, latency) or one fault (an HTTP error, a
torn stream, invalid JSON, a dropped connection...). A script is a function of the request body
(a dict) returning a `Reply`; the built-in ones (`echo`, `file_worker`, `tool_loop`) are stateless
so thousands of concurrent sessions can share one server. `render_completion` and
`render_stream` turn a reply into OpenAI's exact wire format. Pure: no I/O here.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic_core import from_json, to_json

__all__ = [
    "SCRIPTS",
    "Reply",
    "Script",
    "ToolCallSpec",
    "echo",
    "file_worker",
    "get_script",
    "render_completion",
    "render_stream",
    "tool_loop",
    "usage_of",
]

_ids = itertools.count(1)


@dataclass(frozen=True, slots=True)
class ToolCallSpec:
    """One tool call the fake model makes: name, JSON arguments text, optional fixed id."""

    name: str
    arguments: str = "{}"
    id: str | None = None


def _args_text(arguments: Mapping[str, Any] | str | None) -> str:
    if arguments is None:
        return "{}"
    return arguments if isinstance(arguments, str) else to_json(arguments).decode()


@dataclass(frozen=True, slots=True)
class Reply:
    """One scripted answer or fault. Build with the class methods; adjust with the `with_*` ones."""

    content: str | None = None
    """Assistant text (None when the reply only calls tools)."""
    tool_calls: tuple[ToolCallSpec, ...] = ()
    """Tool calls, in order (several means parallel tool calls)."""
    finish_reason: str | None = None
    """Defaults to `"tool_calls"` when there are tool calls, else `"stop"`."""
    prompt_tokens: int | None = None
    """Reported prompt tokens; default: request body bytes / 4."""
    completion_tokens: int | None = None
    """Reported completion tokens; default: generated characters / 4."""
    message_extra: Mapping[str, Any] | None = None
    """Extra assistant-message fields, e.g. `{"reasoning_content": "..."}` (streamed as deltas)."""
    latency_ms: float | None = None
    """Delay before the first byte; None uses the server's latency."""
    status: int = 200
    """HTTP status; with `body`, the reply is sent verbatim."""
    headers: tuple[tuple[str, str], ...] = ()
    """Extra response headers (e.g. `Retry-After`)."""
    body: bytes | None = None
    """Raw response body sent as is (error bodies, invalid JSON, a recorded SSE stream)."""
    content_type: str = "application/json"
    """The `content-type` of a raw `body` (e.g. `text/event-stream` for a recorded stream)."""
    empty_choices: bool = False
    """Answer 200 with `"choices": []`."""
    tear_after: int | None = None
    """Drop the connection after this many stream events (non-stream: after half the body)."""
    stall_ms: float | None = None
    """Pause this long after the first stream event / first half of the body."""
    drop: bool = False
    """Close the connection without sending any response."""
    chunk_chars: int = 16
    """Characters of content or arguments per stream event."""

    # -- answers ---------------------------------------------------------------------------------

    @classmethod
    def text(cls, content: str, **fields: Any) -> Reply:
        """A final text answer."""
        return cls(content=content, **fields)

    @classmethod
    def tool_call(
        cls, name: str, arguments: Mapping[str, Any] | str | None = None, **fields: Any
    ) -> Reply:
        """A reply calling one tool with `arguments` (a dict, or JSON text sent verbatim)."""
        return cls(tool_calls=(ToolCallSpec(name, _args_text(arguments)),), **fields)

    @classmethod
    def tool_calls_of(
        cls, calls: Iterable[tuple[str, Mapping[str, Any] | str | None]], **fields: Any
    ) -> Reply:
        """A reply calling several tools in parallel: `[(name, arguments), ...]`."""
        specs = tuple(ToolCallSpec(name, _args_text(args)) for name, args in calls)
        return cls(tool_calls=specs, **fields)

    # -- faults ----------------------------------------------------------------------------------

    @classmethod
    def raw(
        cls,
        body: bytes,
        *,
        status: int = 200,
        content_type: str = "application/json",
        headers: Mapping[str, str] | None = None,
    ) -> Reply:
        """`body` sent byte for byte (a recorded reply: whole JSON, or an SSE stream)."""
        return cls(status=status, body=body, content_type=content_type,
                   headers=tuple((headers or {}).items()))  # fmt: skip

    @classmethod
    def error(
        cls,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Reply:
        """An HTTP error with an OpenAI error body `{"error": {message, type, param, code}}`."""
        body = to_json({"error": {"message": message, "type": type, "param": None, "code": code}})
        return cls(status=status, body=body, headers=tuple((headers or {}).items()))

    @classmethod
    def rate_limited(cls, retry_after: float = 0) -> Reply:
        """HTTP 429 with `Retry-After` seconds."""
        return cls.error(
            429,
            "Rate limit reached for requests. Please try again later.",
            type="requests",
            code="rate_limit_exceeded",
            headers={"retry-after": f"{retry_after:g}"},
        )

    @classmethod
    def server_error(cls, status: int = 500) -> Reply:
        """HTTP 500/502/503 with an error body."""
        return cls.error(
            status, "The server had an error while processing your request.", type="server_error"
        )

    @classmethod
    def unauthorized(cls) -> Reply:
        """HTTP 401, as for a wrong API key."""
        return cls.error(401, "Incorrect API key provided.", code="invalid_api_key")

    @classmethod
    def bad_request(cls, message: str = "Invalid request.") -> Reply:
        """HTTP 400 with an OpenAI error body (not retried)."""
        return cls.error(400, message)

    @classmethod
    def context_length_exceeded(
        cls, flavor: Literal["openai", "llamacpp", "vllm"] = "openai"
    ) -> Reply:
        """HTTP 400 saying the prompt does not fit, as OpenAI, llama.cpp or vLLM word it."""
        if flavor == "llamacpp":
            return cls.error(
                400,
                "the request exceeds the available context size, try increasing it",
                type="exceed_context_size_error",
            )
        if flavor == "vllm":
            return cls.error(
                400,
                "This model's maximum context length is 4096 tokens. However, you requested "
                "5000 tokens. Please reduce the length of the messages.",
                type="BadRequestError",
            )
        return cls.error(
            400,
            "This model's maximum context length is 128000 tokens. However, your messages "
            "resulted in 130000 tokens. Please reduce the length of the messages.",
            code="context_length_exceeded",
        )

    @classmethod
    def invalid_json(cls) -> Reply:
        """HTTP 200 whose body is not JSON."""
        return cls(body=b"<html>upstream went away</html>")

    @classmethod
    def no_choices(cls) -> Reply:
        """HTTP 200 with an empty `choices` list."""
        return cls(empty_choices=True)

    @classmethod
    def dropped_connection(cls) -> Reply:
        """Close the connection after reading the request, sending nothing."""
        return cls(drop=True)

    # -- modifiers -------------------------------------------------------------------------------

    def torn(self, after_events: int) -> Reply:
        """This reply, with the connection dropped after `after_events` stream events."""
        return dataclasses.replace(self, tear_after=after_events)

    def with_latency(self, ms: float) -> Reply:
        """This reply, sent after `ms` milliseconds (a slow first byte)."""
        return dataclasses.replace(self, latency_ms=ms)

    def stalled(self, ms: float) -> Reply:
        """This reply, pausing `ms` milliseconds mid-body (a read timeout after headers)."""
        return dataclasses.replace(self, stall_ms=ms)

    def with_usage(self, prompt_tokens: int, completion_tokens: int) -> Reply:
        """This reply, reporting these token counts."""
        return dataclasses.replace(
            self, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens
        )


Script = Callable[[dict[str, Any]], Reply]
"""A function of the request body (parsed JSON) returning the reply."""


# -- rendering -----------------------------------------------------------------------------------


def usage_of(reply: Reply, request_bytes: int) -> dict[str, int]:
    """The usage a reply reports for a request of `request_bytes` (its own counts when set)."""
    prompt = reply.prompt_tokens if reply.prompt_tokens is not None else request_bytes // 4 + 1
    if reply.completion_tokens is not None:
        completion = reply.completion_tokens
    else:
        chars = len(reply.content or "") + sum(
            len(c.name) + len(c.arguments) for c in reply.tool_calls
        )
        completion = chars // 4 + 1
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _call_ids(reply: Reply) -> list[str]:
    return [c.id or f"call_{next(_ids):08d}" for c in reply.tool_calls]


def _finish(reply: Reply) -> str:
    return reply.finish_reason or ("tool_calls" if reply.tool_calls else "stop")


def render_completion(
    reply: Reply, *, model: str, completion_id: str, created: int, request_bytes: int
) -> bytes:
    """The non-streamed JSON body for `reply` (OpenAI's `chat.completion` object)."""
    usage = usage_of(reply, request_bytes)
    if reply.empty_choices:
        choices: list[dict[str, Any]] = []
    else:
        message: dict[str, Any] = {"role": "assistant", "content": reply.content}
        if reply.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c, call_id in zip(reply.tool_calls, _call_ids(reply), strict=True)
            ]
        if reply.message_extra:
            message.update(reply.message_extra)
        message.setdefault("refusal", None)
        choices = [
            {"index": 0, "message": message, "logprobs": None, "finish_reason": _finish(reply)}
        ]
    return to_json(
        {
            "id": completion_id,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": choices,
            "usage": usage,
            "system_fingerprint": "fp_treadle",
        }
    )


def _pieces(text: str, size: int) -> list[str]:
    size = max(1, size)
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


def render_stream(
    reply: Reply,
    *,
    model: str,
    completion_id: str,
    created: int,
    request_bytes: int,
    include_usage: bool,
) -> list[bytes]:
    """The SSE events (`data: ...\\n\\n` each, `[DONE]` last) streaming `reply`."""
    base: dict[str, Any] = {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": "fp_treadle",
    }
    if include_usage:
        base["usage"] = None
    deltas: list[dict[str, Any]] = []
    if reply.empty_choices:
        events: list[dict[str, Any]] = [{**base, "choices": []}]
    else:
        first: dict[str, Any] = {"role": "assistant", "content": None, "refusal": None}
        deltas.append(first)
        for key, value in (reply.message_extra or {}).items():
            if isinstance(value, str):
                deltas.extend({key: piece} for piece in _pieces(value, reply.chunk_chars))
            else:
                deltas.append({key: value})
        if reply.content is not None:
            first["content"] = ""
            deltas.extend({"content": p} for p in _pieces(reply.content, reply.chunk_chars))
        for index, (call, call_id) in enumerate(
            zip(reply.tool_calls, _call_ids(reply), strict=True)
        ):
            deltas.append(
                {
                    "tool_calls": [
                        {
                            "index": index,
                            "id": call_id,
                            "type": "function",
                            "function": {"name": call.name, "arguments": ""},
                        }
                    ]
                }
            )
            deltas.extend(
                {"tool_calls": [{"index": index, "function": {"arguments": piece}}]}
                for piece in _pieces(call.arguments, reply.chunk_chars)
            )
        events = [
            {**base, "choices": [{"index": 0, "delta": d, "logprobs": None, "finish_reason": None}]}
            for d in deltas
        ]
        events.append(
            {
                **base,
                "choices": [
                    {"index": 0, "delta": {}, "logprobs": None, "finish_reason": _finish(reply)}
                ],
            }
        )
    if include_usage:
        events.append({**base, "choices": [], "usage": usage_of(reply, request_bytes)})
    out = [b"data: " + to_json(e) + b"\n\n" for e in events]
    out.append(b"data: [DONE]\n\n")
    return out


# -- built-in scripts ----------------------------------------------------------------------------


def _messages(request: Mapping[str, Any]) -> list[dict[str, Any]]:
    messages = request.get("messages")
    return [m for m in messages if isinstance(m, dict)] if isinstance(messages, list) else []


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def echo(request: dict[str, Any]) -> Reply:
    """Answers with the text of the last user message."""
    for message in reversed(_messages(request)):
        if message.get("role") == "user":
            return Reply.text(_text_of(message.get("content")))
    return Reply.text("")


def _answered_tool(messages: list[dict[str, Any]], tool_message: dict[str, Any]) -> str:
    """The name of the tool a tool message answers (its `name`, or the matching call's)."""
    name = tool_message.get("name")
    if isinstance(name, str) and name:
        return name
    call_id = tool_message.get("tool_call_id")
    for message in reversed(messages):
        for call in message.get("tool_calls") or ():
            if isinstance(call, dict) and call.get("id") == call_id:
                return str((call.get("function") or {}).get("name", ""))
    return ""


def file_worker(request: dict[str, Any]) -> Reply:
    """Writes `notes.txt`, reads it back with `cat`, then answers quoting the shell's stdout.

    Stateless: decides from the request's messages alone.
    """
    messages = _messages(request)
    tool_messages = [m for m in messages if m.get("role") == "tool"]
    if not tool_messages:
        return Reply.tool_call(
            "write_workspace_file", {"path": "notes.txt", "content": "hello from treadle\n"}
        )
    last = tool_messages[-1]
    if _answered_tool(messages, last) == "write_workspace_file":
        return Reply.tool_call("run_shell_command", {"cmd": "cat notes.txt"})
    text = _text_of(last.get("content"))
    try:
        result = from_json(text)
        stdout = str(result.get("stdout", "")) if isinstance(result, dict) else text
    except ValueError:
        stdout = text
    return Reply.text(f"notes.txt contains: {stdout.strip()}")


def tool_loop(rounds: int = 3, tool_name: str = "noop") -> Script:
    """A script calling `tool_name` `rounds` times (one call per reply), then answering."""

    def script(request: dict[str, Any]) -> Reply:
        done = sum(1 for m in _messages(request) if m.get("role") == "tool")
        if done < rounds:
            return Reply.tool_call(tool_name, {"round": done + 1})
        return Reply.text(f"finished after {done} tool rounds")

    return script


SCRIPTS: dict[str, Callable[..., Any]] = {
    "echo": echo,
    "file_worker": file_worker,
    "tool_loop": tool_loop,
}
"""Built-in scripts by name (`tool_loop` is a factory taking `rounds`)."""


def get_script(name: str, *, rounds: int = 3) -> Script:
    """The built-in script called `name` (`echo`, `file_worker`, `tool_loop`)."""
    if name == "tool_loop":
        return tool_loop(rounds)
    if name not in SCRIPTS:
        raise ValueError(f"Unknown script {name!r}; choose one of {sorted(SCRIPTS)}.")
    script: Script = SCRIPTS[name]
    return script
