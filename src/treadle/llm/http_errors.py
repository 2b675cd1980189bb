"""Maps HTTP outcomes (error statuses, `treadle._http` errors) to `treadle.errors` exceptions.

Failures are classified by what the user should do: wrong URL or protocol
(`NotOpenAIEndpointError`, `ProtocolMismatchError`), bad key (`AuthenticationError`), bad model
(`ModelNotFoundError`), bad request (`ProviderError` 4xx, `ContextLengthError`, a 5xx that says it
could not parse the request: `InvalidRequestError`), overloaded (`RateLimitError`, 5xx) or down
(`ProviderConnectionError`, `ProviderTimeout`). Only the last two are worth a retry
(`treadle.llm.retry.is_retryable_error`). Every message is one sentence saying what happened and
what to do. Error mapping takes plain values (status, headers, body): the fast path builds no
`httpx.Response`. This module must never put an API key into a message or body excerpt: the
caller passes the key so it can be redacted.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pydantic_core import from_json

from treadle._http.errors import (
    ConnectError,
    ConnectTimeout,
    DecodeError,
    HTTPError,
    InvalidHeader,
    InvalidURL,
    MalformedReply,
    OpenFilesExhausted,
    PoolClosed,
    PoolTimeout,
    ReadTimeout,
    TLSError,
)
from treadle.errors import (
    AuthenticationError,
    ConfigurationError,
    ContextLengthError,
    HostNotFoundError,
    InvalidRequestError,
    MalformedResponse,
    ModelNotFoundError,
    NotOpenAIEndpointError,
    ProtocolMismatchError,
    ProviderConnectionError,
    ProviderError,
    ProviderTimeout,
    RateLimitError,
    TreadleError,
)

__all__ = [
    "BODY_EXCERPT_CHARS",
    "MIN_SECRET_CHARS",
    "after_retries",
    "error_from_payload",
    "error_from_status",
    "error_from_transport",
    "excerpt",
    "html_reply_error",
    "is_certificate_failure",
    "redact",
]


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


MIN_SECRET_CHARS = 8
"""Keys shorter than this are placeholders (`OPENAI_API_KEY=x` for a local server), not secrets:
redacting them would mangle every word that contains them."""

# Markers of a 5xx that the request itself caused: the same request fails the same way again.
_REQUEST_FAULT_MARKERS = (
    "failed to parse",  # llama.cpp: "Failed to parse tool call arguments as JSON"
    "could not parse",
    "unable to parse",
    "cannot parse",
    "json.exception",  # nlohmann::json errors surfaced by llama.cpp
    "invalid request",
)
_MODEL_MISSING_MARKERS = ("not found", "does not exist", "not exist", "unknown model", "no model")


def redact(text: str, api_key: str | None) -> str:
    """`text` with every whole-token occurrence of `api_key` replaced by `***`.

    A token is bounded by characters that cannot be part of a key (not a letter, digit, `_` or
    `-`), so the key's characters inside a longer word stay; keys shorter than
    `MIN_SECRET_CHARS` are not secrets and are left alone.
    """
    if not api_key or len(api_key) < MIN_SECRET_CHARS or api_key not in text:
        return text
    return re.sub(rf"(?<![\w-]){re.escape(api_key)}(?![\w-])", "***", text)


def excerpt(body: bytes | str, api_key: str | None = None, limit: int = BODY_EXCERPT_CHARS) -> str:
    """The first `limit` characters of `body` as text, with the API key redacted."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    # Redact before cutting: a key across the cut would otherwise leave its first half.
    text = redact(text[: limit + 256], api_key)
    if len(text) > limit:
        text = text[:limit] + "…[truncated]"
    return text


def after_retries(retries: int) -> str:
    """` after 1 retry` / ` after 3 retries`, or nothing before the first retry."""
    if not retries:
        return ""
    return f" after {retries} {'retry' if retries == 1 else 'retries'}"


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


def _base_of(url: str) -> str:
    """The base URL of a chat-completions URL (what the user passed as `base_url`)."""
    return url.removesuffix("/chat/completions")


def _lower_bytes(body: bytes | str) -> bytes:
    return (body.encode("utf-8", "replace") if isinstance(body, str) else body)[:4096].lower()


def _is_openai_error(payload: Any) -> bool:
    """True for an OpenAI-style error body: `{"error": {...}}` or `{"error": "..."}`."""
    return isinstance(payload, Mapping) and isinstance(payload.get("error"), Mapping | str)


def _not_openai(url: str | None, said_part: str, kw: dict[str, Any]) -> ProviderError:
    where = url or "the base URL"
    return NotOpenAIEndpointError(
        f"The server has no OpenAI-compatible chat-completions endpoint at {where}{said_part}; "
        "the base URL is wrong: check base_url (it usually ends in /v1).",
        **kw,
    )


def html_reply_error(
    url: str, headers: Mapping[str, str], body: bytes = b""
) -> NotOpenAIEndpointError | None:
    """For a 200 reply that is not an API reply: `NotOpenAIEndpointError` when it is a web page.

    Called only once the reply failed to parse (never on the fast path of a good reply).
    """
    if "text/html" not in (headers.get("content-type") or "").lower():
        return None
    return NotOpenAIEndpointError(
        f"The server at {_base_of(url)} answered with a web page, not an OpenAI-compatible "
        "chat completion; the base URL is wrong: check base_url (it usually ends in /v1).",
        status_code=200,
        body=excerpt(body) if body else None,
        request_id=headers.get("x-request-id"),
    )


def _joined(error: ProviderError, said: str) -> ProviderError:
    """`error` with "provided.; check" read as "provided. Check": the server's sentence keeps its
    own stop (its text stays verbatim) and the advice after it starts a sentence."""
    joint = f"{said}; "
    at = error.message.find(joint) if said.endswith((".", "!", "?")) else -1
    if at >= 0:
        rest = error.message[at + len(joint) :]
        error.message = f"{error.message[:at]}{said} {rest[:1].upper()}{rest[1:]}"
        error.args = (error.message,)
    return error


def _classify_payload(
    status: int | None,
    payload: Any,
    body: bytes | str,
    *,
    request_id: str | None,
    api_key: str | None,
    retries: int = 0,
    url: str | None = None,
) -> ProviderError:
    """`error_from_payload` before `_joined` tidies the seam of its message."""
    message, type_, code = _error_fields(payload)
    said = excerpt(message, api_key, _MESSAGE_CHARS).rstrip() if message else ""
    said_part = f": {said}" if said else ""
    kw: dict[str, Any] = {
        "status_code": status,
        "body": excerpt(body, api_key),
        "request_id": request_id,
    }
    after = after_retries(retries)
    lowered = f"{code} {type_} {message}".lower()
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
    if (
        status in (400, 404)
        and _is_openai_error(payload)
        and "model" in lowered
        and (code == "model_not_found" or any(m in lowered for m in _MODEL_MISSING_MARKERS))
    ):
        return ModelNotFoundError(
            f"The endpoint does not serve this model{said_part}; check Provider.model "
            "against the endpoint's /models list.",
            **kw,
        )
    if status == 400 and b"plain http request was sent to https port" in _lower_bytes(body):
        # nginx's answer to http:// at its TLS port
        base = _base_of(url or "")
        secure = "https:" + base[len("http:") :] if base.startswith("http:") else "https://"
        return ProtocolMismatchError(
            f"The server at {base or 'the base URL'} speaks HTTPS; use base_url={secure}.", **kw
        )
    if status in (404, 405, 501):
        # A route the server does not have: the base URL is wrong (or not an OpenAI server).
        return _not_openai(url, said_part, kw)
    if status in (400, 413, 422, None) and _is_context_length(message, type_, code):
        return ContextLengthError(
            f"The request does not fit the model's context window{said_part}; shorten or "
            "compress the transcript.",
            **kw,
        )
    if status is not None and status >= 500:
        if any(marker in lowered for marker in _REQUEST_FAULT_MARKERS):
            return InvalidRequestError(
                f"The endpoint could not process this request{said_part}; the same request "
                "fails the same way again: check the tools' schemas, or try another model.",
                **kw,
            )
        return ProviderError(
            f"The endpoint failed with a server error{after}{said_part}; retry later.", **kw
        )
    return ProviderError(
        f"The endpoint refused the request{said_part}; fix the request or provider options.",
        **kw,
    )


def error_from_payload(
    status: int | None,
    payload: Any,
    body: bytes | str,
    *,
    request_id: str | None,
    api_key: str | None,
    retries: int = 0,
    url: str | None = None,
) -> ProviderError:
    """The typed error for an error `payload` (parsed body, None if not JSON) with HTTP `status`.

    `url` is the request's URL, named in messages about a wrong base URL.
    """
    error = _classify_payload(
        status, payload, body, request_id=request_id, api_key=api_key, retries=retries, url=url
    )
    message = _error_fields(payload)[0]
    said = excerpt(message, api_key, _MESSAGE_CHARS).rstrip() if message else ""
    return _joined(error, said)


def error_from_status(
    status: int,
    headers: Mapping[str, str],
    body: bytes,
    *,
    api_key: str | None,
    retries: int = 0,
    url: str | None = None,
) -> ProviderError:
    """The typed error for a non-2xx reply, from plain values (no `httpx.Response` needed).

    `headers` is any case-insensitive mapping (`treadle._http.reply.Headers`).
    """
    try:
        payload = from_json(body) if body else None
    except ValueError:
        payload = None
    return error_from_payload(
        status,
        payload,
        body,
        request_id=headers.get("x-request-id"),
        api_key=api_key,
        retries=retries,
        url=url,
    )


def error_from_transport(exc: HTTPError, *, url: str, retries: int) -> TreadleError:
    """The typed error for a request that got no usable reply: the one table from the HTTP
    layer's errors to what users see (`ConfigurationError` for what no retry can fix)."""
    after = after_retries(retries)
    if isinstance(exc, OpenFilesExhausted):
        return ConfigurationError(
            f"The process ran out of file descriptors connecting to {url} ({exc}); raise the "
            "open-files limit (`ulimit -n`) or lower max_concurrent_requests."
        )
    if isinstance(exc, PoolClosed):
        return ConfigurationError(
            f"The model client for {url} was closed (aclose_clients()) under this request ({exc}); "
            "close clients only after the passes that use them have finished."
        )
    if isinstance(exc, InvalidHeader | InvalidURL):
        return ConfigurationError(str(exc))
    if isinstance(exc, TLSError) and exc.plaintext_peer:
        base = _base_of(url)
        return ProtocolMismatchError(
            f"The server at {base} does not speak TLS ({exc}); if it serves plain HTTP, use "
            f"base_url=http:{base[len('https:') :]}."
        )
    if isinstance(exc, MalformedReply):  # not valid HTTP/1.1, or not read: the same next time
        return MalformedResponse(
            f"The server at {url} sent a reply this client cannot read{after}: {exc} A retry "
            "would get the same; check base_url points at an OpenAI-compatible HTTP API."
        )
    if isinstance(exc, DecodeError):  # over the size cap or corrupt: a retry fails the same way
        return MalformedResponse(
            f"The reply from {url} could not be read{after}: {exc} A retry would fail the same "
            "way; check the server (or what it compresses)."
        )
    if isinstance(exc, PoolTimeout):
        return ProviderTimeout(
            f"Timed out waiting for a free connection to {url}{after} ({exc}); raise "
            "Provider.pool_timeout or close streams you stop reading."
        )
    if isinstance(exc, ConnectTimeout | ReadTimeout):
        phase = "connecting to" if isinstance(exc, ConnectTimeout) else "waiting for"
        return ProviderTimeout(
            f"Timed out {phase} {url}{after}; raise Provider.timeout or check the server."
        )
    if isinstance(exc, TLSError):
        return ProviderConnectionError(
            f"The TLS handshake with {url} failed{after} ({exc}); check verify= and cert= on "
            "the Provider, or the server's certificate."
        )
    if isinstance(exc, ConnectError) and exc.no_such_host:
        return HostNotFoundError(f"Cannot reach {url}: {exc} A retry would fail the same way.")
    if isinstance(exc, ConnectError):
        return ProviderConnectionError(
            f"Could not connect to {url}{after} ({exc}); check base_url and that the server runs."
        )
    return ProviderConnectionError(
        f"The connection to {url} failed{after} ({type(exc).__name__}: {exc}); retry later."
    )


def is_certificate_failure(exc: HTTPError) -> bool:
    """True for a TLS failure no retry fixes: the certificate was refused (either side)."""
    return (
        isinstance(exc, TLSError) and not exc.plaintext_peer and "certificate" in str(exc).lower()
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
