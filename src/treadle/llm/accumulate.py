"""`StreamAccumulator`: folds stream chunks into the completion a non-streamed call returns.

Deltas are merged the way OpenAI's own client merges them: strings are concatenated (content,
tool-call arguments, and unknown fields such as `reasoning_content`), tool calls are merged by
`index`, identity fields (`role`, `id`, `type`, `index`) are replaced, not concatenated. Pure: no
I/O, never raises on unknown fields (they are kept).
"""

from __future__ import annotations

from typing import Any

from treadle.errors import MalformedResponse
from treadle.llm.wire import ChatCompletion, ChatCompletionChunk

__all__ = ["StreamAccumulator"]

_REPLACED = frozenset({"role", "id", "type", "index"})


def _merge(acc: dict[str, Any], delta: dict[str, Any]) -> None:
    for key, value in delta.items():
        if value is None:
            acc.setdefault(key, None)
            continue
        old = acc.get(key)
        if old is None or key in _REPLACED:
            acc[key] = value
        elif isinstance(old, str) and isinstance(value, str):
            acc[key] = old + value
        elif isinstance(old, dict) and isinstance(value, dict):
            _merge(old, value)
        elif isinstance(old, list) and isinstance(value, list):
            _merge_list(old, value)
        else:
            acc[key] = value


def _merge_list(acc: list[Any], items: list[Any]) -> None:
    for item in items:
        if isinstance(item, dict) and isinstance(item.get("index"), int):
            for existing in acc:
                if isinstance(existing, dict) and existing.get("index") == item["index"]:
                    _merge(existing, item)
                    break
            else:
                acc.append(dict(item))
        else:
            acc.append(item)


class StreamAccumulator:
    """Collects `ChatCompletionChunk`s; `result()` gives the equivalent `ChatCompletion`."""

    __slots__ = ("_choices", "_finish", "_top", "chunks")

    def __init__(self) -> None:
        self._top: dict[str, Any] = {}
        self._choices: dict[int, dict[str, Any]] = {}
        self._finish: dict[int, str | None] = {}
        self.chunks = 0
        """Number of chunks added."""

    @property
    def finished(self) -> bool:
        """True once some choice reported a `finish_reason`."""
        return any(reason is not None for reason in self._finish.values())

    def add(self, chunk: ChatCompletionChunk) -> None:
        """Fold one chunk in (order matters; the usage chunk may come last with no choices)."""
        self.chunks += 1
        top = self._top
        for key in ("id", "created", "model"):
            value = getattr(chunk, key)
            if value and key not in top:
                top[key] = value
        if chunk.usage is not None:
            top["usage"] = chunk.usage.model_dump()
        if chunk.model_extra:
            for key, value in chunk.model_extra.items():
                if value is not None:
                    top[key] = value
        for choice in chunk.choices:
            message = self._choices.get(choice.index)
            if message is None:
                message = self._choices[choice.index] = {"role": "assistant", "content": None}
                self._finish[choice.index] = None
            _merge(message, choice.delta.model_dump(exclude_none=True))
            if choice.finish_reason is not None:
                self._finish[choice.index] = choice.finish_reason

    def result(self) -> ChatCompletion:
        """The accumulated completion; `MalformedResponse` if no choice was ever streamed."""
        if not self._choices:
            raise MalformedResponse("The stream ended without any choices; retry the request.")
        choices = []
        for index in sorted(self._choices):
            message = dict(self._choices[index])
            calls = message.get("tool_calls")
            if calls:
                ordered = sorted(calls, key=lambda c: c.get("index", 0))
                message["tool_calls"] = [
                    {k: v for k, v in call.items() if k != "index"} for call in ordered
                ]
                for call in message["tool_calls"]:
                    call.setdefault("type", "function")
                    function = call.setdefault("function", {})
                    function.setdefault("arguments", "")
                    function.setdefault("name", "")
            choices.append(
                {"index": index, "message": message, "finish_reason": self._finish[index]}
            )
        body = {**self._top, "object": "chat.completion", "choices": choices}
        return ChatCompletion.model_validate(body)
