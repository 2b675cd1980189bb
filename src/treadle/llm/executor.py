"""The executor protocols: how a pass asks for a completion, and the default HTTP executor.

`HttpExecutor` sends the request body to the provider's endpoint through the pooled client.
Custom executors (tests, other transports) implement `acomplete` (async) or `complete` (sync, run
in a worker thread). An executor may also run tools itself (`treadle.tools.ToolExecutor`); that
side of the protocol belongs to the tools layer. Nothing here blocks the loop.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Mapping
from typing import Any, Protocol, TypeAlias, runtime_checkable

import anyio.to_thread
from pydantic import ValidationError

from treadle.errors import ConfigurationError, MalformedResponse
from treadle.llm.provider import Provider
from treadle.llm.request import CompletionRequest
from treadle.llm.wire import ChatCompletion, ChatCompletionChunk

__all__ = [
    "AsyncExecutor",
    "Executor",
    "HttpExecutor",
    "ModelExecutor",
    "call_complete",
    "coerce_completion",
    "validate_executor",
]


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


ModelExecutor: TypeAlias = Executor | AsyncExecutor
"""Anything a pass can ask for completions."""


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


def validate_executor(executor: object) -> ModelExecutor:
    """`executor` typed as a protocol; `ConfigurationError` unless it has `acomplete`/`complete`."""
    if isinstance(executor, AsyncExecutor) and callable(executor.acomplete):
        return executor
    if isinstance(executor, Executor) and callable(executor.complete):
        return executor
    raise ConfigurationError(
        f"executor {type(executor).__name__} has neither acomplete(request) nor "
        "complete(request); implement one of them."
    )


async def call_complete(executor: ModelExecutor, request: CompletionRequest) -> ChatCompletion:
    """Ask `executor` for a completion and validate it."""
    raw: object
    if isinstance(executor, AsyncExecutor):
        raw = await executor.acomplete(request)
    else:
        raw = await anyio.to_thread.run_sync(executor.complete, request)
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
