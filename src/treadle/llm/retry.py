"""The one retry policy of Treadle's model client: what to retry and how long to wait.

Retried: HTTP 408, 429 and 5xx, and transport errors where no usable response arrived (refused,
reset, disconnected, timeouts). Never retried: what fails the same way every time: other 4xx, a
wrong base URL or scheme (`NotOpenAIEndpointError`, `ProtocolMismatchError`), an unknown model, a
5xx that says the request could not be parsed (`InvalidRequestError`). A reused keep-alive
connection the server had closed is re-sent once at once, outside this policy (the request never
reached the server). Waits use full-jitter exponential backoff, or the server's `Retry-After` /
`retry-after-ms` (capped). Pure functions: this module never sleeps or does I/O itself.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Mapping

from treadle.errors import (
    HostNotFoundError,
    InvalidRequestError,
    ModelNotFoundError,
    NotOpenAIEndpointError,
    ProtocolMismatchError,
    ProviderConnectionError,
    ProviderError,
    ProviderTimeout,
)

__all__ = [
    "MAX_BACKOFF_SECONDS",
    "MAX_RETRY_AFTER_SECONDS",
    "backoff_delay",
    "is_retryable_error",
    "is_retryable_status",
    "parse_retry_after",
]

MAX_BACKOFF_SECONDS = 8.0
"""Upper bound of one jittered backoff wait."""
MAX_RETRY_AFTER_SECONDS = 60.0
"""A server's `Retry-After` is honoured up to this many seconds (then the wait is capped)."""

_rng = random.Random()


def is_retryable_status(status: int) -> bool:
    """True for statuses worth another attempt: 408, 429 and every 5xx."""
    return status in (408, 429) or 500 <= status <= 599


# Failures that repeat identically: wrong URL or scheme, unknown model, an unparseable request.
_NEVER_RETRIED = (
    NotOpenAIEndpointError,
    ProtocolMismatchError,
    ModelNotFoundError,
    InvalidRequestError,
)


def is_retryable_error(error: ProviderError) -> bool:
    """True when sending the same request again can succeed (the endpoint is busy or down)."""
    if isinstance(
        error,
        NotOpenAIEndpointError
        | ProtocolMismatchError
        | HostNotFoundError
        | ModelNotFoundError
        | InvalidRequestError,
    ):
        return False
    if error.status_code is not None:
        return is_retryable_status(error.status_code)
    return isinstance(error, ProviderConnectionError | ProviderTimeout)


def parse_retry_after(headers: Mapping[str, str], now: float | None = None) -> float | None:
    """Seconds to wait according to `retry-after-ms` or `Retry-After` (seconds or HTTP date)."""
    raw_ms = headers.get("retry-after-ms")
    if raw_ms:
        try:
            value = float(raw_ms) / 1000.0
        except ValueError:
            value = math.nan
        if math.isfinite(value) and value >= 0:
            return min(value, MAX_RETRY_AFTER_SECONDS)
    raw = headers.get("retry-after")
    if not raw:
        return None
    raw = raw.strip()
    try:
        value = float(raw)
    except ValueError:
        import email.utils  # an HTTP date is rare: not worth 20 ms of every import

        try:
            when = email.utils.parsedate_to_datetime(raw)
        except (TypeError, ValueError, IndexError):
            return None
        value = when.timestamp() - (time.time() if now is None else now)
    if not math.isfinite(value):
        return None
    return min(max(value, 0.0), MAX_RETRY_AFTER_SECONDS)


def backoff_delay(attempt: int, base: float, retry_after: float | None = None) -> float:
    """Seconds to wait before retry number `attempt` (0-based).

    A server-given `retry_after` wins (plus a little jitter so a crowd does not return at once);
    otherwise full jitter over `base * 2**attempt`, capped at `MAX_BACKOFF_SECONDS`.
    """
    if retry_after is not None:
        return retry_after + _rng.uniform(0.0, min(base, 1.0) * 0.1)
    ceiling = min(MAX_BACKOFF_SECONDS, base * (2.0**attempt))
    return _rng.uniform(0.0, ceiling)
