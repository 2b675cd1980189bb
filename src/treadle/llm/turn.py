"""`request_turn`: one model turn, from a `CompletionRequest` to a finished `AssistantTurn`.

This is the whole seam between the pass and the wire: the loop hands over a request and gets back
the assistant row's payload, the usage and the finish reason. Streaming is accumulated here, and
the loop sees typed `TurnDelta`s (text and tool-call pieces) as they arrive; a whole reply gives
one delta, so callbacks see the same shape either way. Wire types never leave this package except
as the opaque `raw` chunk handed to `on_event` and the `completion` a guardrail may inspect.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from treadle.llm.accumulate import StreamAccumulator
from treadle.llm.executor import HttpExecutor, ModelExecutor, call_complete
from treadle.llm.request import CompletionRequest
from treadle.llm.wire import (
    ChatCompletion,
    ChatCompletionChunk,
    ChoiceDelta,
    ChoiceDeltaToolCall,
    ChunkChoice,
    FunctionCallDelta,
)
from treadle.session import Usage

__all__ = ["AssistantTurn", "ToolCallPiece", "TurnDelta", "request_turn"]


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


@dataclass(frozen=True, slots=True)
class AssistantTurn:
    """A finished model turn: the assistant row's payload, its usage and why it ended."""

    payload: dict[str, Any]
    """The assistant row payload: `content`, `tool_calls`, and provider fields kept as sent."""
    usage: Usage
    """This request's usage (`requests == 1`)."""
    finish_reason: str | None
    """The provider's finish reason (`stop`, `tool_calls`, `length`, ...)."""
    completion: ChatCompletion
    """The reply as received (what `after` guardrails inspect)."""


DeltaSink = Callable[[TurnDelta], None]


async def request_turn(
    executor: ModelExecutor, request: CompletionRequest, on_delta: DeltaSink | None = None
) -> AssistantTurn:
    """Ask `executor` for one turn; hand each delta to `on_delta` as it arrives."""
    if request.stream and isinstance(executor, HttpExecutor):
        acc = StreamAccumulator()
        async for chunk in executor.astream(request):
            acc.add(chunk)
            if on_delta is not None:
                on_delta(_delta_of(chunk))
        completion = acc.result()
    else:
        completion = await call_complete(executor, request)
        if on_delta is not None:
            on_delta(_delta_of(_as_chunk(completion)))
    return turn_of(completion)


def turn_of(completion: ChatCompletion) -> AssistantTurn:
    """The `AssistantTurn` of one whole completion."""
    message = completion.message
    payload: dict[str, Any] = {"content": message.content}
    if message.tool_calls:
        payload["tool_calls"] = [
            {
                "id": call.id,
                "type": call.type or "function",
                "function": {"name": call.function.name, "arguments": call.function.arguments},
            }
            for call in message.tool_calls
        ]
    extra = message.model_extra
    if extra:
        # Keep provider fields such as reasoning_content; `role` is implied by the row kind.
        for key, value in extra.items():
            if key != "role" and value is not None:
                payload[key] = value
    usage = completion.usage
    return AssistantTurn(
        payload,
        Usage.from_wire(usage.model_dump() if usage is not None else None),
        completion.finish_reason,
        completion,
    )


def _delta_of(chunk: ChatCompletionChunk) -> TurnDelta:
    text: str | None = None
    pieces: list[ToolCallPiece] = []
    for choice in chunk.choices:
        delta = choice.delta
        if delta.content:
            text = delta.content if text is None else text + delta.content
        for call in delta.tool_calls or ():
            fn = call.function
            pieces.append(
                ToolCallPiece(
                    call.index,
                    call.id,
                    fn.name if fn is not None else None,
                    (fn.arguments or "") if fn is not None else "",
                )
            )
    return TurnDelta(text, tuple(pieces), chunk)


def _as_chunk(completion: ChatCompletion) -> ChatCompletionChunk:
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
