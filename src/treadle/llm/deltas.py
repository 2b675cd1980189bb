"""The deltas of a streamed turn: `TurnDelta` and its `ToolCallPiece`s, from chunks or dicts.

A typed delta (`delta_of`) carries the provider's chunk (`raw`, what `on_event` receives); a
pass's own events need only the text and the tool-call pieces, which `pieces_of` reads from the
folded event dicts without building a chunk per event. A whole reply is one chunk (`as_chunk`),
so callbacks see the same shape either way. Pure values; no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from treadle.llm.wire import (
    ChatCompletion,
    ChatCompletionChunk,
    ChoiceDelta,
    ChoiceDeltaToolCall,
    ChunkChoice,
    FunctionCallDelta,
)
from treadle.session.rows import text_of_content

__all__ = [
    "DeltaSink",
    "PieceSink",
    "ToolCallPiece",
    "TurnDelta",
    "as_chunk",
    "delta_of",
    "pieces_of",
    "with_pieces",
]


@dataclass(frozen=True, slots=True)
class ToolCallPiece:
    """A piece of a streamed tool call: id and name arrive first, arguments in pieces."""

    index: int
    call_id: str | None
    name: str | None
    arguments: str


@dataclass(frozen=True, slots=True)
class TurnDelta:
    """What one stream chunk added: text and tool-call pieces, and the chunk itself (`raw`)."""

    text: str | None
    tool_calls: tuple[ToolCallPiece, ...]
    raw: ChatCompletionChunk


DeltaSink = Callable[[TurnDelta], None]
PieceSink = Callable[[str | None, tuple[ToolCallPiece, ...]], None]


def delta_of(chunk: ChatCompletionChunk) -> TurnDelta:
    text: str | None = None
    pieces: list[ToolCallPiece] = []
    for choice in chunk.choices:
        delta = choice.delta
        piece = text_of_content(delta.content)
        if piece:
            text = piece if text is None else text + piece
        for call in delta.tool_calls or ():
            fn = call.function
            pieces.append(
                ToolCallPiece(
                    call.index if call.index is not None else 0,
                    call.id,
                    fn.name if fn is not None else None,
                    (fn.arguments or "") if fn is not None else "",
                )
            )
    return TurnDelta(text, tuple(pieces), chunk)


def pieces_of(event: Mapping[str, Any]) -> tuple[str | None, tuple[ToolCallPiece, ...]]:
    """`delta_of`'s text and pieces, read from a folded event dict (`parse_event`)."""
    text: str | None = None
    pieces: list[ToolCallPiece] = []
    for choice in event.get("choices", ()):
        delta = choice.get("delta")
        if not delta:
            continue
        piece = text_of_content(delta.get("content"))
        if piece:
            text = piece if text is None else text + piece
        for call in delta.get("tool_calls") or ():
            fn, index = call.get("function"), call.get("index")
            pieces.append(
                ToolCallPiece(
                    index if index is not None else 0,
                    call.get("id"),
                    fn.get("name") if fn is not None else None,
                    (fn.get("arguments") or "") if fn is not None else "",
                )
            )
    return text, tuple(pieces)


def with_pieces(on_delta: DeltaSink | None, on_pieces: PieceSink | None) -> DeltaSink | None:
    """`on_delta`, also handing each delta's text and pieces to `on_pieces` when given."""
    if on_pieces is None:
        return on_delta

    def both(delta: TurnDelta) -> None:
        if on_delta is not None:
            on_delta(delta)
        on_pieces(delta.text, delta.tool_calls)

    return both


def as_chunk(completion: ChatCompletion) -> ChatCompletionChunk:
    """A whole completion as one stream chunk, so callbacks see the same shape either way."""
    message = completion.message
    calls = None
    if message.tool_calls:
        calls = [
            ChoiceDeltaToolCall(
                index=i,
                id=call.id,
                type=call.type,
                function=FunctionCallDelta(
                    name=call.function.name, arguments=call.function.arguments
                ),
            )
            for i, call in enumerate(message.tool_calls)
        ]
    delta = ChoiceDelta(role="assistant", content=message.content, tool_calls=calls)
    return ChatCompletionChunk(
        id=completion.id,
        created=completion.created,
        model=completion.model,
        choices=[ChunkChoice(index=0, delta=delta, finish_reason=completion.finish_reason)],
        usage=completion.usage,
    )
