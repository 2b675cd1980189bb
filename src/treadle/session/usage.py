"""`Usage`: cumulative token usage of a session, summed over completions. Pure value, no I/O."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from treadle._frozen import quick_init

__all__ = ["Usage", "merged_usage"]


@quick_init
@dataclass(frozen=True, slots=True)
class Usage:
    """Token usage summed over the completions that produced a session."""

    prompt_tokens: int = 0
    """Tokens sent to the model, over all requests."""
    completion_tokens: int = 0
    """Tokens the model generated, over all requests."""
    total_tokens: int = 0
    """`prompt_tokens + completion_tokens` as the provider reported it."""
    requests: int = 0
    """Number of completions counted."""

    def __add__(self, other: Usage) -> Usage:
        if not isinstance(other, Usage):
            return NotImplemented
        return Usage(
            self.prompt_tokens + other.prompt_tokens,
            self.completion_tokens + other.completion_tokens,
            self.total_tokens + other.total_tokens,
            self.requests + other.requests,
        )

    @classmethod
    def from_wire(cls, usage: Mapping[str, Any] | None) -> Usage:
        """One request's usage from an OpenAI `usage` object (missing fields count as 0)."""
        if not usage:
            return cls(requests=1)
        prompt = int(usage.get("prompt_tokens") or 0)
        completion = int(usage.get("completion_tokens") or 0)
        total = int(usage.get("total_tokens") or (prompt + completion))
        return cls(prompt, completion, total, 1)

    def to_dict(self) -> dict[str, int]:
        """The usage as a plain dict (for JSON)."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
            "requests": self.requests,
        }


def merged_usage(mine: Usage, theirs: Usage, shared: Usage) -> Usage:
    """Both sides' usage with what they share (a common ancestor's) counted once."""

    def field(x: int, y: int, s: int) -> int:
        return max(x + y - s, x, y)  # never less than either side spent

    return Usage(
        field(mine.prompt_tokens, theirs.prompt_tokens, shared.prompt_tokens),
        field(mine.completion_tokens, theirs.completion_tokens, shared.completion_tokens),
        field(mine.total_tokens, theirs.total_tokens, shared.total_tokens),
        field(mine.requests, theirs.requests, shared.requests),
    )
