"""Turn what a tool returned (or raised) into the JSON text the model reads next.

Success: a mapping becomes `{"ok": true, **mapping}`, any other value `{"ok": true, "result":
value}`; pydantic models, dataclasses, enums, paths and dates serialise through pydantic-core.
Failure: `{"ok": false, "error_kind", "message", "detail"?}`. Every string inside is capped with
an explicit truncation marker, and the whole body is capped too, so one chatty tool can never
flood the context window.

The body is always valid JSON: `bytes` become text when they are UTF-8 (or nearly: a few bad bytes
are replaced with U+FFFD), otherwise `{"base64": ..., "bytes": n}`; a circular reference becomes
the string `"<circular reference>"`; NaN and infinities become the strings `"NaN"`, `"Infinity"`,
`"-Infinity"`; any other value falls back to its `repr`. If a value still cannot be serialised
(its `repr` raises), `success_content` raises `ResultSerialisationError`, which the dispatcher
turns into an error body for the model. This module never calls a tool.
"""

from __future__ import annotations

import base64
import math
import traceback
from collections.abc import Mapping
from typing import Any

import pydantic_core

from treadle.session.rows import valid_text

__all__ = [
    "MAX_CONTENT_CHARS",
    "MAX_DETAIL_CHARS",
    "MAX_TEXT_CHARS",
    "EncodedResult",
    "ResultSerialisationError",
    "cap_text",
    "error_content",
    "exception_detail",
    "success_content",
    "truncation_marker",
]

#: Default cap on every string field of a tool result (a tool's `max_result_chars` overrides it).
MAX_TEXT_CHARS = 20_000
#: Cap on the `detail` of an error (a traceback excerpt: its last lines are kept).
MAX_DETAIL_CHARS = 4_000
#: Cap on the whole JSON body of one tool result, after each string is capped.
MAX_CONTENT_CHARS = 100_000


def truncation_marker(dropped: int, unit: str = "chars") -> str:
    """The marker appended where text was cut: `…[truncated 12345 chars]`."""
    return f"…[truncated {dropped} {unit}]"


def cap_text(text: str, limit: int = MAX_TEXT_CHARS) -> str:
    """`text` cut to `limit` characters plus a truncation marker (unchanged when it fits)."""
    if len(text) <= limit:
        return text
    return text[:limit] + truncation_marker(len(text) - limit)


def _cap_tail(text: str, limit: int) -> str:
    """`text` with its start cut so that the result, marker included, fits in `limit`."""
    if len(text) <= limit:
        return text
    keep = max(0, limit - len(truncation_marker(len(text))))
    return truncation_marker(len(text) - keep) + text[len(text) - keep :]


class EncodedResult:
    """A tool result already turned into its JSON text by `success_content` (on a worker thread,
    say, for a bulky value whose encoding would hold the event loop): the dispatcher takes its
    `text` as the result's content as it is. Make one only with `EncodedResult.of`."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    @classmethod
    def of(cls, value: Any, *, max_chars: int | None = None) -> EncodedResult:
        """`success_content(value, max_chars=...)`, held (blocking and linear in the value: call
        it on a worker thread for a large one)."""
        return cls(success_content(value, max_chars=max_chars))


class ResultSerialisationError(Exception):
    """A tool's return value could not be turned into JSON at all."""


CIRCULAR = "<circular reference>"
#: Share of undecodable bytes up to which `bytes` are shown as text (with U+FFFD) not base64.
_REPLACEMENT_SHARE = 0.05


def _bytes_value(data: bytes | bytearray | memoryview) -> Any:
    raw = bytes(data)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("utf-8", "replace")
        if text.count("\ufffd") <= max(1, int(len(raw) * _REPLACEMENT_SHARE)):
            return text  # command output with a stray Latin-1 byte: still text for the model
        return {"base64": base64.b64encode(raw).decode("ascii"), "bytes": len(raw)}


def _prepare(value: Any, stack: set[int]) -> Any:
    """Containers made JSON-safe before pydantic-core sees them: bytes, cycles, non-finite."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return _bytes_value(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else _non_finite(value)
    if not isinstance(value, (dict, list, tuple, set, frozenset)):
        return value
    if id(value) in stack:
        return CIRCULAR
    stack.add(id(value))
    try:
        if isinstance(value, dict):
            return {_key(k): _prepare(v, stack) for k, v in value.items()}
        return [_prepare(v, stack) for v in value]
    finally:
        stack.discard(id(value))


def _key(key: Any) -> str:
    if isinstance(key, str):
        return key
    if isinstance(key, (bytes, bytearray)):
        return bytes(key).decode("utf-8", "replace")
    return str(key)


def _non_finite(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    return "Infinity" if value > 0 else "-Infinity"


def _jsonable(body: Mapping[str, Any]) -> Any:
    prepared = _prepare(dict(body), set())
    try:
        return _jsonable_value(prepared)
    except Exception:  # a cycle inside a model, a raising repr: go field by field
        pass
    return {k: _jsonable_field(v) for k, v in prepared.items()}


def _jsonable_value(value: Any) -> Any:
    try:
        return pydantic_core.to_jsonable_python(value, fallback=repr, serialize_unknown=True)
    except (ValueError, TypeError):
        # Non-UTF-8 bytes inside a model or dataclass: base64 there.
        return pydantic_core.to_jsonable_python(
            value, fallback=repr, serialize_unknown=True, bytes_mode="base64"
        )


def _jsonable_field(value: Any) -> Any:
    try:
        return _jsonable_value(value)
    except Exception:  # whatever broke, the repr below is the fallback
        pass
    try:
        return repr(value)
    except Exception as err:  # a repr that raises: nothing sensible can be shown
        raise ResultSerialisationError(f"{type(err).__name__}: {err}") from None


def _cap_strings(value: Any, limit: int) -> Any:
    # Lone surrogates (a file name read with `surrogateescape`) become U+FFFD: JSON text is
    # UTF-8, and the result is the tool's, not a serialisation error (`valid_text`).
    if isinstance(value, str):
        return cap_text(valid_text(value), limit)
    if isinstance(value, dict):
        return {valid_text(str(k)): _cap_strings(v, limit) for k, v in value.items()}
    if isinstance(value, list):
        return [_cap_strings(v, limit) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return _non_finite(value)  # from inside a model or dataclass
    return value


#: What `_plain` says of a value.
_FITS, _PLAIN, _OTHER = 0, 1, 2


def _plain(value: Any, limit: int) -> int:
    """`_FITS` when `value` is plain JSON data (str keys, finite numbers) with no string over
    `limit` (then the careful path of `_encode` would give the fast path's text); `_PLAIN` when
    it is plain data but for strings over `limit` or non-finite floats (`_cap_strings` alone
    makes it JSON-safe); `_OTHER` for anything else. Walked in Python (the loop may take the
    GIL between steps) without copying anything."""
    shape = _FITS
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if len(item) > limit:
                shape = _PLAIN
        elif isinstance(item, dict):
            if not all(isinstance(k, str) for k in item):
                return _OTHER
            if any(len(k) > limit for k in item):
                shape = _PLAIN
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, float):
            if not math.isfinite(item):
                shape = _PLAIN
        elif not (item is None or isinstance(item, bool | int)):
            return _OTHER
    return shape


def _encode(body: Mapping[str, Any], limit: int) -> str:
    # Fast path, the usual case: plain JSON values serialise as they are. When the whole text is
    # within `limit`, no string in it can be over the limit either, so nothing needs capping.
    # Anything unusual (a cycle, non-UTF-8 bytes, an unknown type, a long string) raises or is
    # too long, and takes the careful path below, which gives the same text for plain values.
    try:
        text = pydantic_core.to_json(body, inf_nan_mode="strings").decode()
    except Exception:  # whatever the value is, the careful path handles it
        text = ""
    if text and len(text) <= limit:
        return text
    shape = _plain(body, limit) if text else _OTHER
    if shape != _FITS:
        # A copy made JSON-safe, strings capped. `to_jsonable_python` copies even a plain value
        # in one C call that holds the GIL (200 ms for 450,000 small lists; 74 to 106 ms for a
        # tool result of 1 MiB with one `1e999` or one long string in it), so plain data is
        # copied by `_cap_strings` alone, in Python, where the loop gets the GIL back.
        jsonable = body if shape == _PLAIN else _jsonable(body)
        text = pydantic_core.to_json(_cap_strings(jsonable, limit)).decode()
    if len(text) <= MAX_CONTENT_CHARS:
        return text
    # Too big even with each string capped (say, a huge list): hand back a cut JSON text,
    # shrinking the cut until its escaped form fits.
    keep = MAX_CONTENT_CHARS
    while True:
        cut = cap_text(text, keep)
        wrapped = pydantic_core.to_json({"ok": body.get("ok", True), "result": cut}).decode()
        if len(wrapped) <= MAX_CONTENT_CHARS or keep == 0:
            return wrapped
        keep = max(0, keep - (len(wrapped) - MAX_CONTENT_CHARS) - 64)


def success_content(value: Any, *, max_chars: int | None = None) -> str:
    """The JSON text for a successful call that returned `value` (an `EncodedResult`: its text)."""
    if isinstance(value, EncodedResult):
        return value.text
    limit = max_chars if max_chars is not None else MAX_TEXT_CHARS
    if type(value) is dict or isinstance(value, Mapping):  # a dict: no ABC check
        body: dict[str, Any] = {"ok": True}
        body.update({str(k): v for k, v in value.items()})
    else:
        body = {"ok": True, "result": value}
    return _encode(body, limit)


def error_content(kind: str, message: str, detail: str | None = None) -> str:
    """The JSON text for a failed call: `{"ok": false, "error_kind", "message", "detail"?}`."""
    body: dict[str, Any] = {"ok": False, "error_kind": kind, "message": cap_text(message)}
    if detail:
        body["detail"] = _cap_tail(detail, MAX_DETAIL_CHARS)
    return _encode(body, MAX_TEXT_CHARS)


def exception_detail(error: BaseException) -> str:
    """A traceback excerpt for `error` of at most `MAX_DETAIL_CHARS` characters.

    The innermost frames are kept, and the closing `Type: message` line always survives (its
    message cut to a tenth of the budget).
    """
    last = f"{type(error).__name__}: {cap_text(str(error), MAX_DETAIL_CHARS // 10)}\n"
    frames = "Traceback (most recent call last):\n" + "".join(
        traceback.format_tb(error.__traceback__)
    )
    return _cap_tail(frames, MAX_DETAIL_CHARS - len(last)) + last
