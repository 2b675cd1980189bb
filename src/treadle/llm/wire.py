"""Pydantic v2 wire types of the OpenAI chat-completions API, and the request-body builder.

Servers add fields (`reasoning_content`, `system_fingerprint`, `timings`, ...): every model keeps
unknown fields (`extra="allow"`) rather than rejecting them. `build_request_body` is on the hot
path of every round: it joins already-encoded message bytes and must never re-encode them, and
never uses the stdlib `json` module (pydantic-core is 3-4x faster).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import Field
from pydantic_core import to_json

from treadle.llm.provider import RESERVED_BODY_KEYS, Provider
from treadle.session.deferred import DeferredModel
from treadle.session.rows import text_of_content

__all__ = [
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ChatMessage",
    "Choice",
    "ChoiceDelta",
    "ChoiceDeltaToolCall",
    "ChunkChoice",
    "CompletionUsage",
    "FunctionCall",
    "FunctionCallDelta",
    "MessageToolCall",
    "build_request_body",
]


class _Wire(DeferredModel):
    # Unknown provider fields are kept; schemas build on first use, not at import.
    pass


class FunctionCall(_Wire):
    """The function a tool call invokes: its name and its arguments as JSON text."""

    name: str
    arguments: str = ""


class MessageToolCall(_Wire):
    """One tool call in an assistant message."""

    id: str
    type: str = "function"
    function: FunctionCall


class ChatMessage(_Wire):
    """The assistant message of a choice (content and/or tool calls; extra fields kept).

    `content` is text, or a list of typed parts (Mistral's Magistral sends thinking and text
    parts); `content_text` is the text either way.
    """

    role: str = "assistant"
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[MessageToolCall] | None = None

    @property
    def content_text(self) -> str | None:
        """The message text: `content`, or the joined text parts of a parts list."""
        return text_of_content(self.content)


class Choice(_Wire):
    """One choice of a non-streamed completion."""

    index: int = 0
    message: ChatMessage
    finish_reason: str | None = None


class CompletionUsage(_Wire):
    """Token counts the server reports for one completion."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    @property
    def cached_tokens(self) -> int:
        """`prompt_tokens_details.cached_tokens` when the server sent it, else 0."""
        return _detail(self.model_extra, "prompt_tokens_details", "cached_tokens")

    @property
    def reasoning_tokens(self) -> int:
        """`completion_tokens_details.reasoning_tokens` when the server sent it, else 0."""
        return _detail(self.model_extra, "completion_tokens_details", "reasoning_tokens")


def _detail(extra: dict[str, Any] | None, group: str, key: str) -> int:
    details = extra.get(group) if extra else None
    value = details.get(key) if isinstance(details, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


class ChatCompletion(_Wire):
    """A whole (non-streamed, or accumulated) chat completion."""

    id: str = ""
    object: str = "chat.completion"
    created: int = 0
    model: str = ""
    choices: list[Choice]
    usage: CompletionUsage | None = None

    @property
    def message(self) -> ChatMessage:
        """The first choice's message (Treadle asks for one choice)."""
        return self.choices[0].message

    @property
    def finish_reason(self) -> str | None:
        """The first choice's finish reason."""
        return self.choices[0].finish_reason


class FunctionCallDelta(_Wire):
    """A piece of a streamed function call (name usually once, arguments in pieces)."""

    name: str | None = None
    arguments: str | None = None


class ChoiceDeltaToolCall(_Wire):
    """A piece of a streamed tool call; pieces with the same `index` belong together.

    Some compatible servers omit `index`; the accumulator then tells calls apart by `id`.
    """

    index: int | None = None
    id: str | None = None
    type: str | None = None
    function: FunctionCallDelta | None = None


class ChoiceDelta(_Wire):
    """The change a stream chunk brings to one choice's message."""

    role: str | None = None
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ChoiceDeltaToolCall] | None = None


class ChunkChoice(_Wire):
    """One choice of a stream chunk."""

    index: int = 0
    delta: ChoiceDelta = Field(default_factory=ChoiceDelta)
    finish_reason: str | None = None


class ChatCompletionChunk(_Wire):
    """One `data:` event of a streamed completion (the usage chunk has `choices == []`)."""

    id: str = ""
    object: str = "chat.completion.chunk"
    created: int = 0
    model: str = ""
    choices: list[ChunkChoice] = Field(default_factory=list)
    usage: CompletionUsage | None = None


class ChatCompletionRequest(_Wire):
    """A request body, for servers and tests that read what clients send."""

    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None


_RESERVED = RESERVED_BODY_KEYS
_STREAM_TAIL = b',"stream":true,"stream_options":{"include_usage":true}}'
_STREAM_TAIL_CUSTOM_OPTIONS = b',"stream":true}'
_NO_STREAM_TAIL = b',"stream":false}'


def build_request_body(
    provider: Provider,
    messages: Sequence[bytes],
    tools: bytes | None = None,
    *,
    stream: bool,
    extra: Mapping[str, Any] | None = None,
) -> bytes:
    """The JSON body of one chat-completions request, built by joining pre-encoded parts.

    `messages` are message objects each already encoded with `pydantic_core.to_json`; `tools` is
    an encoded JSON array. Model and sampling options come from `provider` (then its
    `extra_body`, then `extra`, later ones winning). Streaming asks for a final usage chunk.
    """
    head, keys = provider.body_head(with_tools=tools is not None)
    if extra:
        extra = {k: v for k, v in extra.items() if k not in _RESERVED}
        if keys.intersection(extra):
            # Rare: a per-call override of a provider option; re-encode the small options dict.
            opts = provider.sampling_options(with_tools=tools is not None)
            opts.update(extra)
            merged = {k: v for k, v in opts.items() if k not in _RESERVED}
            head, keys = to_json(merged)[:-1], frozenset(merged)
            extra = None
    parts = [head, b',"messages":[', b",".join(messages), b"]"]
    if tools is not None:
        parts.append(b',"tools":')
        parts.append(tools)
    if extra:
        parts.append(b",")
        parts.append(to_json(extra)[1:-1])
    if not stream:
        parts.append(_NO_STREAM_TAIL)
    elif "stream_options" in keys or (extra and "stream_options" in extra):
        parts.append(_STREAM_TAIL_CUSTOM_OPTIONS)
    else:
        parts.append(_STREAM_TAIL)
    return b"".join(parts)
