"""`CompletionRequest`: one completion a pass asks for, and the body it sends.

The request holds rows (values of the `session` layer) and the tools offered, seen only through
`OfferedTools` (their encoded schemas), so this layer never imports the tools layer above it.
The body is joined from each row's cached JSON: nothing is re-encoded per round.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from treadle.errors import ConfigurationError
from treadle.llm.provider import Provider
from treadle.llm.wire import build_request_body
from treadle.session import ChunkRow

__all__ = ["CompletionRequest", "OfferedTools"]


class OfferedTools(Protocol):
    """What a request needs of the tools it offers (`treadle.tools.ToolSet` is one)."""

    @property
    def names(self) -> list[str]:
        """The tool names, in the order they are offered."""
        ...

    def schemas(self) -> list[dict[str, Any]]:
        """The OpenAI tool schemas."""
        ...

    def schemas_json(self) -> bytes | None:
        """The schemas as one encoded JSON array (None when no tool is offered)."""
        ...

    def __contains__(self, name: object) -> bool: ...

    def __len__(self) -> int: ...


@dataclass(slots=True)
class CompletionRequest:
    """One completion a pass asks for: the provider, the rows to send and the tools offered."""

    session_id: str
    """Id of the output session being produced."""
    provider: Provider | None
    """The endpoint and its options (None for executors that need none)."""
    agent_rows: Sequence[ChunkRow]
    """The agent session's rows (system prompt), sent first."""
    rows: Sequence[ChunkRow]
    """The transcript so far (user rows, then the pass's rows)."""
    tools: OfferedTools
    """The tools offered to the model this round."""
    stream: bool = False
    """Whether the pass wants the reply streamed."""
    messages_json: Sequence[bytes] = field(default_factory=tuple)
    """Each message of `agent_rows + rows`, already JSON-encoded (the hot path joins these)."""
    extra: Mapping[str, Any] | None = None
    """Request fields that override the provider's for this request only (e.g. tool_choice)."""

    def messages(self) -> list[dict[str, Any]]:
        """The messages as plain OpenAI dicts (agent rows first)."""
        return [row.to_message() for row in (*self.agent_rows, *self.rows)]

    def tool_schemas(self) -> list[dict[str, Any]]:
        """The OpenAI tool schemas offered."""
        return self.tools.schemas()

    def body(self) -> bytes:
        """The JSON request body, joined from cached row encodings."""
        if self.provider is None:
            raise ConfigurationError("this request has no provider; pass agent_provider=...")
        messages = self.messages_json or [r.message_json() for r in (*self.agent_rows, *self.rows)]
        return build_request_body(
            self.provider, messages, self.tools.schemas_json(), stream=self.stream, extra=self.extra
        )
