"""`ScriptedExecutor`: a pass executor that replies from a script instead of calling a model.

For tests that should exercise the loop, tools and sandbox without HTTP. Each completion the pass
asks for takes the next scripted reply: a text, some tool calls, a ready completion, a function of
the request, or an exception to raise. Every request is recorded for assertions.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeAlias

import pydantic_core

from treadle.errors import ConfigurationError
from treadle.llm import ChatCompletion, CompletionRequest, coerce_completion

__all__ = ["Reply", "ScriptedExecutor", "text", "tool_call", "tool_calls"]

#: What a script step may be.
Reply: TypeAlias = (
    str | Mapping[str, Any] | ChatCompletion | BaseException | Callable[[CompletionRequest], Any]
)

_ids = itertools.count(1)


def text(content: str, *, usage: Mapping[str, int] | None = None) -> dict[str, Any]:
    """An assistant message with text only (a final answer)."""
    return _completion({"role": "assistant", "content": content}, "stop", usage)


def tool_call(
    name: str,
    arguments: Mapping[str, Any] | str | None = None,
    *,
    id: str | None = None,
    usage: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """An assistant message calling one tool (`arguments` as a dict or raw JSON text)."""
    return tool_calls([(name, arguments)], ids=[id] if id else None, usage=usage)


def tool_calls(
    calls: Iterable[tuple[str, Mapping[str, Any] | str | None]],
    *,
    ids: Iterable[str | None] | None = None,
    usage: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """An assistant message calling several tools in parallel."""
    listed = list(calls)
    given = list(ids) if ids is not None else [None] * len(listed)
    wire = []
    for (name, arguments), cid in zip(listed, given, strict=True):
        if arguments is None:
            raw = ""
        elif isinstance(arguments, str):
            raw = arguments
        else:
            raw = pydantic_core.to_json(dict(arguments)).decode()
        wire.append(
            {
                "id": cid or f"call_{next(_ids)}",
                "type": "function",
                "function": {"name": name, "arguments": raw},
            }
        )
    return _completion(
        {"role": "assistant", "content": None, "tool_calls": wire}, "tool_calls", usage
    )


def _completion(
    message: dict[str, Any], finish: str, usage: Mapping[str, int] | None
) -> dict[str, Any]:
    u = dict(usage) if usage else {"prompt_tokens": 10, "completion_tokens": 5}
    u.setdefault("total_tokens", u.get("prompt_tokens", 0) + u.get("completion_tokens", 0))
    return {
        "id": f"scripted-{next(_ids)}",
        "object": "chat.completion",
        "created": 0,
        "model": "scripted",
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": u,
    }


class ScriptedExecutor:
    """Replies to each completion request with the next step of a script.

    Steps: a `str` (final text), a dict from `text`/`tool_call`/`tool_calls` or any OpenAI-shaped
    completion dict, a plain assistant message dict, a `ChatCompletion`, an exception instance
    (raised, as a provider failure would be), or a callable `request -> step`. When the script
    runs out, `default` is used, or a clear error is raised.
    """

    def __init__(self, script: Iterable[Reply] = (), *, default: Reply | None = None) -> None:
        self._script = list(script)
        self._default = default
        self.requests: list[CompletionRequest] = []

    def add(self, *steps: Reply) -> ScriptedExecutor:
        """Append steps to the script; returns self for chaining."""
        self._script.extend(steps)
        return self

    @property
    def remaining(self) -> int:
        """Steps not used yet."""
        return len(self._script)

    async def acomplete(self, request: CompletionRequest) -> ChatCompletion:
        """The next scripted reply, as a validated completion."""
        self.requests.append(request)
        if self._script:
            step: Any = self._script.pop(0)
        elif self._default is not None:
            step = self._default
        else:
            raise ConfigurationError(
                f"the ScriptedExecutor ran out of replies after {len(self.requests) - 1}; "
                "add more steps or a default."
            )
        while callable(step) and not isinstance(step, BaseException):
            step = step(request)
            if inspect.isawaitable(step):  # async steps (slow replies, gated replies)
                step = await step
        if isinstance(step, BaseException):
            raise step
        if isinstance(step, str):
            step = text(step)
        elif isinstance(step, Mapping) and "choices" not in step:
            message = {"role": "assistant", **step}
            finish = "tool_calls" if message.get("tool_calls") else "stop"
            step = _completion(message, finish, None)
        return coerce_completion(step)
