"""The map's backend switch: `map`, `amap`, `map_iter` with `backend="local" | "process" | "ray"`.

This is what `treadle.map` is. It sits above both fan-outs it chooses between: the local one
(`treadle.agents.fanout`, every pass on one event loop) and the distributed one
(`treadle.distributed.mapping`, passes on worker processes or Ray actors). The results are the
same output sessions, in input order, whichever backend ran them.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Iterable
from typing import Any, Literal, overload

from treadle.agents import fanout
from treadle.agents.fanout import DEFAULT_CONCURRENCY, MapTarget, T, check_concurrency
from treadle.agents.progress import run_blocking
from treadle.distributed.mapping import REMOTE_BACKENDS, remote_amap, remote_map_iter
from treadle.errors import ConfigurationError
from treadle.session import Session

__all__ = ["BACKENDS", "amap", "map", "map_iter"]

#: Every value `backend=` takes.
BACKENDS = ("local", *REMOTE_BACKENDS)


def _check(concurrency: int, backend: str, options: dict[str, Any]) -> int:
    """Validate the call; the concurrency the local backend runs with (see `local_concurrency`)."""
    check_concurrency(concurrency)
    if backend not in BACKENDS:
        raise ConfigurationError(
            f"backend={backend!r} is not a backend; use 'local', 'process' or 'ray'."
        )
    if backend != "local":
        return concurrency
    workers = options.pop("workers", None)
    if options:
        raise ConfigurationError(
            f"{sorted(options)} apply to backend='process' or 'ray' only (see treadle.distributed)."
        )
    return local_concurrency(concurrency, workers)


def local_concurrency(concurrency: int, workers: int | None) -> int:
    """Passes in flight on `backend="local"` for `workers` (None: `concurrency`).

    On the process and Ray backends `concurrency` is per worker, so a map keeps `workers *
    concurrency` passes in flight. `backend="local"` keeps the same number in flight on the one
    runtime loop (its passes wait on the network, not on a core), so the same call means the
    same load on the endpoint whichever backend runs it.
    """
    if workers is None:
        return concurrency
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConfigurationError(f"workers must be an int >= 1 or None, got {workers!r}.")
    return concurrency * workers


async def map_iter(
    agent: MapTarget[T],
    sessions: Iterable[Any] | AsyncIterable[Any],
    *,
    concurrency: int = DEFAULT_CONCURRENCY,
    backend: str = "local",
    **backend_options: Any,
) -> AsyncIterator[tuple[int, Session[T] | BaseException]]:
    """Run `agent` over `sessions`; yield `(index, output session or exception)` as each ends.

    Leaving the loop early cancels the runs still in flight. `backend="process"` or `"ray"`
    runs on worker processes (see `treadle.distributed.map_outcomes` for `backend_options`).
    """
    local = _check(concurrency, backend, backend_options)
    if backend == "local":
        stream = fanout.local_map_iter(agent, sessions, concurrency=local)
    else:
        stream = remote_map_iter(
            agent, sessions, backend=backend, concurrency=concurrency, **backend_options
        )
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
    """Async `map`: the output sessions in input order (see `map`)."""
    local = _check(concurrency, backend, backend_options)
    if backend == "local":
        return await fanout.local_amap(
            agent,
            sessions,
            concurrency=local,
            progress=progress,
            return_exceptions=return_exceptions,
        )
    return await remote_amap(
        agent,
        sessions,
        backend=backend,
        concurrency=concurrency,
        progress=progress,
        return_exceptions=return_exceptions,
        **backend_options,
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
    """Run `agent` over every session with at most `concurrency` runs in flight; block until done.

    `agent` is an `Agent`, a pipeline or handoff, or any callable `session -> Session`
    (sync or async). Items may be sessions or strings (user messages); they are pulled from the
    iterable only as slots free up. Returns the output sessions in input order. A failing item
    never stops the others: with `return_exceptions=True` its place holds the exception;
    otherwise, after every item finished, the first failure (in input order) is raised with a note
    counting the failures. `progress=True` shows a progress bar on a terminal (rich when
    installed, a plain line otherwise; nothing when stderr is not a TTY). Use `amap` or
    `map_iter` from async code. `backend="process"` (this machine's cores) or `"ray"` (a Ray
    cluster) run passes on worker processes; `concurrency` is then per worker, and
    `backend_options` are those of `treadle.distributed.map_outcomes` (docs/distributed.md).
    `workers=N` with `backend="local"` keeps the same `N * concurrency` passes in flight on the
    one runtime loop (see `local_concurrency`).
    """
    _check(concurrency, backend, dict(backend_options))
    call = amap(
        agent,
        sessions,
        concurrency=concurrency,
        progress=progress,
        return_exceptions=return_exceptions,
        backend=backend,
        **backend_options,
    )
    return run_blocking(call, "treadle.map")
