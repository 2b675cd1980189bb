"""One-line descriptions of rows, tool calls, tool results and pass summaries, for the CLI.

Pure functions from data to short text: the console decides how the text is styled. Nothing here
prints, reads files or imports rich.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

from treadle.session import ChunkRow, Usage

__all__ = [
    "PREVIEW_CHARS",
    "counted",
    "describe_call",
    "describe_result",
    "describe_row",
    "human_size",
    "producer_line",
    "short",
    "summary_line",
]

#: Characters of an argument, result or message shown on one line before "…" cuts it.
PREVIEW_CHARS = 100


def short(text: str, limit: int = PREVIEW_CHARS) -> str:
    """`text` on one line, cut to `limit` characters with an ellipsis."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def describe_call(name: str, arguments: str) -> str:
    """`name(key=value, ...)` with each value shortened."""
    try:
        parsed = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return f"{name}({short(arguments, 60)})"
    if not isinstance(parsed, dict):
        return f"{name}({short(arguments, 60)})"
    parts = [f"{k}={short(json.dumps(v, ensure_ascii=False), 40)}" for k, v in parsed.items()]
    return f"{name}({', '.join(parts)})"


def describe_result(content: Any) -> tuple[bool, str]:
    """`(ok, text)` for a tool result body (`{"ok": ..., ...}` JSON text)."""
    text = content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)
    try:
        body = json.loads(text)
    except ValueError:
        return True, short(text)
    if not isinstance(body, dict):
        return True, short(text)
    if body.get("ok") is False:
        kind = body.get("error_kind", "error")
        return False, short(f"{kind}: {body.get('message', '')}")
    if "exit_code" in body:
        out = str(body.get("stdout") or "").strip()
        err = str(body.get("stderr") or "").strip()
        said = f" stdout: {out}" if out else (f" stderr: {err}" if err else "")
        return body.get("exit_code") == 0, short(f"exit {body.get('exit_code')}{said}")
    if "bytes_written" in body:
        return True, f"wrote {body['bytes_written']} bytes"
    if "entries" in body and isinstance(body["entries"], list):
        return True, f"{len(body['entries'])} entries"
    if "data" in body:
        return True, short(f"read: {body['data']}")
    rest = {k: v for k, v in body.items() if k != "ok"}
    return True, short(json.dumps(rest, ensure_ascii=False))


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return ""


def describe_row(row: ChunkRow, index: int | None = None) -> Iterator[tuple[str, str]]:
    """Lines `(text, style)` showing one row of a transcript, prefixed `[index] kind`."""
    prefix = f"[{index}] " if index is not None else ""
    head = f"{prefix}{row.kind:<11} "
    indent = " " * len(head)
    if row.kind in ("system", "user"):
        yield f"{head}{short(_text(row.content), 400)}", "user"
    elif row.kind == "assistant":
        lines: list[tuple[str, str]] = []
        text = _text(row.content).strip()
        if text:
            lines.append((text, "assistant"))
        for call in row.tool_calls:
            fn = call.get("function") or {}
            name, arguments = str(fn.get("name", "")), str(fn.get("arguments", ""))
            lines.append((f"-> {describe_call(name, arguments)}", "tool"))
        for i, (line, style) in enumerate(lines or [("", "assistant")]):
            yield f"{head if i == 0 else indent}{line}", style
    else:
        ok, said = describe_result(row.payload.get("content", ""))
        name = row.payload.get("name") or row.payload.get("tool_call_id", "")
        yield f"{head}<- {name}: {said}", "ok" if ok else "error"


def human_size(size: int) -> str:
    """`1.2 KB`-style size."""
    value = float(size)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1024 or unit == "GB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{size} B"  # pragma: no cover


def producer_line(producer: Any) -> str | None:
    """`model M at ORIGIN | treadle V | temperature=0.2 ...` from a header's `producer` (None
    for files written before transcripts recorded it).

    The values come from a file: control characters (terminal escapes) are shown as `?`."""
    if not isinstance(producer, Mapping):
        return None
    parts = []
    model, endpoint = producer.get("model"), producer.get("endpoint")
    if model or endpoint:
        where = f" at {_printable(endpoint, 80)}" if endpoint else ""
        parts.append(f"model {_printable(model or '?', 80)}{where}")
    if producer.get("treadle"):
        parts.append(f"treadle {_printable(producer['treadle'], 20)}")
    options = producer.get("options")
    if isinstance(options, Mapping) and options:
        shown = " ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in options.items())
        parts.append(_printable(shown, 160))
    return " | ".join(parts) or None


def _printable(value: object, limit: int) -> str:
    return short("".join(c if c.isprintable() else "?" for c in str(value)), limit)


def _s(n: int) -> str:
    return "" if n == 1 else "s"


def counted(n: int, noun: str, *, grouped: bool = False) -> str:
    """`1 request`, `2 requests`, `1 retry`, `3 retries` (`grouped`: `1,024 requests`)."""
    shown = f"{n:,}" if grouped else str(n)
    if n == 1:
        return f"{shown} {noun}"
    return f"{shown} {noun[:-1]}ies" if noun.endswith("y") else f"{shown} {noun}s"


def summary_line(
    *,
    rows: int,
    tool_calls: int,
    usage: Usage,
    seconds: float,
    stop_reason: str | None,
    path: str | None = None,
) -> str:
    """The line printed after a pass: rows, tool calls, tokens, time, stop reason, transcript."""
    parts = [
        f"{rows} rows",
        f"{tool_calls} tool call{_s(tool_calls)}",
        f"{usage.total_tokens} tokens ({counted(usage.requests, 'request')})",
        f"{seconds:.2f} s",
        f"stop: {stop_reason or 'unknown'}",
    ]
    if path:
        parts.append(f"transcript: {path}")
    return " | ".join(parts)
