"""Maps HTTP outcomes (error statuses, httpx transport errors) to `treadle.errors` exceptions.

Every message is one sentence saying what happened and what to do. This module must never put an
API key into a message or body excerpt: the caller passes the key so it can be redacted.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx
from pydantic_core import from_json

from treadle.errors import (
    AuthenticationError,
    ContextLengthError,
    MalformedResponse,
    ProviderConnectionError,
    ProviderError,
    ProviderTimeout,
    RateLimitError,
)

__all__ = [
    "BODY_EXCERPT_CHARS",
    "StaleConnectionError",
    "error_from_payload",
    "error_from_response",
    "error_from_transport",
    "excerpt",
]


class StaleConnectionError(httpx.RemoteProtocolError):
    """The connection closed before any byte of the response arrived.

    Typical of a pooled keep-alive connection the server had already closed (llama.cpp's server
    closes every connection shortly after a streamed reply while still advertising keep-alive).
    The client retries such a request once at once, without counting it as a retry.
    """


BODY_EXCERPT_CHARS = 2000
"""Characters of an error body kept on `ProviderError.body`."""
_MESSAGE_CHARS = 300

_CONTEXT_MARKERS = (
    "context_length_exceeded",  # OpenAI code
    "exceed_context_size",  # llama.cpp type `exceed_context_size_error`
    "maximum context length",  # vLLM / OpenAI message
    "context length",
    "context window",
    "too many tokens",
)


def excerpt(body: bytes | str, api_key: str | None = None, limit: int = BODY_EXCERPT_CHARS) -> str:
    """The first `limit` characters of `body` as text, with the API key redacted."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    if len(text) > limit:
        text = text[:limit] + "…[truncated]"
    if api_key and api_key in text:
        text = text.replace(api_key, "***")
    return text


def _error_fields(payload: Any) -> tuple[str, str, str]:
    """(message, type, code) of an OpenAI-style `{"error": {...}}` body, empty when absent."""
    error = payload.get("error") if isinstance(payload, Mapping) else None
    if isinstance(error, str):
        return error, "", ""
    if not isinstance(error, Mapping):
        detail = (
            payload.get("detail") or payload.get("message") if isinstance(payload, Mapping) else ""
        )
        return str(detail or ""), "", ""
    return (
        str(error.get("message") or ""),
        str(error.get("type") or ""),
        str(error.get("code") or ""),
    )


def _is_context_length(message: str, type_: str, code: str) -> bool:
    haystack = f"{code} {type_} {message}".lower()
    return any(marker in haystack for marker in _CONTEXT_MARKERS)


def error_from_payload(
    status: int | None,
    payload: Any,
    body: bytes | str,
    *,
    request_id: str | None,
    api_key: str | None,
    retries: int = 0,
) -> ProviderError:
    """The typed error for an error `payload` (parsed body) answered with HTTP `status`."""
    message, type_, code = _error_fields(payload)
    said = excerpt(message, api_key, _MESSAGE_CHARS) if message else ""
    said_part = f": {said}" if said else ""
    kw: dict[str, Any] = {
        "status_code": status,
        "body": excerpt(body, api_key),
        "request_id": request_id,
    }
    after = f" after {retries} retries" if retries else ""
    if status in (401, 403):
        return AuthenticationError(
            f"The endpoint rejected the API key{said_part}; check OPENAI_API_KEY or "
            "Provider(api_key=...).",
            **kw,
        )
    if status == 429:
        return RateLimitError(
            f"The endpoint kept rate-limiting requests{after}{said_part}; lower "
            "requests_per_minute or max_concurrent_requests, or raise max_retries.",
            **kw,
        )
    if status in (400, 413, 422, None) and _is_context_length(message, type_, code):
        return ContextLengthError(
            f"The request does not fit the model's context window{said_part}; shorten or "
            "compress the transcript.",
            **kw,
        )
    if status is not None and status >= 500:
        return ProviderError(
            f"The endpoint failed with a server error{after}{said_part}; retry later.", **kw
        )
    return ProviderError(
        f"The endpoint refused the request{said_part}; fix the request or provider options.",
        **kw,
    )


def error_from_response(
    response: httpx.Response, *, api_key: str | None, retries: int = 0
) -> ProviderError:
    """The typed error for a non-2xx `response` whose body has been read."""
    body = response.content
    try:
        payload = from_json(body) if body else None
    except ValueError:
        payload = None
    return error_from_payload(
        response.status_code,
        payload,
        body,
        request_id=response.headers.get("x-request-id"),
        api_key=api_key,
        retries=retries,
    )


def error_from_transport(exc: httpx.TransportError, *, url: str, retries: int) -> ProviderError:
    """The typed error for a request that got no usable response (connect, read, disconnect)."""
    after = f" after {retries} retries" if retries else ""
    if isinstance(exc, httpx.TimeoutException):
        phase = "connecting to" if isinstance(exc, httpx.ConnectTimeout) else "waiting for"
        return ProviderTimeout(
            f"Timed out {phase} {url}{after}; raise Provider.timeout or check the server."
        )
    if isinstance(exc, httpx.ConnectError):
        return ProviderConnectionError(
            f"Could not connect to {url}{after} ({exc}); check base_url and that the server runs."
        )
    return ProviderConnectionError(
        f"The connection to {url} failed{after} ({type(exc).__name__}: {exc}); retry later."
    )


def malformed(
    what: str, body: bytes | str = b"", *, request_id: str | None = None
) -> MalformedResponse:
    """A `MalformedResponse` saying `what` was wrong with the reply."""
    return MalformedResponse(
        f"The endpoint's reply is not a valid chat completion: {what}; retry or check the server.",
        body=excerpt(body) if body else None,
        request_id=request_id,
    )
