"""Fan-out: run one agent over many sessions with a bounded number of passes in flight.

`map` (sync, blocks until every item is done), `amap` (async, same result) and `map_iter` (async
iterator of `(index, result)` as items complete). Inputs are pulled from any iterable or async
iterable only as slots free up, so a million inputs are never materialised up front. One item's
failure never cancels the others: it is reported per item. Every pass runs on one event loop;
`treadle.map(..., backend="process" | "ray")` (the switch in `treadle.distributed.backends`) runs
them on worker processes instead.

This module must never start more than `concurrency` runs at once, never reorder `map`'s results
and never block the event loop it runs on (sync input iterators are expected to be cheap).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import anyio

from treadle.agents.progress import Progress, known_length, run_blocking, settle_results
from treadle.errors import ConfigurationError
from treadle.runtime.streams import produce
from treadle.session import Session

__all__ = ["DEFAULT_CONCURRENCY", "Progress", "amap", "map", "map_iter", "settle_results"]

#: Runs in flight at once when `concurrency` is not given.
DEFAULT_CONCURRENCY = 64

Runner = Callable[[Any], Awaitable[Session]]


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


async def map_iter(
    agent: Any,
    sessions: Iterable[Any] | AsyncIterable[Any],
    *,
    concurrency: int = DEFAULT_CONCURRENCY,
    backend: str = "local",
    **backend_options: Any,
) -> AsyncIterator[tuple[int, Session | BaseException]]:
    """Run `agent` over `sessions`; yield `(index, output session or exception)` as each ends.

    Leaving the loop early cancels the runs still in flight. Only `backend="local"` runs here;
    `treadle.map_iter` also takes `"process"` and `"ray"`.
    """
    _check(concurrency, backend, backend_options)
    run = _runner(agent)

    async def drive(send: Callable[[tuple[int, Any]], None]) -> None:
        await _drive(run, sessions, concurrency, lambda _i: None, lambda i, r: send((i, r)))

    async with produce(drive) as entries:
        async for entry in entries:
            yield entry
        entries.result()  # re-raises a failure of the input iterable itself


async def amap(
    agent: Any,
    sessions: Iterable[Any] | AsyncIterable[Any],
    *,
    concurrency: int = DEFAULT_CONCURRENCY,
    progress: bool = False,
    return_exceptions: bool = False,
    backend: str = "local",
    **backend_options: Any,
) -> list[Any]:
    """Async `map`: the output sessions in input order (see `map`)."""
    _check(concurrency, backend, backend_options)
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


def map(
    agent: Any,
    sessions: Iterable[Any] | AsyncIterable[Any],
    *,
    concurrency: int = DEFAULT_CONCURRENCY,
    progress: bool = False,
    return_exceptions: bool = False,
    backend: str = "local",
    **backend_options: Any,
) -> list[Any]:
    """Run `agent` over every session with at most `concurrency` runs in flight; block until done.

    `agent` is an `Agent`, a pipeline or handoff, or any callable `session -> Session`
    (sync or async). Items may be sessions or strings (user messages); they are pulled from the
    iterable only as slots free up. Returns the output sessions in input order. A failing item
    never stops the others: with `return_exceptions=True` its place holds the exception;
    otherwise, after every item finished, the first failure (in input order) is raised with a note
    counting the failures. `progress=True` shows a progress bar on a terminal (rich when
    installed, a plain line otherwise; nothing when stderr is not a TTY). Use `amap` or
    `map_iter` from async code. Only `backend="local"` runs here: `treadle.map` (the same call)
    also takes `backend="process"` or `"ray"` (docs/distributed.md).
    """
    _check(concurrency, backend, backend_options)
    call = amap(
        agent,
        sessions,
        concurrency=concurrency,
        progress=progress,
        return_exceptions=return_exceptions,
        backend=backend,
        **backend_options,
    )
    return run_blocking(call, "treadle.agents.map")
