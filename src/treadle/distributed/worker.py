"""`PassWorker`: what runs inside one worker process, whatever the backend.

A worker rebuilds the agent from its spec once (its own HTTP pool, limiter and sandbox root),
then runs many passes concurrently on its event loop: each pass gets a fresh sandbox directory
under the worker's root (when its session had a placement), a per-pass timeout, and comes back as
a `PassOutcome`. Before anything else a worker runs the janitor over the sandbox base. This module
must never let one pass's failure escape `run` (it becomes the outcome) and never leave a pass's
sandbox directory behind once `run` returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import operator
import os
import shutil
import socket
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from treadle.distributed.janitor import clean_orphans, make_sandbox_root
from treadle.distributed.outcome import (
    PassItem,
    PassOutcome,
    input_data,
    portable_metadata,
    received_rows,
)
from treadle.distributed.spec import AgentSpec, resolve_tool
from treadle.loop import Guardrail
from treadle.session import Session, Usage
from treadle.telemetry import flush, parent_from_carrier, use_parent

__all__ = ["PassWorker", "worker_name"]

log = logging.getLogger("treadle.distributed")

# Seconds a closing worker gives its telemetry exporters (the driver kills it after 10 s).
_FLUSH_SECONDS = 5.0

_USAGE_FIELDS = tuple(f.name for f in dataclasses.fields(Usage))
_usage_values = operator.attrgetter(*_USAGE_FIELDS)
_ITEM_FIELDS = tuple(f.name for f in dataclasses.fields(PassItem))
_item_values = operator.itemgetter(*_ITEM_FIELDS)
_item_attributes = operator.attrgetter(*_ITEM_FIELDS)
_kind = operator.attrgetter("kind")
_payload = operator.attrgetter("payload")

RateGate = Callable[[], Awaitable[None]]
"""Awaited before every model request when the rate limit is one shared bucket."""


def worker_name() -> str:
    """This process as a worker: `host:pid`."""
    return f"{socket.gethostname()}:{os.getpid()}"


def _error_text(err: BaseException) -> str:
    text = str(err).splitlines()[0] if str(err) else ""
    return f"{type(err).__name__}: {text}"[:2000]


def _item_fields(item: PassItem | Mapping[str, Any]) -> tuple[Any, ...]:
    """An item's fields in `PassItem`'s order. A driver's item (a dict of exactly those keys)
    is read as it is; anything else goes through `PassItem.from_json`, whose error names the
    problem (and fails this item alone)."""
    if type(item) is dict and len(item) == len(_ITEM_FIELDS):
        try:
            return _item_values(item)  # type: ignore[no-any-return]
        except KeyError:
            pass  # another key: `from_json` refuses it as it always did
    if not isinstance(item, PassItem):
        item = PassItem.from_json(item)
    return _item_attributes(item)


def _input_session(messages: Any) -> Session:
    """The session a pass runs from the messages the driver sent.

    They are the input session's `to_messages()` (or a `str`'s user message). Rows with a role
    this version knows are taken as they are, without validating them again: an input session
    whose rows were edited after they were validated (content an int, say) runs as it would in
    an in-process map, which does not validate them either. Anything else (an unknown role, a
    message that is not a dict) goes through `Session.from_messages`, whose error names the
    problem (and fails this item alone)."""
    table = received_rows(messages) if type(messages) is list else None
    if table is None:
        return Session.from_messages(messages)
    # `Session(table, operator=..., kind=...)` without its frozen values' `__init__`s
    # (`input_data`): a third of the worker's own work on an input (docs/performance.md).
    return Session._derive(
        input_data(table), operator="from_messages", kind="user", parents=(), sandbox=None
    )


class PassWorker:
    """Runs passes of one agent spec in this process (create it on the loop that will run it)."""

    def __init__(
        self,
        spec: AgentSpec | Mapping[str, Any],
        *,
        share: float = 1.0,
        sandbox_base: str | os.PathLike[str] | None = None,
        pass_timeout: float | None = None,
        rate_gate: RateGate | None = None,
        api_key: str | None = None,
        worker_init: str | None = None,
    ) -> None:
        if worker_init is not None:  # first: it may configure what the agent's build uses
            resolve_tool(worker_init)()
        self.spec = spec if isinstance(spec, AgentSpec) else AgentSpec.from_json(spec)
        self.name = worker_name()
        self.pass_timeout = pass_timeout
        self.orphans_removed = clean_orphans(sandbox_base)
        self.root: Path = make_sandbox_root(sandbox_base)
        guards = []
        if rate_gate is not None:
            gate = rate_gate

            async def take_rate_token(_data: Any) -> None:
                await gate()

            guards.append(Guardrail(take_rate_token, "before", "treadle.shared_rate_limit"))
        self.agent = self.spec.build_agent(
            share=share, shared_rate=rate_gate is not None, guardrails=guards, api_key=api_key
        )

    async def run(self, item: PassItem | Mapping[str, Any]) -> PassOutcome:
        """Run one pass; every failure (error, timeout) is reported in the outcome."""
        return PassOutcome.from_json(await self.run_wire(item))._public()

    async def run_wire(self, item: PassItem | Mapping[str, Any]) -> dict[str, Any]:
        """`run`, as the wire form a process worker sends (`PassOutcome.from_json` takes it
        back; the output's rows as `PassOutcome.rows`; a finished pass's form has no
        `messages`, `error` or `history` and its rows as `kinds` and `payloads`).

        No `PassItem` and no `PassOutcome` is built on this path: a frozen dataclass costs
        about 1.6 k instructions a field to build (`object.__setattr__` per field); without the
        two, and the dict `_wire` made of the outcome, a worker's pass costs 42 k fewer
        (docs/performance.md, process workers, eighth round)."""
        index, session_id, messages, placement, attempt, trace_context, placement_options = (
            _item_fields(item)
        )
        workspace: Path | None = None
        session: Session | None = None
        out: Session | None = None
        # No deadline and no trace parent (the common case) is no context manager per pass.
        deadline = None if self.pass_timeout is None else asyncio.timeout(self.pass_timeout)
        try:  # from the session's rebuild on: an input it cannot rebuild fails this item alone
            session = _input_session(messages)
            if placement == "local":
                workspace = self.root / f"{index}-{attempt}-{session_id[:8]}"
                await asyncio.to_thread(workspace.mkdir)
                session = session.to(str(workspace))
            elif placement_options is not None:  # the caller's limits, mounts and env
                from treadle.sandbox import Isolated

                session = session.to(Isolated.from_spec(placement_options))
            elif placement is not None:
                session = session.to(placement)
            if deadline is None and not trace_context:
                out = await self.agent.run(session)
            else:
                # The map caller's span (another process) is the parent of this pass's span.
                with use_parent(parent_from_carrier(trace_context)):
                    async with deadline or contextlib.nullcontext():
                        out = await self.agent.run(session)
            usage = out.usage
            rows = out.chunk_table.rows
            # A finished pass's wire form (`PassOutcome.from_json` takes it back): no
            # `messages`, `error` or `history` (the one attempt's record is made from `attempts`
            # and `worker` there), and the rows as their kinds and their payloads, two lists
            # rather than a pair a row: fewer objects to pickle and unpickle (docs/performance.md,
            # process workers, second round).
            return {
                "index": index,
                "session_id": session_id,
                "status": "ok",
                "attempts": attempt,
                "worker": self.name,
                # Four ints: `dataclasses.asdict` deep-copies, at a worker's per-pass cost.
                "usage": dict(zip(_USAGE_FIELDS, _usage_values(usage), strict=True)),
                "stop_reason": out.stop_reason,
                # Request usage as tuples: `_public` and `received_session` take them back.
                "metadata": portable_metadata(out.metadata, compact=True),
                # The rows as they are: `to_messages` built a dict per row here, and the driver
                # took each apart again into a row. Read in C from the table's tuple: a
                # comprehension over the table's generator cost 2 k instructions a row.
                "kinds": list(map(_kind, rows)),
                "payloads": list(map(_payload, rows)),
            }
        except TimeoutError as err:
            if deadline is None or not deadline.expired():  # inside the pass (ProviderTimeout)
                return self._failed(index, session_id, attempt, "error", _error_text(err))
            why = f"TimeoutError: pass ran over {self.pass_timeout} s"
            return self._failed(index, session_id, attempt, "timeout", why)
        except Exception as err:  # a failing pass is its own outcome, never the worker's end
            return self._failed(index, session_id, attempt, "error", _error_text(err))
        finally:
            if out is not None:
                out.close_sandbox()
            if session is not None:
                session.close_sandbox()
            if workspace is not None:
                await asyncio.to_thread(shutil.rmtree, workspace, True)

    async def run_json(self, item: Any) -> dict[str, Any]:
        """`run` of an item's JSON, the outcome as JSON: what a worker process does per item.

        Nothing raises out of it but cancellation: `run` reports a pass's failures, and anything
        else (an item that is not one, an outcome that cannot become JSON, a bug) becomes this
        item's error outcome, so the task running it never dies silently and its caller always
        gets an answer."""
        try:
            # Its metadata is `portable_metadata`'s, JSON data already: not walked again.
            return await self.run_wire(item)
        except Exception as err:
            return self.unrunnable(item, err)

    def unrunnable(self, item: Any, err: Exception) -> dict[str, Any]:
        """The error outcome of an item `run_wire` raised for (not a pass's failure: an item
        that is not one, an outcome that cannot be made, a bug), logged."""
        log.exception("a worker's item failed outside its pass", exc_info=err)
        data = item if isinstance(item, Mapping) else {}
        index = data.get("index", -1)
        return {
            "index": index if type(index) is int else -1,
            "session_id": str(data.get("session_id", "")),
            "status": "error",
            "attempts": data.get("attempt", 1) if type(data.get("attempt")) is int else 1,
            "worker": self.name,
            "error": f"input {index} could not be run: {_error_text(err)}"[:2000],
        }

    def _failed(
        self, index: int, session_id: str, attempt: int, status: str, error: str
    ) -> dict[str, Any]:
        """The wire form of a pass that did not finish: every key `PassOutcome.to_json` gives,
        the fields a failed pass has no value for at `PassOutcome`'s defaults."""
        record = {"attempt": attempt, "worker": self.name, "status": status, "error": error}
        return {
            "index": index,
            "session_id": session_id,
            "status": status,
            "attempts": attempt,
            "worker": self.name,
            "messages": None,
            "usage": {},
            "stop_reason": None,
            "error": error,
            "history": [record],
            "metadata": {},
        }

    def close(self) -> None:
        """Remove this worker's sandbox root and export buffered telemetry (blocks; call when no
        pass is running)."""
        with contextlib.suppress(OSError):
            shutil.rmtree(self.root)
        try:
            flush(_FLUSH_SECONDS)
        except Exception as err:  # an exporter's failure must not keep the worker from exiting
            log.warning("flushing telemetry failed: %s", err)
