"""The model layer: OpenAI-compatible chat completions over httpx, with retries and limits.

Public face of `treadle.llm`; the modules behind it may move. Nothing here blocks the event loop.
`AiohttpTransport` is imported on first use: aiohttp's import (about 170 ms, most of it building
SSL contexts) is paid by the first request, not by `import treadle`.
"""

from typing import TYPE_CHECKING, Any

from treadle.llm.accumulate import StreamAccumulator
from treadle.llm.client import ModelClient, aclose_clients, close_all_clients_for_loop, get_client
from treadle.llm.limiter import EndpointLimiter
from treadle.llm.provider import Provider
from treadle.llm.sse import SSEDecoder
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

if TYPE_CHECKING:
    from treadle.llm.transport import AiohttpTransport


def __getattr__(name: str) -> Any:
    if name == "AiohttpTransport":
        from treadle.llm.transport import AiohttpTransport

        return AiohttpTransport
    raise AttributeError(f"module 'treadle.llm' has no attribute {name!r}")


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
