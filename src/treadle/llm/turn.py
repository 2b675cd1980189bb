"""One model turn: the executor protocols, the HTTP executor, and `request_turn`.

`request_turn` is the whole seam between the pass and the wire: the loop hands over a
`CompletionRequest` and gets back a finished `AssistantTurn` (the assistant row's payload, the
usage and the finish reason). Streaming is accumulated here, and the loop sees typed
`TurnDelta`s (text and tool-call pieces) as they arrive; a whole reply gives one delta, so
callbacks see the same shape either way. Wire types never leave this package except as the opaque
`raw` chunk handed to `on_event` and the `completion` a guardrail may inspect.

Executors: `HttpExecutor` (the default) posts the body through the pooled client; custom
executors (tests, other transports) implement `acomplete` (async) or `complete` (sync, run in a
worker thread). An executor may also run tools itself (`treadle.tools.ToolExecutor`); that side
of the protocol belongs to the tools layer. Nothing here blocks the loop.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import weakref
from collections.abc import AsyncGenerator, Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, cast, runtime_checkable

import anyio
from pydantic import ValidationError

from treadle.errors import ConfigurationError, MalformedResponse, ProviderError
from treadle.llm.accumulate import StreamAccumulator
from treadle.llm.assistant import AssistantTurn as AssistantTurn
from treadle.llm.assistant import folded_turn
from treadle.llm.assistant import turn_of as turn_of
from treadle.llm.attempt import TornStream, Tries
from treadle.llm.deltas import (
    DeltaSink,
    PieceSink,
    ToolCallPiece,
    TurnDelta,
    as_chunk,
    delta_of,
    pieces_of,
    with_pieces,
)
from treadle.llm.inband import error_in, with_status_from_body
from treadle.llm.provider import Provider
from treadle.llm.request import CompletionRequest
from treadle.llm.retry import backoff_delay
from treadle.llm.wire import ChatCompletion, ChatCompletionChunk
from treadle.runtime.threads import run_user_code
from treadle.telemetry import current_pass

if TYPE_CHECKING:
    from treadle.llm.chunk_parse import parse_chunk, parse_event
    from treadle.llm.client import get_client
else:
    # httpx and the chunk schema load with the first request, not with `treadle`; a name bound
    # here is replaced by the real function on its first call. (An import statement inside the
    # functions cost about 2 µs a call: `from a.b import c` looks for `a.b.__path__`, and a
    # module without one formats an AttributeError message every time.) As loop/first_call.py
    # does, the name is bound only to the function defined in `home`: a patch in place at the
    # first call (a test's monkeypatch) gets that call, and the next call looks again.

    def _on_first_call(module: str, name: str, home: str = "") -> Callable[..., Any]:
        def first_call(*args: Any, **kwargs: Any) -> Any:
            real = getattr(importlib.import_module(module), name)
            if getattr(real, "__module__", None) == (home or module):  # not a patch: keep it
                globals()[name] = real
            return real(*args, **kwargs)

        first_call.__name__ = first_call.__qualname__ = name
        return first_call

    # Looked up where the request path always found it; defined in the registry module.
    get_client = _on_first_call("treadle.llm.client", "get_client", "treadle.llm.registry")
    parse_chunk = _on_first_call("treadle.llm.chunk_parse", "parse_chunk")
    parse_event = _on_first_call("treadle.llm.chunk_parse", "parse_event")

__all__ = [
    "AssistantTurn",
    "AsyncExecutor",
    "Executor",
    "HttpExecutor",
    "ModelExecutor",
    "ToolCallPiece",
    "TurnDelta",
    "call_complete",
    "coerce_completion",
    "request_turn",
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


log = logging.getLogger("treadle.llm")

ModelExecutor: TypeAlias = Executor | AsyncExecutor
"""Anything a pass can ask for completions."""


class HttpExecutor:
    """The default executor: OpenAI-compatible chat completions over the pooled HTTP client."""

    async def acomplete(self, request: CompletionRequest) -> ChatCompletion:
        """Send the request and return the whole completion."""
        provider = _require_provider(request)
        try:
            return await get_client(provider).complete(provider, request.body())
        except RuntimeError as err:
            _raise_if_foreign_loop(provider, err)
            raise

    async def astream(self, request: CompletionRequest) -> AsyncGenerator[ChatCompletionChunk]:
        """Send the request with `stream: true` and yield chunks as they arrive."""
        provider = _require_provider(request)
        try:
            async for chunk in get_client(provider).stream(provider, request.body()):
                yield chunk
        except RuntimeError as err:
            _raise_if_foreign_loop(provider, err)
            raise


_HTTP_ACOMPLETE = HttpExecutor.acomplete


def _raise_if_foreign_loop(provider: Provider, err: RuntimeError) -> None:
    """A user's `httpx.AsyncClient` bound to another event loop, as a `ConfigurationError`.

    httpx pools connections per event loop; a client that already ran on the caller's loop
    cannot serve a lazy pass, which runs on Treadle's runtime loop. Other errors pass through.
    """
    text = str(err).lower()
    if provider.http_client is None or not ("event loop" in text or "different loop" in text):
        return
    raise ConfigurationError(
        "Provider(http_client=...) was used on another event loop and cannot serve this pass "
        f"({err}). Lazy passes run on Treadle's runtime loop: leave http_client unset (set "
        "timeouts on the Provider), or create the httpx.AsyncClient inside your coroutine and "
        "run the pass there with `await arun_session_loop(...)`."
    ) from err


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


_ASYNC: weakref.WeakKeyDictionary[type, bool] = weakref.WeakKeyDictionary()


def _is_async_executor(cls: type) -> bool:
    """Whether `cls` is an `AsyncExecutor` (a protocol check is slow: once per class)."""
    known = _ASYNC.get(cls)
    if known is None:
        known = _ASYNC[cls] = issubclass(cls, AsyncExecutor)
    return known


async def call_complete(executor: ModelExecutor, request: CompletionRequest) -> ChatCompletion:
    """Ask `executor` for a completion and validate it."""
    raw: object
    if _is_async_executor(type(executor)):
        raw = await cast(AsyncExecutor, executor).acomplete(request)
    else:
        raw = await run_user_code(cast(Executor, executor).complete, request)
    if not isinstance(raw, ChatCompletion) and inspect.isawaitable(raw):  # an ABC check: slow
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


async def request_turn(
    executor: ModelExecutor,
    request: CompletionRequest,
    on_delta: DeltaSink | None = None,
    *,
    on_pieces: PieceSink | None = None,
) -> AssistantTurn:
    """Ask `executor` for one turn; hand each delta to `on_delta` as it arrives.

    An error the provider reports inside a 200 reply (an `event: error`, a chunk carrying
    `error`, a whole `{"error": ...}` body) raises the typed `ProviderError` its status would
    have given. Retries happen in one place, Treadle's client (`ModelClient`), per request: a
    failed status, a lost connection, an in-band error before any event was handed on. The one
    restart here is of a stream torn after its first events went out (a lost connection, a read
    timeout, an in-band 429 or 5xx mid-stream): the turn is asked for again with the same retry
    budget, so a turn sends at most `Provider.max_retries + 1` requests and `on_delta` may see
    the beginning of a turn twice. A custom executor's reply is never retried here: it owns its
    transport (its errors are typed by the status they name, once).

    `on_pieces` gets each delta's text and tool-call pieces without its `raw` chunk (a pass's
    events need no more): Treadle's own stream then builds no typed chunk per event.
    """
    provider = request.provider
    tries = Tries()
    # Only Treadle's own stream is restarted: a custom executor (or a subclass's own astream)
    # is called once, whatever it raises, even the internal TornStream.
    own_stream = (
        request.stream
        and isinstance(executor, HttpExecutor)
        and type(executor).astream is HttpExecutor.astream
    )
    while True:
        try:
            return await _turn(executor, request, on_delta, tries, on_pieces)
        except TornStream as torn:
            error = torn.error
            if not own_stream:
                raise error from torn.__cause__
            if provider is None or not torn.retryable or tries.spent >= provider.max_retries:
                # "after N retries", as the request loop's final errors say
                raise torn.final(tries.spent) from torn.__cause__
            delay = backoff_delay(tries.spent, provider.retry_base_delay)
            log.info("restarting the turn (%s) in %.2fs, attempt %d/%d", error, delay,
                     tries.spent + 1, provider.max_retries)  # fmt: skip
            trace = current_pass()
            if trace is not None:
                trace.note_retry(tries.spent + 1, str(error), delay)
        await anyio.sleep(delay)
        tries.spent += 1


async def _turn(
    executor: ModelExecutor,
    request: CompletionRequest,
    on_delta: DeltaSink | None,
    tries: Tries,
    on_pieces: PieceSink | None = None,
) -> AssistantTurn:
    api_key = request.provider.api_key if request.provider is not None else None
    own_stream = (
        isinstance(executor, HttpExecutor) and type(executor).astream is HttpExecutor.astream
    )
    if request.stream and own_stream:  # not a subclass's own astream
        acc = await _fold_stream(request, on_delta, tries, on_pieces)
        return folded_turn(acc, tries.request_id)
    on_delta = with_pieces(on_delta, on_pieces)
    if request.stream and isinstance(executor, HttpExecutor):
        acc = StreamAccumulator()
        async with contextlib.aclosing(executor.astream(request)) as chunks:
            async for chunk in chunks:
                error = error_in(chunk.model_extra, request_id=chunk.id or None, api_key=api_key)
                if error is not None:
                    raise error  # closing the stream releases its connection
                acc.add(chunk)
                if on_delta is not None:
                    on_delta(delta_of(chunk))
        completion = acc.result()
    else:
        if isinstance(executor, HttpExecutor) and type(executor).acomplete is _HTTP_ACOMPLETE:
            completion = await _complete(request, tries)  # keeps the reply's request id
        else:
            try:
                completion = await call_complete(executor, request)
            except ProviderError as err:
                retyped = with_status_from_body(err, api_key)
                if retyped is err:
                    raise
                raise retyped from None
        error = error_in(completion.model_extra, request_id=completion.id or None, api_key=api_key)
        if error is not None:
            raise error
        if on_delta is not None:
            on_delta(delta_of(as_chunk(completion)))
    return turn_of(completion, tries.request_id)


async def _complete(request: CompletionRequest, tries: Tries) -> ChatCompletion:
    """`HttpExecutor.acomplete`, noting the retries and the request id in `tries`."""
    provider = _require_provider(request)
    try:
        return await get_client(provider).complete(provider, request.body(), tries)
    except RuntimeError as err:
        _raise_if_foreign_loop(provider, err)
        raise


async def _fold_stream(
    request: CompletionRequest,
    on_delta: DeltaSink | None,
    tries: Tries,
    on_pieces: PieceSink | None = None,
) -> StreamAccumulator:
    """A streamed reply from the pooled client, folded.

    The fast form of the streamed branch of `_turn` (same errors and deltas), reading the events
    of each network read at once. Without a callback to feed the events stay dicts checked
    against the chunk schema (no `ChatCompletionChunk` per event); the whole is validated at the
    end either way. `on_pieces` alone keeps the dicts too: its pieces are read from them after
    the fold numbered their tool calls. In-band errors are raised by the client's parser; a
    stream torn after its first events raises `TornStream` for `request_turn` to restart.
    `folded_turn` makes the turn: no `ChatCompletion` unless someone reads it.
    """
    provider = _require_provider(request)
    acc = StreamAccumulator()
    try:
        client = tries.client  # a restart: the first attempt's client, even if closed since
        if client is None:
            client = tries.client = get_client(provider)
        if on_delta is None:
            events = client.stream_batches(provider, request.body(), parse_event, tries)
            async with contextlib.aclosing(events):
                async for batch in events:
                    for event in batch:
                        acc.add_event(event)
                        if on_pieces is not None:
                            on_pieces(*pieces_of(event))
        else:
            sink = with_pieces(on_delta, on_pieces) or on_delta
            chunks = client.stream_batches(provider, request.body(), parse_chunk, tries)
            async with contextlib.aclosing(chunks):
                async for typed in chunks:
                    for chunk in typed:
                        acc.add(chunk)
                        sink(delta_of(chunk))
    except RuntimeError as err:
        _raise_if_foreign_loop(provider, err)
        raise
    return acc
