"""The model layer: OpenAI-compatible chat completions over `treadle._http`, retries and limits.

Public face of `treadle.llm`; the modules behind it may move. Nothing here blocks the event loop.
Names are imported on first use (see `_HOMES`), so building a `Provider` never imports httpx or
the HTTP layer.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from treadle.llm.accumulate import StreamAccumulator
    from treadle.llm.client import (
        ModelClient,
        aclose_clients,
        close_all_clients_for_loop,
        get_client,
    )
    from treadle.llm.limiter import EndpointLimiter
    from treadle.llm.provider import Provider
    from treadle.llm.request import CompletionRequest, OfferedTools
    from treadle.llm.sse import SSEDecoder
    from treadle.llm.turn import (
        AssistantTurn,
        AsyncExecutor,
        Executor,
        HttpExecutor,
        ModelExecutor,
        ToolCallPiece,
        TurnDelta,
        coerce_completion,
        request_turn,
        validate_executor,
    )
    from treadle.llm.wire import (
        ChatCompletion,
        ChatCompletionChunk,
        ChatCompletionRequest,
        ChatMessage,
        Choice,
        ChoiceDelta,
        ChoiceDeltaToolCall,
        ChunkChoice,
        CompletionUsage,
        FunctionCall,
        FunctionCallDelta,
        MessageToolCall,
        build_request_body,
    )

# Every name loads on first access: httpx (about 40-100 ms) and the HTTP layer are paid
# by the first request, not by `from treadle import Provider`.
_HOMES = {
    "StreamAccumulator": "accumulate",
    "ModelClient": "client",
    "aclose_clients": "client",
    "close_all_clients_for_loop": "client",
    "get_client": "client",
    "EndpointLimiter": "limiter",
    **{
        name: "turn"
        for name in (
            "AsyncExecutor",
            "Executor",
            "HttpExecutor",
            "ModelExecutor",
            "coerce_completion",
            "validate_executor",
        )
    },
    "CompletionRequest": "request",
    "OfferedTools": "request",
    **{name: "turn" for name in ("AssistantTurn", "ToolCallPiece", "TurnDelta", "request_turn")},
    "Provider": "provider",
    "SSEDecoder": "sse",
    **{
        name: "wire"
        for name in (
            "ChatCompletion",
            "ChatCompletionChunk",
            "ChatCompletionRequest",
            "ChatMessage",
            "Choice",
            "ChoiceDelta",
            "ChunkChoice",
            "FunctionCall",
            "FunctionCallDelta",
            "MessageToolCall",
            "ChoiceDeltaToolCall",
            "CompletionUsage",
            "build_request_body",
        )
    },
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'treadle.llm' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"treadle.llm.{home}"), name)
    globals()[name] = value
    return value


__all__ = [
    "AssistantTurn",
    "AsyncExecutor",
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ChatMessage",
    "Choice",
    "ChoiceDelta",
    "ChoiceDeltaToolCall",
    "ChunkChoice",
    "CompletionRequest",
    "CompletionUsage",
    "EndpointLimiter",
    "Executor",
    "FunctionCall",
    "FunctionCallDelta",
    "HttpExecutor",
    "MessageToolCall",
    "ModelClient",
    "ModelExecutor",
    "OfferedTools",
    "Provider",
    "SSEDecoder",
    "StreamAccumulator",
    "ToolCallPiece",
    "TurnDelta",
    "aclose_clients",
    "build_request_body",
    "close_all_clients_for_loop",
    "coerce_completion",
    "get_client",
    "request_turn",
    "validate_executor",
]
