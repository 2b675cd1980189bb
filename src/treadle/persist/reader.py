"""`load_session`: read a JSONL session file back into a resumable `Session`.

A file without a trailer (the pass crashed or was cancelled) loads with `closed=False`. Only a
final segment without a newline is torn (the writer died mid-line) and ignored; a complete,
newline-terminated line that is not JSON is damage and raises `PersistenceError`, wherever it is.
Tool calls recorded as intents without a result are reported, so a resume can treat them as of
unknown outcome. Tool results are written as they finish, so the results of one round are put
back in call order. The trailer's `pending_approvals` and `interrupt_reason` come back on the
session's metadata. An `Isolated(...)` placement comes back with its saved options; its env
values were never saved, so a box that had any needs them again (`load_session(path, env=...)`).
This module reads files synchronously: call it off the loop.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pydantic_core

from treadle.errors import ConfigurationError, PersistenceError
from treadle.persist.checks import FieldError, check_count, check_header
from treadle.persist.format import SCHEMA_VERSION
from treadle.session import ChunkRow, ChunkTable, Session, SessionData, Usage
from treadle.session.placement import SandboxHandle
from treadle.session.rows import in_call_order
from treadle.session.stops import StopReason, as_stop_reason

if TYPE_CHECKING:
    from treadle.sandbox.placements import PlacementLike

__all__ = ["LoadedSession", "load_session"]


@dataclass(frozen=True, slots=True)
class LoadedSession:
    """What a session file holds."""

    session: Session
    """The transcript (input rows plus every row the pass wrote); resumable."""
    agent: Session
    """The agent session (system prompt) the pass ran with."""
    closed: bool
    """True when the file has a trailer: the pass ended gracefully."""
    stop_reason: StopReason | None
    """The trailer's stop reason (None without a trailer or an unknown one)."""
    path: Path
    """The file read."""
    header: dict[str, Any] = field(default_factory=dict)
    """The header line as written."""
    pending_intents: tuple[str, ...] = ()
    """Ids of tool calls that were about to run but have no result row (unknown outcome)."""

    @property
    def producer(self) -> dict[str, Any]:
        """What wrote the file: `treadle` version, `model`, `endpoint` (origin only) and output
        `options` (see `treadle.persist.producer`); empty for files written before it existed."""
        value = self.header.get("producer")
        return dict(value) if isinstance(value, Mapping) else {}


def _damaged(p: Path, what: str) -> PersistenceError:
    return PersistenceError(f"{p}: {what}; the file is damaged or from a newer Treadle.")


def _weaker_limits(limits: Any) -> list[str]:
    """The limits in `limits` looser than `Isolated()`'s defaults, in words ("cpu_seconds=None")."""
    from treadle.sandbox.bwrap import ResourceLimits

    default = ResourceLimits()
    looser = []
    for name in ResourceLimits.__dataclass_fields__:
        mine, base = getattr(limits, name), getattr(default, name)
        if base is not None and (mine is None or mine > base):
            looser.append(f"{name}={mine}")
    return looser


def _asked(p: Path, header: Mapping[str, Any], looser: list[str] | None = None) -> PersistenceError:
    """The refusal of a placement the file chose that the caller did not confirm."""
    placement = header.get("placement")
    saved = header.get("placement_options")
    if isinstance(saved, dict):
        wants = ["network access"] if saved.get("network") else []
        for kind in ("read_only", "writable"):
            paths = saved.get(kind) or []
            if paths:
                wants.append(f"{kind.replace('_', '-')} host mounts {', '.join(map(str, paths))}")
        if looser:
            wants.append(f"limits looser than Isolated()'s ({', '.join(looser)})")
        what = f"an isolated box with {' and '.join(wants)}"
    elif placement == "local":
        what = "the 'local' placement (commands on the host, no box)"
    else:
        what = f"the host directory {placement!r} as its workspace"
    return PersistenceError(
        f"{p}: line 1 asks for {what}, which a saved file may not choose; pass placement=... "
        "to load_session (you decide where code runs), or sandbox=False to read the transcript."
    )


def _placement(
    p: Path, header: Mapping[str, Any], env: Mapping[str, str], placement: PlacementLike | None
) -> SandboxHandle | None:
    """The sandbox handle of the caller's `placement`, else of the file's when it is a box no
    weaker than `Isolated()` (no host mounts, no network, no limit looser than the default);
    env values come from `env`."""
    if placement is not None:
        if env:
            raise ConfigurationError(
                "give env values in the Isolated(env=...) passed as placement=, not as env=."
            )
        return SandboxHandle(placement)
    asked = header.get("placement")
    if asked is not None and not isinstance(asked, str):
        raise _damaged(p, f"line 1: the header's placement is {type(asked).__name__}, not a name")
    saved = header.get("placement_options")
    if saved is None:
        if env:
            raise PersistenceError(
                f"{p}: env= names {', '.join(sorted(env))}, but the saved session has no "
                "Isolated(env=...) variables."
            )
        if not asked:
            return None
        if asked != "isolated":  # a directory, or "local": the file would choose the host
            raise _asked(p, header)
        return SandboxHandle("isolated")
    if asked != "isolated":
        raise _damaged(
            p, f"the header has placement_options but its placement is {asked!r} (options "
            "apply to only the isolated placement)"
        )  # fmt: skip
    if not isinstance(saved, dict):
        raise _damaged(p, "the header's placement_options is not a JSON object")
    spec = dict(saved)
    if "env" in spec:
        raise _damaged(p, "the header's placement_options hold env values (env values are never "
                       "saved, only env_names)")  # fmt: skip
    names = spec.pop("env_names", None)
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise _damaged(p, "the header's placement_options env_names must be a list of names")
    missing = [n for n in names if n not in env]
    if missing:
        raise PersistenceError(
            f"{p}: the session's Isolated box had env variables {', '.join(missing)}, whose "
            "values are not saved (they may be secrets); give them back: "
            f"treadle.load_session(path, env={{{', '.join(repr(n) + ': ...' for n in missing)}}})."
        )
    extra = sorted(set(env) - set(names))
    if extra:
        raise PersistenceError(
            f"{p}: env= names {', '.join(extra)}, which the saved Isolated box did not have "
            f"(it had: {', '.join(names) or 'none'})."
        )
    spec["env"] = {name: env[name] for name in names}
    from treadle.sandbox.bwrap import Isolated  # the sandbox layer loads only when one is needed

    try:
        options = Isolated.from_spec(spec)
    except ConfigurationError as err:
        raise _damaged(p, f"the header's placement_options are invalid ({err})") from None
    looser = _weaker_limits(options.limits)
    if options.network or options.read_only or options.writable or looser:
        raise _asked(p, header, looser)
    return SandboxHandle(options)


def load_session(
    path: str | os.PathLike[str],
    *,
    env: Mapping[str, str] | None = None,
    sandbox: bool = True,
    placement: PlacementLike | None = None,
) -> LoadedSession:
    """Load a session file written with `persist=True`.

    The file never chooses where code runs: `placement` (`"local"`, `"isolated"`, an
    `Isolated(...)` or a directory) binds the loaded session's sandbox, whatever the file says.
    Without it, the file's own placement is used only when it is a box no weaker than
    `Isolated()` (no host mounts, no network); a file asking for `local`, a host directory, host
    mounts or the network raises `PersistenceError` naming what it asked for. `env` gives back
    the values of the saved box's `Isolated(env=...)` variables (the file holds only their
    names): every saved name, and no other. `sandbox=False` reads the transcript only: the
    session comes back with no placement. Every malformed line is a `PersistenceError` naming
    the file and the line.
    """
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as err:
        raise PersistenceError(f"cannot read session file {p}: {err.strerror}.") from None
    lines = raw.split(b"\n")
    objs: list[tuple[int, dict[str, Any]]] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            obj = pydantic_core.from_json(line)
        except ValueError:
            if i == len(lines) - 1:  # no newline after it: the writer died mid-line (torn)
                break
            raise PersistenceError(
                f"{p}: line {i + 1} is not valid JSON; the file is damaged."
            ) from None
        if not isinstance(obj, dict):
            raise PersistenceError(f"{p}: line {i + 1} is not a JSON object.")
        objs.append((i + 1, obj))
    if not objs or objs[0][1].get("type") != "header":
        raise PersistenceError(f"{p} is not a Treadle session file (no header line).")
    header_line, header = objs[0]
    try:
        check_header(header, SCHEMA_VERSION)
    except FieldError as err:
        raise _malformed(p, header_line, f"the header's {err.field}", str(err)) from None
    schema = header.get("schema", 0)
    if schema > SCHEMA_VERSION:
        raise PersistenceError(
            f"{p} was written by a newer Treadle (schema {schema}); upgrade Treadle."
        )
    rows: list[ChunkRow] = []
    trailer: dict[str, Any] | None = None
    trailer_line = 0
    intents: dict[str, str] = {}
    answered: set[str] = set()
    for number, obj in objs[1:]:
        kind = obj.get("type")
        try:
            if kind == "row":
                row = ChunkRow(obj["kind"], obj["payload"])
                if row.kind == "tool_result":
                    answered.add(_text(row.payload["tool_call_id"]))
                rows.append(row)
            elif kind == "intent":
                intents[_text(obj["tool_call_id"])] = _text(obj.get("name", ""))
            elif kind == "trailer":
                trailer, trailer_line = obj, number
                if obj.get("rows") is not None:
                    check_count("rows", obj["rows"])
        except (KeyError, TypeError, ValueError) as err:  # ConfigurationError is a ValueError
            what = (
                f"the trailer's {err.field}" if isinstance(err, FieldError) else f"the {kind} line"
            )
            raise _malformed(p, number, what, _reason(err)) from None
    try:
        agent_rows = [ChunkRow.from_message(m) for m in _list_of(header.get("agent_rows", []))]
    except (KeyError, TypeError, ValueError) as err:
        raise _malformed(p, header_line, "the header's agent_rows", _reason(err)) from None
    usage = Usage()
    if trailer is not None and trailer.get("usage") is not None:
        u = trailer["usage"]
        try:
            if not isinstance(u, dict):
                raise TypeError(f"usage is {type(u).__name__}, not an object")
            usage = Usage(*(_count(u.get(name, 0)) for name in _USAGE))
        except (TypeError, ValueError) as err:
            raise _malformed(p, trailer_line, "the trailer's usage", _reason(err)) from None
    saved_stop = trailer.get("stop_reason") if trailer else None
    if saved_stop is not None and not isinstance(saved_stop, str):
        raise _malformed(p, trailer_line, "the trailer's stop_reason", "it is not a string")
    stop_reason = as_stop_reason(saved_stop)
    session_id = header.get("session_id")
    if session_id is not None and not isinstance(session_id, str):
        raise _malformed(p, header_line, "the header's session_id", "it is not a string")
    pending = tuple(cid for cid in intents if cid not in answered)
    metadata: dict[str, Any] = {"closed": trailer is not None, "path": str(p)}
    written = trailer.get("metadata") if trailer is not None else None
    if written is not None:
        try:
            metadata.update(_restored(written))
        except (TypeError, ValueError) as err:
            raise _malformed(p, trailer_line, "the trailer's metadata", _reason(err)) from None
    if pending:
        metadata["unknown_outcome_tool_calls"] = list(pending)
    rows = in_call_order(rows)
    # A resumed pass gets the caller's placement, or a fresh box the file describes (see above):
    # a fresh temporary workspace either way, never a directory the file names.
    handle = _placement(p, header, env or {}, placement) if sandbox else None
    session = Session._derive(
        SessionData(ChunkTable(rows), usage, stop_reason, metadata),
        operator="load_session",
        kind="output",
        parents=(),
        sandbox=handle,
        id=session_id or None,  # the id the pass gave its output
    )
    if handle is not None:
        handle.release()  # the session took its own share; drop the creator's
    agent = Session(agent_rows, operator="load_session", kind="agent")
    return LoadedSession(
        session=session,
        agent=agent,
        closed=trailer is not None,
        stop_reason=stop_reason,
        path=p,
        header=header,
        pending_intents=pending,
    )


_USAGE = ("prompt_tokens", "completion_tokens", "total_tokens", "requests")


def _malformed(p: Path, line: int, what: str, why: str) -> PersistenceError:
    return PersistenceError(
        f"{p}: line {line}: {what} is malformed ({why}); the file is damaged or from a newer "
        "Treadle."
    )


def _reason(err: BaseException) -> str:
    return f"missing {err}" if isinstance(err, KeyError) else str(err)


def _text(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{value!r} is not a string")
    return value


def _count(value: object) -> int:
    return check_count("usage", value)


def _restored(written: object) -> dict[str, Any]:
    """The trailer metadata a loaded session gets back (what a resume or a human decision
    needs: pending approvals, interrupt reason, budget message, cancelled), each checked to be
    of the type the loop writes; other keys are dropped."""
    if not isinstance(written, dict):
        raise TypeError(f"metadata is {type(written).__name__}, not an object")
    out: dict[str, Any] = {}
    for key in ("interrupt_reason", "budget_message"):
        if written.get(key) is not None:
            out[key] = _text(written[key])
    if "cancelled" in written:
        if not isinstance(written["cancelled"], bool):
            raise TypeError(f"cancelled is {written['cancelled']!r}, not true or false")
        out["cancelled"] = written["cancelled"]
    if "pending_approvals" in written:
        approvals = []
        for call in _list_of(written["pending_approvals"]):
            if not isinstance(call, dict):
                raise TypeError(f"a pending approval is {type(call).__name__}, not an object")
            approvals.append({key: _text(call.get(key)) for key in ("id", "name", "arguments")})
        out["pending_approvals"] = approvals
    return out


def _list_of(value: object) -> list[Any]:
    if not isinstance(value, list):
        raise TypeError(f"{type(value).__name__}, not a list")
    return value
