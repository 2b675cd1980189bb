"""Fan-out: run one agent over many sessions with a bounded number of passes in flight.

`local_amap` (async, the output sessions in input order) and `local_map_iter` (async iterator of
`(index, result)` as items complete) are the `"local"` backend of `treadle.map` / `treadle.amap` /
`treadle.map_iter`, the one public fan-out (the switch in `treadle.distributed.backends` also
runs passes on worker processes). `treadle.agents.map`, `amap` and `map_iter` are deprecated
aliases kept for old code: they warn and run the same local fan-out. Inputs are pulled from any
iterable or async iterable only as slots free up, so a million inputs are never materialised up
front. One item's failure never cancels the others: it is reported per item.

This module must never start more than `concurrency` runs at once, never reorder `map`'s results
and never block the event loop it runs on (sync input iterators are expected to be cheap).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, Literal, overload

import anyio
from typing_extensions import TypeVar, deprecated

from treadle.agents.progress import Progress, known_length, run_blocking, settle_results
from treadle.errors import ConfigurationError
from treadle.session import Session

__all__ = [
    "DEFAULT_CONCURRENCY",
    "MapTarget",
    "Progress",
    "amap",
    "local_amap",
    "local_map_iter",
    "map",
    "map_iter",
    "settle_results",
]

#: Runs in flight at once when `concurrency` is not given.
DEFAULT_CONCURRENCY = 64

Runner = Callable[[Any], Awaitable[Session]]

T = TypeVar("T", default=Any)

MapTarget = Callable[[Any], Session[T]] | Callable[[Any], Awaitable[Session[T]]]
"""What `map` runs: an `Agent[Deps, Output]` (output sessions typed `Session[Output | None]`),
a pipeline, or any sync or async callable from an item to a `Session`."""


def _runner(agent: Any) -> Runner:
    """An async `item -> Session` from an `Agent`, a pipeline, or any callable returning a
    session, an awaitable of one, or a lazy session."""
    run = getattr(agent, "run", None)
    if run is not None and inspect.iscoroutinefunction(run):
        return run  # type: ignore[no-any-return]
    if not callable(agent):
        raise ConfigurationError(f"map needs an Agent or a callable, got {type(agent).__name__}.")

    async def call(item: Any) -> Session:
        result = agent(item)
        if inspect.isawaitable(result):
            result = await result
        if isinstance(result, Session):
            await result.wait_ready()
        return result  # type: ignore[no-any-return]

    return call


def check_concurrency(concurrency: int) -> None:
    """Raise `ConfigurationError` unless `concurrency` is an int >= 1."""
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ConfigurationError(f"concurrency must be an int >= 1, got {concurrency!r}.")


def _check(concurrency: int, backend: str, options: dict[str, Any]) -> None:
    check_concurrency(concurrency)
    if backend != "local":
        raise ConfigurationError(
            f"treadle.agents runs every pass on this event loop (backend='local'); for "
            f"backend={backend!r} use treadle.map / treadle.amap / treadle.map_iter."
        )
    if options:
        raise ConfigurationError(
            f"{sorted(options)} apply to backend='process' or 'ray' only (see treadle.distributed)."
        )


async def _drive(
    run: Runner,
    items: Iterable[Any] | AsyncIterable[Any],
    concurrency: int,
    on_start: Callable[[int], None],
    on_result: Callable[[int, Any], None],
) -> None:
    """Pull items as slots free up, run each, report `(index, session or exception)`."""
    if isinstance(items, AsyncIterable):
        source: AsyncIterator[Any] | None = aiter(items)
        sync_source = None
    elif isinstance(items, Iterable) and not isinstance(items, (str, bytes, Session)):
        source = None
        sync_source = iter(items)
    else:
        raise ConfigurationError(
            f"map takes an iterable of sessions, got {type(items).__name__}; wrap one item in "
            "a list."
        )
    pull = asyncio.Lock()  # an async generator cannot be advanced by two workers at once
    counter = 0
    exhausted = False

    async def next_item() -> tuple[int, Any] | None:
        nonlocal counter, exhausted
        async with pull:
            if exhausted:
                return None
            try:
                item = await anext(source) if source is not None else next(sync_source)  # type: ignore[arg-type]
            except (StopIteration, StopAsyncIteration):
                exhausted = True
                return None
            index = counter
            counter += 1
            on_start(index)
            return index, item

    async def worker() -> None:
        while (pulled := await next_item()) is not None:
            index, item = pulled
            try:
                result: Any = await run(item)
            except Exception as err:  # an item's failure is its own; the others go on
                result = err
            on_result(index, result)

    async with anyio.create_task_group() as tg:
        for _ in range(concurrency):
            tg.start_soon(worker)


async def local_map_iter(
    agent: MapTarget[T],
    sessions: Iterable[Any] | AsyncIterable[Any],
    *,
    concurrency: int = DEFAULT_CONCURRENCY,
) -> AsyncIterator[tuple[int, Session[T] | BaseException]]:
    """Run `agent` over `sessions` on this event loop; yield `(index, output or exception)` as
    each ends. Leaving the loop early cancels the runs still in flight."""
    check_concurrency(concurrency)
    run = _runner(agent)

    async def drive(send: Callable[[tuple[int, Any]], None]) -> None:
        await _drive(run, sessions, concurrency, lambda _i: None, lambda i, r: send((i, r)))

    from treadle.runtime.streams import produce  # with the first fan-out, not the import

    async with produce(drive) as entries:
        async for entry in entries:
            yield entry
        entries.result()  # re-raises a failure of the input iterable itself


async def local_amap(
    agent: MapTarget[T],
    sessions: Iterable[Any] | AsyncIterable[Any],
    *,
    concurrency: int = DEFAULT_CONCURRENCY,
    progress: bool = False,
    return_exceptions: bool = False,
) -> list[Any]:
    """The output sessions in input order, every pass on this event loop (see `treadle.map`)."""
    check_concurrency(concurrency)
    run = _runner(agent)
    results: list[Any] = []
    bar = Progress.create(known_length(sessions)) if progress else None

    def on_start(index: int) -> None:
        results.append(None)

    def on_result(index: int, result: Any) -> None:
        results[index] = result
        if bar is not None:
            bar.advance(failed=isinstance(result, BaseException))

    try:
        await _drive(run, sessions, concurrency, on_start, on_result)
    finally:
        if bar is not None:
            bar.close()
    return settle_results(results, return_exceptions)


@deprecated("treadle.agents.map_iter is deprecated; use treadle.map_iter (the same call).")
async def map_iter(
    agent: MapTarget[T],
    sessions: Iterable[Any] | AsyncIterable[Any],
    *,
    concurrency: int = DEFAULT_CONCURRENCY,
    backend: str = "local",
    **backend_options: Any,
) -> AsyncIterator[tuple[int, Session[T] | BaseException]]:
    """Deprecated alias of `treadle.map_iter` limited to `backend="local"`."""
    _check(concurrency, backend, backend_options)
    stream = local_map_iter(agent, sessions, concurrency=concurrency)
    try:
        async for entry in stream:
            yield entry
    finally:
        await stream.aclose()  # type: ignore[attr-defined]


@overload
async def amap(
    agent: MapTarget[T],
    sessions: Iterable[Any] | AsyncIterable[Any],
    *,
    concurrency: int = ...,
    progress: bool = ...,
    return_exceptions: Literal[False] = ...,
    backend: str = ...,
    **backend_options: Any,
) -> list[Session[T]]: ...


@overload
async def amap(
    agent: MapTarget[T],
    sessions: Iterable[Any] | AsyncIterable[Any],
    *,
    concurrency: int = ...,
    progress: bool = ...,
    return_exceptions: bool,
    backend: str = ...,
    **backend_options: Any,
) -> list[Session[T] | BaseException]: ...


@deprecated("treadle.agents.amap is deprecated; use treadle.amap (the same call, with backends).")
async def amap(
    agent: MapTarget[T],
    sessions: Iterable[Any] | AsyncIterable[Any],
    *,
    concurrency: int = DEFAULT_CONCURRENCY,
    progress: bool = False,
    return_exceptions: bool = False,
    backend: str = "local",
    **backend_options: Any,
) -> list[Session[T]] | list[Session[T] | BaseException]:
    """Deprecated alias of `treadle.amap` limited to `backend="local"`."""
    _check(concurrency, backend, backend_options)
    return await local_amap(
        agent,
        sessions,
        concurrency=concurrency,
        progress=progress,
        return_exceptions=return_exceptions,
    )


@overload
def map(
    agent: MapTarget[T],
    sessions: Iterable[Any] | AsyncIterable[Any],
    *,
    concurrency: int = ...,
    progress: bool = ...,
    return_exceptions: Literal[False] = ...,
    backend: str = ...,
    **backend_options: Any,
) -> list[Session[T]]: ...


@overload
def map(
    agent: MapTarget[T],
    sessions: Iterable[Any] | AsyncIterable[Any],
    *,
    concurrency: int = ...,
    progress: bool = ...,
    return_exceptions: bool,
    backend: str = ...,
    **backend_options: Any,
) -> list[Session[T] | BaseException]: ...


@deprecated("treadle.agents.map is deprecated; use treadle.map (the same call, with backends).")
def map(
    agent: MapTarget[T],
    sessions: Iterable[Any] | AsyncIterable[Any],
    *,
    concurrency: int = DEFAULT_CONCURRENCY,
    progress: bool = False,
    return_exceptions: bool = False,
    backend: str = "local",
    **backend_options: Any,
) -> list[Session[T]] | list[Session[T] | BaseException]:
    """Deprecated alias of `treadle.map` limited to `backend="local"`: `treadle.map` is the same
    call and also takes `backend="process"` or `"ray"` (docs/workflows.md)."""
    _check(concurrency, backend, backend_options)
    call = local_amap(
        agent,
        sessions,
        concurrency=concurrency,
        progress=progress,
        return_exceptions=return_exceptions,
    )
    return run_blocking(call, "treadle.agents.map")
