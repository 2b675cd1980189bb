"""`RequestUsage`: one entry per model request, beside the session's summed `Usage`.

A pass appends one entry per completion to `out.metadata["request_usage"]` (a tuple, oldest
first): input, output, cached and reasoning tokens, the provider's response id and the request's
latency. Token details come from the reply's `usage.prompt_tokens_details.cached_tokens` and
`usage.completion_tokens_details.reasoning_tokens` when the provider sends them (0 otherwise).
Pure values; no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["RequestUsage", "request_usage_of"]


@dataclass(frozen=True, slots=True)
class RequestUsage:
    """The usage of one model request."""

    input_tokens: int
    """Prompt tokens of this request."""
    output_tokens: int
    """Completion tokens of this request."""
    cached_tokens: int = 0
    """Prompt tokens served from the provider's cache."""
    reasoning_tokens: int = 0
    """Completion tokens spent on hidden reasoning."""
    response_id: str = ""
    """The provider's id of the completion (`chatcmpl-...`), for its logs and support."""
    latency_seconds: float = 0.0
    """Seconds from sending the request to the finished reply."""
    agent: str | None = None
    """The agent whose pass made the request (None for a bare pass)."""

    @property
    def total_tokens(self) -> int:
        """Input plus output tokens."""
        return self.input_tokens + self.output_tokens


def _detail(extra: Mapping[str, Any] | None, group: str, key: str) -> int:
    if not extra:
        return 0
    details = extra.get(group)
    if isinstance(details, Mapping):
        value = details.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else 0
    return 0


def request_usage_of(
    completion: Any, input_tokens: int, output_tokens: int, latency: float, agent: str | None
) -> RequestUsage:
    """The entry for one finished completion (a `ChatCompletion` wire value)."""
    usage = getattr(completion, "usage", None)
    extra = getattr(usage, "model_extra", None) if usage is not None else None
    return RequestUsage(
        input_tokens,
        output_tokens,
        _detail(extra, "prompt_tokens_details", "cached_tokens"),
        _detail(extra, "completion_tokens_details", "reasoning_tokens"),
        str(getattr(completion, "id", "") or ""),
        latency,
        agent,
    )


def entries_of(metadata: Mapping[str, Any]) -> Sequence[RequestUsage]:
    """The request entries recorded in a session's metadata (empty when none)."""
    value = metadata.get("request_usage", ())
    return tuple(v for v in value if isinstance(v, RequestUsage)) if value else ()
