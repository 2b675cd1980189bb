"""`RequestUsage`: one entry per model request, beside the session's summed `Usage`.

A pass appends one entry per completion to `out.metadata["request_usage"]` (a tuple, oldest
first): input, output, cached and reasoning tokens, the provider's response id, the request's
latency and its request id (the reply's `x-request-id` header, else the response id). Token
details come from the reply's `usage.prompt_tokens_details.cached_tokens` and
`usage.completion_tokens_details.reasoning_tokens` when the provider sends them as ints within
the request's input (cached) or output (reasoning) tokens (0 otherwise); both ids are cut to
`MAX_RESPONSE_ID_CHARS` printable characters (`treadle.errors.clean_id`, as error messages show
them), and a request id with nothing printable left falls back to the response id.
Pure values; no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from treadle._frozen import quick_init
from treadle.errors import MAX_ID_CHARS, clean_id

if TYPE_CHECKING:
    from treadle.session import Usage

__all__ = ["RequestUsage", "request_entries", "request_usage_of"]


@quick_init
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
    request_id: str = ""
    """The reply's `x-request-id` header (what the provider's support asks for), or the
    response id when the reply had none."""

    @property
    def total_tokens(self) -> int:
        """Input plus output tokens."""
        return self.input_tokens + self.output_tokens


#: Characters of a provider's response id kept in an entry (a longer one is cut).
MAX_RESPONSE_ID_CHARS = MAX_ID_CHARS


def _detail(value: Any, whole: int) -> int:
    """A token detail as sent, kept only when it is an int in `0..whole` (its total)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= whole:
        return 0
    return value


def _nested(wire: Any, group: str, key: str) -> Any:
    """`wire[group][key]` of a usage as sent: a `CompletionUsage` (its provider fields), its dict
    (a streamed reply's), or None."""
    if wire is None:
        return None
    # `type(...) is dict` first: a streamed reply's usage and its details are plain dicts, and
    # `isinstance` against the `Mapping` ABC runs a Python-level `__instancecheck__` (four a
    # request).
    fields = wire if type(wire) is dict or isinstance(wire, Mapping) else wire.model_extra
    details = fields.get(group) if fields else None
    if details is not None and (type(details) is dict or isinstance(details, Mapping)):
        return details.get(key)
    return None


def request_usage_of(
    wire: Any,
    response_id: str,
    usage: Usage,
    latency: float,
    request_id: str,
    agent: str | None,
) -> RequestUsage:
    """The entry for one completion: its usage as received (a `CompletionUsage`, its dict, or
    None), its id, the counted `Usage`, the latency, its request id and the agent's name. Ids
    are cleaned as errors clean them (`treadle.errors.clean_id`); a request id with nothing
    printable left falls back to the response id."""
    response = clean_id(response_id)
    return RequestUsage(
        usage.prompt_tokens,
        usage.completion_tokens,
        _detail(_nested(wire, "prompt_tokens_details", "cached_tokens"), usage.prompt_tokens),
        _detail(
            _nested(wire, "completion_tokens_details", "reasoning_tokens"), usage.completion_tokens
        ),
        response,
        latency,
        agent,
        clean_id(request_id) or response,
    )


def request_entries(
    entries: Sequence[tuple[Any, str, Usage, float, str]], agent: str | None
) -> tuple[RequestUsage, ...]:
    """The entries of a pass from what each round kept:
    `(wire usage, id, usage, latency, request id)`."""
    return tuple(request_usage_of(*entry, agent) for entry in entries)
