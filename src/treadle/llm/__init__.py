"""The model layer: OpenAI-compatible chat completions over httpx, with retries and limits.

Public face of `treadle.llm`; the modules behind it may move. Nothing here blocks the event loop.
"""

from treadle.llm.accumulate import StreamAccumulator
from treadle.llm.client import ModelClient, aclose_clients, close_all_clients_for_loop, get_client
from treadle.llm.limiter import EndpointLimiter
from treadle.llm.provider import Provider
from treadle.llm.sse import SSEDecoder
from treadle.llm.transport import AiohttpTransport
from treadle.llm.wire import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatMessage,
    Choice,
    ChoiceDelta,
    ChunkChoice,
    FunctionCall,
    FunctionCallDelta,
    ToolCall,
    ToolCallDelta,
    Usage,
    build_request_body,
)

__all__ = [
    "AiohttpTransport",
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ChatMessage",
    "Choice",
    "ChoiceDelta",
    "ChunkChoice",
    "EndpointLimiter",
    "FunctionCall",
    "FunctionCallDelta",
    "ModelClient",
    "Provider",
    "SSEDecoder",
    "StreamAccumulator",
    "ToolCall",
    "ToolCallDelta",
    "Usage",
    "aclose_clients",
    "build_request_body",
    "close_all_clients_for_loop",
    "get_client",
]
