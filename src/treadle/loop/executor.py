"""The executor protocol: how a pass asks for a completion (and, optionally, runs a tool).

`HttpExecutor` is the default: it sends the request body, built by joining each row's cached JSON,
to the provider's endpoint through the pooled client. Custom executors (tests, other transports)
implement `acomplete` (async) or `complete` (sync, run in a worker thread), and may implement
`adispatch_tool` / `dispatch_tool` to run tools their own way. Nothing here blocks the loop.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import anyio.to_thread
from pydantic import ValidationError

from treadle.errors import ConfigurationError, MalformedResponse
from treadle.llm.provider import Provider
from treadle.llm.wire import (
    ChatCompletion,
    ChatCompletionChunk,
    ChoiceDelta,
    ChunkChoice,
    FunctionCallDelta,
    ToolCallDelta,
    build_request_body,
)
from treadle.session import ChunkRow, Usage

if TYPE_CHECKING:
    from treadle.session import Session
    from treadle.tools import Tool, ToolSet

__all__ = [
    "AsyncExecutor",
    "CompletionRequest",
    "Executor",
    "HttpExecutor",
    "completion_to_delta",
    "parse_completion",
]


@dataclass(slots=True)
class CompletionRequest:
    """One completion a pass asks for: the provider, the rows to send and the tools offered."""

    session_id: str
    """Id of the output session being produced."""
    provider: Provider | None
    """The endpoint and its options (None for executors that need none)."""
    agent_rows: Sequence[ChunkRow]
    """The agent session's rows (system prompt), sent first."""
    rows: Sequence[ChunkRow]
    """The transcript so far (user rows, then the pass's rows)."""
    tools: ToolSet
    """The tools offered to the model this round."""
    stream: bool = False
    """Whether the pass wants the reply streamed."""
    messages_json: Sequence[bytes] = field(default_factory=tuple)
    """Each message of `agent_rows + rows`, already JSON-encoded (the hot path joins these)."""
    extra: Mapping[str, Any] | None = None
    """Request fields that override the provider's for this request only (e.g. tool_choice)."""

    def messages(self) -> list[dict[str, Any]]:
        """The messages as plain OpenAI dicts (agent rows first)."""
        return [row.to_message() for row in (*self.agent_rows, *self.rows)]

    def tool_schemas(self) -> list[dict[str, Any]]:
        """The OpenAI tool schemas offered."""
        return [self.tools[name].schema() for name in self.tools.names]

    def body(self) -> bytes:
        """The JSON request body, joined from cached row encodings."""
        if self.provider is None:
            raise ConfigurationError("this request has no provider; pass agent_provider=...")
        messages = self.messages_json or [r.message_json() for r in (*self.agent_rows, *self.rows)]
        return build_request_body(
            self.provider, messages, self.tools.schemas_json(), stream=self.stream, extra=self.extra
        )


@runtime_checkable
class Executor(Protocol):
    """A synchronous executor: `complete` runs in a worker thread, off the event loop.

    It may also define `dispatch_tool(session, tool, arguments) -> result` to run tools itself.
    """

    def complete(self, request: CompletionRequest) -> ChatCompletion | Mapping[str, Any]:
        """Return a chat completion (a `ChatCompletion` or an OpenAI-shaped dict)."""
        ...


@runtime_checkable
class AsyncExecutor(Protocol):
    """An asynchronous executor, awaited on the runtime loop (must not block it).

    It may also define `async adispatch_tool(session, tool, arguments) -> result`.
    """

    async def acomplete(self, request: CompletionRequest) -> ChatCompletion | Mapping[str, Any]:
        """Return a chat completion (a `ChatCompletion` or an OpenAI-shaped dict)."""
        ...


class HttpExecutor:
    """The default executor: OpenAI-compatible chat completions over the pooled HTTP client."""

    async def acomplete(self, request: CompletionRequest) -> ChatCompletion:
        """Send the request and return the whole completion."""
        from treadle.llm.client import get_client  # httpx loads with the first request

        provider = _require_provider(request)
        return await get_client(provider).complete(provider, request.body())

    async def astream(self, request: CompletionRequest) -> AsyncIterator[ChatCompletionChunk]:
        """Send the request with `stream: true` and yield chunks as they arrive."""
        from treadle.llm.client import get_client

        provider = _require_provider(request)
        async for chunk in get_client(provider).stream(provider, request.body()):
            yield chunk


def _require_provider(request: CompletionRequest) -> Provider:
    if request.provider is None:
        raise ConfigurationError("run_session_loop needs agent_provider=Provider(model=...).")
    return request.provider


def validate_executor(executor: object) -> None:
    """Raise `ConfigurationError` unless `executor` has `acomplete` or `complete`."""
    if not (
        callable(getattr(executor, "acomplete", None))
        or callable(getattr(executor, "complete", None))
    ):
        raise ConfigurationError(
            f"executor {type(executor).__name__} has neither acomplete(request) nor "
            "complete(request); implement one of them."
        )


async def call_complete(executor: object, request: CompletionRequest) -> ChatCompletion:
    """Ask `executor` for a completion and validate it."""
    acomplete = getattr(executor, "acomplete", None)
    if acomplete is not None:
        raw = await acomplete(request)
    else:
        complete = executor.complete  # type: ignore[attr-defined]
        raw = await anyio.to_thread.run_sync(complete, request)
    if inspect.isawaitable(raw):
        raw = await raw
    return coerce_completion(raw)


def coerce_completion(raw: object) -> ChatCompletion:
    """A validated `ChatCompletion` from what an executor returned."""
    if isinstance(raw, ChatCompletion):
        completion = raw
    elif isinstance(raw, Mapping):
        try:
            completion = ChatCompletion.model_validate(raw)
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise MalformedResponse(
                f"the completion is malformed at '{where}': {first['msg']}"
            ) from None
    else:
        raise MalformedResponse(
            f"the executor returned a {type(raw).__name__}, not a chat completion."
        )
    if not completion.choices:
        raise MalformedResponse("the completion has no choices; the server sent an empty reply.")
    return completion


def parse_completion(completion: ChatCompletion) -> tuple[dict[str, Any], Usage]:
    """The assistant row payload and the usage of one completion."""
    message = completion.message
    payload: dict[str, Any] = {"content": message.content}
    if message.tool_calls:
        payload["tool_calls"] = [
            {
                "id": call.id,
                "type": call.type or "function",
                "function": {"name": call.function.name, "arguments": call.function.arguments},
            }
            for call in message.tool_calls
        ]
    extra = message.model_extra
    if extra:
        # Keep provider fields such as reasoning_content; `role` is implied by the row kind.
        for key, value in extra.items():
            if key != "role" and value is not None:
                payload[key] = value
    usage = completion.usage
    return payload, Usage.from_wire(usage.model_dump() if usage is not None else None)


def completion_to_delta(completion: ChatCompletion) -> ChatCompletionChunk:
    """A whole completion as one stream chunk, so callbacks see the same shape either way."""
    message = completion.message
    calls = None
    if message.tool_calls:
        calls = [
            ToolCallDelta(
                index=i,
                id=call.id,
                type=call.type,
                function=FunctionCallDelta(
                    name=call.function.name, arguments=call.function.arguments
                ),
            )
            for i, call in enumerate(message.tool_calls)
        ]
    delta = ChoiceDelta(role="assistant", content=message.content, tool_calls=calls)
    return ChatCompletionChunk(
        id=completion.id,
        created=completion.created,
        model=completion.model,
        choices=[ChunkChoice(index=0, delta=delta, finish_reason=completion.finish_reason)],
        usage=completion.usage,
    )


def has_custom_dispatch(executor: object) -> bool:
    """True when `executor` runs tools itself."""
    return callable(getattr(executor, "adispatch_tool", None)) or callable(
        getattr(executor, "dispatch_tool", None)
    )


async def call_dispatch(executor: object, session: Session, tool: Tool, arguments: Any) -> Any:
    """Run one tool call through the executor's own dispatch."""
    adispatch = getattr(executor, "adispatch_tool", None)
    if adispatch is not None:
        return await adispatch(session, tool, arguments)
    dispatch = executor.dispatch_tool  # type: ignore[attr-defined]
    return await anyio.to_thread.run_sync(dispatch, session, tool, arguments)
