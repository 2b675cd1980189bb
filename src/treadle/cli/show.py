"""`treadle show` and `treadle sessions`: read persisted JSONL transcripts and render them.

`show` renders one file (rows, tool calls and results, usage, stop reason, whether it closed
cleanly); `--follow` tails a live file until its trailer. `sessions` lists a directory of files.
This module only reads files; it never writes or repairs them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from treadle.cli.console import Console
from treadle.cli.describe import counted, describe_row, human_size, producer_line, short
from treadle.cli.failures import EXIT_CODES, CliFailure
from treadle.cli.paths import is_other_jsonl
from treadle.errors import ConfigurationError
from treadle.persist import load_session
from treadle.persist.writer import DEFAULT_SESSION_DIR
from treadle.session import ChunkRow, Usage

__all__ = [
    "FOLLOW_POLL_SECONDS",
    "SessionSummary",
    "scan_session",
    "sessions_command",
    "show_command",
]

#: How often `treadle show --follow` looks for new lines.
FOLLOW_POLL_SECONDS = 0.2


class TranscriptView:
    """Renders the objects of a session file, in file order."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.rows = 0
        self.intents: dict[str, str] = {}
        self.answered: set[str] = set()
        self.call_names: dict[str, str] = {}

    def header(self, header: Mapping[str, Any]) -> None:
        """The header line: id, time, placement, lineage and agent prompt."""
        created = header.get("created_at")
        when = (
            datetime.fromtimestamp(float(created)).isoformat(sep=" ", timespec="seconds")
            if isinstance(created, int | float)
            else "?"
        )
        self.console.line(f"session {header.get('session_id')}  (created {when})", "heading")
        produced = producer_line(header.get("producer"))
        if produced:
            self.console.line(produced, "dim")
        placement = header.get("placement")
        if placement:
            options = header.get("placement_options")
            detail = f"  {json.dumps(options)}" if isinstance(options, Mapping) else ""
            self.console.line(f"sandbox: {placement}{detail}", "dim")
        parents = header.get("parent_ids") or []
        if parents:
            self.console.line(f"parents: {', '.join(map(str, parents))}", "dim")
        for message in header.get("agent_rows") or []:
            if isinstance(message, Mapping):
                said = short(str(message.get("content", "")), 200)
                self.console.line(f"agent {message.get('role')}: {said}", "dim")

    def row(self, row: ChunkRow) -> None:
        """One row."""
        self.rows += 1
        if row.kind == "tool_result":
            self.answered.add(str(row.payload.get("tool_call_id", "")))
        for call in row.tool_calls:
            self.call_names[str(call.get("id"))] = str((call.get("function") or {}).get("name"))
        for text, style in describe_row(row, self.rows - 1):
            self.console.line(text, style)

    def intent(self, call_id: str, name: str = "") -> None:
        """A tool call that was about to run (its result follows unless the pass crashed)."""
        self.intents[call_id] = name or self.call_names.get(call_id, "tool")

    def end(self, *, closed: bool, stop_reason: str | None, usage: Usage | None) -> None:
        """The closing status: trailer or its absence, pending tool calls."""
        pending = [f"{n} ({cid})" for cid, n in self.intents.items() if cid not in self.answered]
        if pending:
            self.console.line(f"unknown outcome (started, no result): {', '.join(pending)}", "warn")
        if closed:
            u = usage or Usage()
            self.console.line(
                f"closed cleanly | {self.rows} rows | stop: {stop_reason} | "
                f"{u.total_tokens} tokens ({u.prompt_tokens} prompt, "
                f"{u.completion_tokens} completion, {counted(u.requests, 'request')})",
                "summary",
            )
        else:
            self.console.line(
                f"not closed: no trailer ({self.rows} rows); the pass crashed, was cancelled or is "
                "still running",
                "warn",
            )


def _usage(obj: Any) -> Usage:
    if not isinstance(obj, Mapping):
        return Usage()
    keys = ("prompt_tokens", "completion_tokens", "total_tokens", "requests")
    return Usage(*(int(obj.get(k, 0)) for k in keys))


def show_command(path: Path, console: Console, *, follow: bool = False) -> int:
    """Run `treadle show`; returns the exit code."""
    if not path.is_file():
        raise CliFailure(
            f"No session file at {path}.", "list them with `treadle sessions`.", EXIT_CODES["usage"]
        )
    view = TranscriptView(console)
    if follow:
        return _follow(path, view)
    loaded = load_session(path, sandbox=False)  # a transcript to read: no box, no env values
    view.header(loaded.header)
    for row in loaded.session.rows:
        view.row(row)
    for call_id in loaded.pending_intents:
        view.intent(call_id)
    view.end(closed=loaded.closed, stop_reason=loaded.stop_reason, usage=loaded.session.usage)
    return EXIT_CODES["ok"]


def _follow(path: Path, view: TranscriptView) -> int:
    """Render lines as they are appended; stop at the trailer (Ctrl-C stops too)."""
    buffer = b""
    seen_header = False
    with path.open("rb") as f:
        while True:
            chunk = f.read()
            if not chunk:
                time.sleep(FOLLOW_POLL_SECONDS)
                continue
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")  # the last piece may be a line still being written
            for line in lines:
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except ValueError:
                    raise CliFailure(
                        f"{path}: a line is not valid JSON; the file is damaged.",
                        "`treadle show` without --follow reads what can be read.",
                        EXIT_CODES["usage"],
                    ) from None
                kind = obj.get("type") if isinstance(obj, dict) else None
                if not seen_header:
                    if kind != "header":
                        raise CliFailure(
                            f"{path} is not a Treadle session file (no header line).",
                            "`treadle sessions` lists the session files.",
                            EXIT_CODES["usage"],
                        )
                    seen_header = True
                    view.header(obj)
                elif kind == "row":
                    try:
                        view.row(ChunkRow(obj["kind"], obj["payload"]))
                    except (KeyError, ConfigurationError) as err:
                        raise CliFailure(
                            f"{path}: a row is malformed ({err}).",
                            "`treadle show` without --follow reads what can be read.",
                            EXIT_CODES["usage"],
                        ) from None
                elif kind == "intent":
                    view.intent(str(obj.get("tool_call_id")), str(obj.get("name", "")))
                elif kind == "trailer":
                    view.end(
                        closed=True,
                        stop_reason=obj.get("stop_reason"),
                        usage=_usage(obj.get("usage")),
                    )
                    return EXIT_CODES["ok"]


@dataclass(frozen=True, slots=True)
class SessionSummary:
    """One line of `treadle sessions`."""

    path: Path
    session_id: str
    size: int
    rows: int
    closed: bool
    stop_reason: str | None
    modified: float
    damaged: bool = False

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON data (for `treadle sessions --json`)."""
        return {
            "path": str(self.path),
            "id": self.session_id,
            "size": self.size,
            "rows": self.rows,
            "closed": self.closed,
            "stop_reason": self.stop_reason,
            "modified": self.modified,
            "damaged": self.damaged,
        }


def scan_session(path: Path) -> SessionSummary:
    """Summarise one session file without building a session (a torn last line is ignored)."""
    stat = path.stat()
    lines = path.read_bytes().split(b"\n")
    session_id, rows, closed, stop_reason, damaged = path.stem, 0, False, None, False
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            damaged = i < len(lines) - 2  # a torn last line is normal after a crash
            continue
        if not isinstance(obj, dict):
            damaged = True
            continue
        kind = obj.get("type")
        if kind == "header":
            session_id = str(obj.get("session_id") or session_id)
        elif kind == "row":
            rows += 1
        elif kind == "trailer":
            closed, stop_reason = True, obj.get("stop_reason")
    return SessionSummary(path, session_id, stat.st_size, rows, closed, stop_reason,
                          stat.st_mtime, damaged)  # fmt: skip


def _table_rows(summaries: Iterable[SessionSummary]) -> list[list[str]]:
    return [
        [
            s.session_id,
            human_size(s.size),
            str(s.rows),
            "damaged" if s.damaged else ("yes" if s.closed else "no"),
            s.stop_reason or "-",
            datetime.fromtimestamp(s.modified).isoformat(sep=" ", timespec="seconds"),
            str(s.path),
        ]
        for s in summaries
    ]


def sessions_command(directory: Path | None, console: Console, *, as_json: bool = False) -> int:
    """Run `treadle sessions`; returns the exit code."""
    base = directory if directory is not None else DEFAULT_SESSION_DIR
    if directory is not None and not directory.is_dir():
        raise CliFailure(
            f"No directory {directory}.",
            "pass an existing directory, or none for .treadle/sessions.",
            EXIT_CODES["usage"],
        )
    files = sorted(base.glob("*.jsonl"), key=lambda p: p.stat().st_mtime) if base.is_dir() else []
    # Eval logs (`treadle eval report` reads those), datasets and other JSONL are not sessions.
    files = [p for p in files if not is_other_jsonl(p)]
    summaries = [scan_session(p) for p in files]
    if as_json:
        console.line(json.dumps([s.to_dict() for s in summaries], indent=2))
        return EXIT_CODES["ok"]
    if not summaries:
        console.line(f"No sessions in {base} (run `treadle run --persist ...` to record one).")
        return EXIT_CODES["ok"]
    headers = ["id", "size", "rows", "closed", "stop reason", "modified", "path"]
    console.table(headers, _table_rows(summaries))
    return EXIT_CODES["ok"]
