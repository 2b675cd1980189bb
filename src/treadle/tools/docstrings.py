"""Split a tool function's docstring into a summary and per-parameter descriptions.

Understands the three common styles: Google (`Args:` / `Arguments:` / `Parameters:` sections with
`name (type): text`), Sphinx (`:param name: text`) and NumPy (`Parameters` underlined with
dashes, then `name : type` with indented text). This module only parses text: it must never
import the function's module, evaluate annotations or raise on odd docstrings (an unparsed
docstring simply yields its text as the summary and no parameter descriptions).
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field

__all__ = ["ParsedDocstring", "parse_docstring"]

_GOOGLE_ARGS = re.compile(r"^(args|arguments|parameters|params|keyword args|kwargs)\s*:\s*$", re.I)
_GOOGLE_OTHER = re.compile(
    r"^(returns?|yields?|raises?|examples?|notes?|see also|attributes|warnings?|todo)\s*:\s*$",
    re.I,
)
_GOOGLE_ITEM = re.compile(r"^\*{0,2}(\w+)\s*(\([^)]*\))?\s*:\s*(.*)$")
_SPHINX_PARAM = re.compile(r"^:param\s+(?:[^:]*\s)?(\w+)\s*:\s*(.*)$")
_SPHINX_FIELD = re.compile(r"^:\w+")
_NUMPY_RULE = re.compile(r"^-{3,}\s*$")
_NUMPY_ITEM = re.compile(r"^\*{0,2}(\w+)\s*(?::.*)?$")


@dataclass(frozen=True, slots=True)
class ParsedDocstring:
    """A docstring split into the tool description and parameter descriptions."""

    summary: str
    """The text before the first section (paragraphs joined with blank lines)."""
    params: dict[str, str] = field(default_factory=dict)
    """Parameter name -> description (continuation lines joined with spaces)."""


def parse_docstring(doc: str | None) -> ParsedDocstring:
    """Parse `doc` (Google, Sphinx or NumPy style); never raises."""
    if not doc:
        return ParsedDocstring("")
    lines = inspect.cleandoc(doc).splitlines()
    params: dict[str, str] = {}
    summary_end = len(lines)
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        numpy_header = i + 1 < len(lines) and _NUMPY_RULE.match(lines[i + 1].strip()) is not None
        if _GOOGLE_ARGS.match(line):
            summary_end = min(summary_end, i)
            i = _parse_google(lines, i + 1, params)
        elif _GOOGLE_OTHER.match(line):
            summary_end = min(summary_end, i)
            i += 1
        elif numpy_header:
            summary_end = min(summary_end, i)
            if line.lower() in ("parameters", "other parameters", "keyword arguments"):
                i = _parse_numpy(lines, i + 2, params)
            else:
                i += 2
        elif _SPHINX_FIELD.match(line):
            summary_end = min(summary_end, i)
            match = _SPHINX_PARAM.match(line)
            i += 1
            if match:
                text = [match.group(2).strip()]
                while i < len(lines) and lines[i].startswith((" ", "\t")):
                    text.append(lines[i].strip())
                    i += 1
                params[match.group(1)] = _join(text)
        else:
            i += 1
    summary = "\n".join(lines[:summary_end]).strip()
    return ParsedDocstring(summary, params)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _parse_google(lines: list[str], i: int, params: dict[str, str]) -> int:
    """Read `name (type): text` items indented under an Args section; return the next index."""
    base: int | None = None
    name: str | None = None
    text: list[str] = []
    while i < len(lines):
        raw = lines[i]
        if raw.strip() and _indent(raw) == 0:
            break
        if raw.strip():
            if base is None:
                base = _indent(raw)
            match = _GOOGLE_ITEM.match(raw.strip()) if _indent(raw) <= base else None
            if match:
                if name is not None:
                    params[name] = _join(text)
                name, text = match.group(1), [match.group(3).strip()]
            elif name is not None:
                text.append(raw.strip())
        i += 1
    if name is not None:
        params[name] = _join(text)
    return i


def _parse_numpy(lines: list[str], i: int, params: dict[str, str]) -> int:
    """Read `name : type` items with indented descriptions; return the next index."""
    name: str | None = None
    text: list[str] = []
    while i < len(lines):
        raw = lines[i]
        if i + 1 < len(lines) and _NUMPY_RULE.match(lines[i + 1].strip()) and raw.strip():
            break  # the next section's header
        if raw.strip() and _indent(raw) == 0:
            match = _NUMPY_ITEM.match(raw.strip())
            if match is None:
                break
            if name is not None:
                params[name] = _join(text)
            name, text = match.group(1), []
        elif raw.strip() and name is not None:
            text.append(raw.strip())
        i += 1
    if name is not None:
        params[name] = _join(text)
    return i


def _join(parts: list[str]) -> str:
    return " ".join(p for p in parts if p).strip()
