"""What a provider puts inside a successful (HTTP 200) reply besides the message.

Errors: a stream may end with an `event: error` whose data is `{"error": {...}}` (Groq), or carry
an `error` field on an ordinary chunk (OpenRouter); a whole 200 body may be `{"error": {...}}`.
Each becomes the typed `ProviderError` an HTTP status would have given, with the provider's
message, and the status the provider named inside the error (`status_code`, `status`, or a
numeric `code`) decides whether it is worth a retry.

Usage: most providers report `usage` at the top level; some only under their own key
(`x_groq.usage` on Groq's compound models). Pure functions, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic_core import from_json, to_json

from treadle.errors import ProviderError

__all__ = ["error_in", "provider_usage", "status_in", "with_retries", "with_status_from_body"]

_USAGE_KEYS = ("prompt_tokens", "completion_tokens", "total_tokens")


def status_in(error: object) -> int | None:
    """The HTTP-like status a provider names inside an error object, if any."""
    if not isinstance(error, Mapping):
        return None
    for key in ("status_code", "status", "code"):
        value = error.get(key)
        if isinstance(value, bool):
            continue
        if isinstance(value, int) and 100 <= value <= 599:
            return value
        if isinstance(value, str) and value.isdigit() and 100 <= int(value) <= 599:
            return int(value)
    return None


def error_in(
    extra: Mapping[str, Any] | None, *, request_id: str | None, api_key: str | None
) -> ProviderError | None:
    """The typed error an in-band `error` field reports (None when there is none)."""
    if not extra:
        return None
    error = extra.get("error")
    if error is None or error == {} or error == "":
        return None
    from treadle.llm.http_errors import error_from_payload  # httpx loads with an error only

    payload = {"error": error}
    return error_from_payload(
        status_in(error), payload, to_json(payload), request_id=request_id, api_key=api_key
    )


def with_status_from_body(error: ProviderError, api_key: str | None) -> ProviderError:
    """`error` retyped by the status its own body names (a 200 whose body is `{"error": ...}`).

    Errors that already carry an HTTP status, or whose body names none, are returned unchanged.
    """
    if error.status_code is not None or not error.body:
        return error
    try:
        payload = from_json(error.body)
    except ValueError:
        return error
    if not isinstance(payload, Mapping):
        return error
    status = status_in(payload.get("error"))
    if status is None:
        return error
    from treadle.llm.http_errors import error_from_payload

    return error_from_payload(
        status, payload, error.body, request_id=error.request_id, api_key=api_key
    )


def with_retries(error: ProviderError, retries: int, *, api_key: str | None) -> ProviderError:
    """An in-band `error` as the final error of a turn that spent `retries` retries: its message
    says "after N retries" where the same status in a reply's head would. Unchanged when its
    body is not an error object (a malformed event) or no longer parses (cut to an excerpt)."""
    if not retries or not error.body:
        return error
    try:
        payload = from_json(error.body)
    except ValueError:
        return error
    if not isinstance(payload, Mapping) or "error" not in payload:
        return error
    from treadle.llm.http_errors import error_from_payload

    again = error_from_payload(
        error.status_code, payload, error.body,
        request_id=error.request_id, api_key=api_key, retries=retries,
    )  # fmt: skip
    if type(again) is not type(error):  # not the same classification: keep the original
        return error
    again.body = error.body
    return again


def provider_usage(extra: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Usage a provider reported under its own key (`x_groq.usage`), if any."""
    for value in (extra or {}).values():
        if isinstance(value, Mapping):
            usage = value.get("usage")
            if isinstance(usage, Mapping) and any(k in usage for k in _USAGE_KEYS):
                return dict(usage)
    return None
