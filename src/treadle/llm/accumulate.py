"""`StreamAccumulator`: folds stream chunks into the completion a non-streamed call returns.

Only fields that are text deltas are concatenated: the message's `content`, `reasoning_content`,
`reasoning`, `refusal` and `thinking`, a tool call's `function.arguments`, and the `text` /
`summary` of indexed list items such as `reasoning_details`. Every other field is an identity or
an enum (`id`, `type`, `format`, `channel`, a tool name, ...) and is replaced by the latest
non-empty value, so nothing is repeated once per chunk and sent back to the provider corrupted.

Lists are merged item by item when items carry an `index` (tool calls, `reasoning_details`,
`executed_tools`) and appended otherwise (`annotations`). Tool-call deltas without an `index`
(some compatible servers omit it) are told apart by `id`: a new id starts a new call, a delta
without id continues the last one; a repeated index with a different id is a new call too.
`content` given as a list of parts (Mistral's thinking and text parts) is merged part by part.
Pure: no I/O, never raises on unknown fields (they are kept).

Linear in the reply's length: a text field that grows piece by piece (`content`, a tool call's
`arguments`, `reasoning_content`, an item's `text`) keeps its pieces while the stream goes on
(`Text`) and is joined once, when the fold is read (`result`, `plain_turn`). Adding each piece
to a `str` held in a dict copied everything before it: a reply of 50,000 text events cost 10 µs
an event to fold, one of 200,000 events 87 µs an event (17 s for the reply, on the event loop
every pass shares), where a 1,000-event reply costs about 1 µs an event.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Mapping
from typing import Any

from treadle.errors import MalformedResponse
from treadle.llm.fold_pieces import SCAN_ITEMS, Fold, Text, add_text, own, take
from treadle.llm.wire import ChatCompletion, ChatCompletionChunk

__all__ = ["MESSAGE_TEXT_FIELDS", "StreamAccumulator"]


def _validate_completion(body: dict[str, Any]) -> ChatCompletion:
    # Looked up at each call: until its first use the model's validator is pydantic's
    # stand-in, which builds the schema (under `DeferredModel`'s lock) and is then replaced.
    completion: ChatCompletion = ChatCompletion.__pydantic_validator__.validate_python(body)
    return completion


#: Message fields whose stream deltas are pieces of one text.
MESSAGE_TEXT_FIELDS = frozenset(
    {"content", "reasoning_content", "reasoning", "refusal", "thinking"}
)
# Fields of an indexed list item (`reasoning_details[]`, content parts) that are text pieces.
_ITEM_TEXT_FIELDS = frozenset({"text", "summary", "thinking"})


def _replace(acc: dict[str, Any], key: str, value: Any) -> None:
    """Set an identity/enum field; an empty string never wipes a value already known."""
    if value == "" and acc.get(key):
        return
    acc[key] = own(value)


def _merge_item(acc: dict[str, Any], delta: dict[str, Any], fold: Fold) -> None:
    """Merge one indexed list item: its text fields concatenate, the rest is replaced."""
    for key, value in delta.items():
        if value is None:
            acc.setdefault(key, None)
        elif key in _ITEM_TEXT_FIELDS and isinstance(value, str):
            add_text(acc, key, value, fold)
        elif key in _ITEM_TEXT_FIELDS and isinstance(value, list):
            take(acc, key)
            _merge_parts(acc.setdefault(key, []), value, fold)
        else:
            _replace(acc, key, value)


def _merge_indexed(acc: list[Any], items: list[Any], fold: Fold) -> None:
    """Merge list items by their `index`; items without one are appended.

    An item merges into the first dict of `acc` whose `index` equals its own. A short list is
    scanned; past `SCAN_ITEMS` the dicts are found through a map by index kept in `fold`
    (first one per index, as the scan finds it), or a reply of many items would fold in
    quadratic time."""
    mapped = fold._items.get(id(acc)) if len(acc) > SCAN_ITEMS else None
    if mapped is not None and mapped[0] is not acc:
        mapped = None  # pragma: no cover - the mapped list is held, so its id is not reused
    for item in items:
        if isinstance(item, dict) and isinstance(item.get("index"), int):
            index = item["index"]
            if mapped is None and len(acc) > SCAN_ITEMS:
                mapped = fold._items[id(acc)] = (acc, _by_index(acc))
            if mapped is not None:
                existing = mapped[1].get(index)
            else:
                existing = None
                for candidate in acc:
                    if isinstance(candidate, dict) and candidate.get("index") == index:
                        existing = candidate
                        break
            if existing is not None:
                _merge_item(existing, item, fold)
                continue
            item = own(item)
        else:
            item = own(item)
        acc.append(item)
        if mapped is not None:
            _map_item(mapped[1], item)


def _by_index(items: list[Any]) -> dict[Any, Any]:
    """The dicts of `items` by their `index` (the first of each index)."""
    by_index: dict[Any, Any] = {}
    for item in items:
        _map_item(by_index, item)
    return by_index


def _map_item(by_index: dict[Any, Any], item: Any) -> None:
    if isinstance(item, dict):
        with contextlib.suppress(TypeError):  # an unhashable index equals no int index
            by_index.setdefault(item.get("index"), item)


def _merge_parts(acc: list[Any], parts: list[Any], fold: Fold) -> None:
    """Merge content parts: a part of the same type as the last one continues it."""
    for part in parts:
        last = acc[-1] if acc else None
        if (
            isinstance(part, dict)
            and isinstance(last, dict)
            and part.get("type") == last.get("type")
            and "index" not in part
        ):
            _merge_item(last, part, fold)
        elif isinstance(part, dict):
            acc.append(own(part))
        else:
            acc.append(part)


def _merge_content(message: dict[str, Any], value: str | list[Any], fold: Fold) -> None:
    if isinstance(value, str):
        old = message.get("content")
        if isinstance(old, list):
            _merge_parts(old, [{"type": "text", "text": value}] if value else [], fold)
        elif old:
            add_text(message, "content", value, fold)
        else:  # the first piece (or the whole text), as most replies send it
            message["content"] = value
        return
    old = take(message, "content")
    if not isinstance(old, list):
        # Text streamed before the first parts list becomes a leading text part.
        old = [{"type": "text", "text": old}] if old else []
        message["content"] = old
    _merge_parts(old, value, fold)


def _merge_message(message: dict[str, Any], delta: dict[str, Any], fold: Fold) -> None:
    for key, value in delta.items():
        if value is None or key == "tool_calls":
            continue  # an absent field; tool calls are merged by `_merge_calls`
        if key == "role" and type(value) is str:  # every stream's first delta: `_replace` inline
            if value or not message.get("role"):
                message["role"] = value
        elif key == "content" and isinstance(value, (str, list)):
            _merge_content(message, value, fold)
        elif key in MESSAGE_TEXT_FIELDS and isinstance(value, str):
            add_text(message, key, value, fold)
        elif isinstance(value, list):
            old = take(message, key)
            if isinstance(old, list):
                _merge_indexed(old, value, fold)
            else:
                message[key] = []
                _merge_indexed(message[key], value, fold)
        elif isinstance(value, dict) and isinstance(message.get(key), dict):
            _merge_item(message[key], value, fold)
        else:
            _replace(message, key, value)


_CALL_FIELDS = frozenset({"index", "id", "type", "function"})
_NOT_TOP = frozenset({"choices", "object"})  # an event's fields the completion does not take
_FIRST_TOP = frozenset({"id", "created", "model"})  # the first non-empty value stays
_FUNCTION_FIELDS = frozenset({"name", "arguments"})
_DECLARED_TOP = frozenset({"id", "created", "model", "usage"})  # the rest: provider fields


# A folded call's position among the choice's calls (a sort key, in C).
_index_of = operator.itemgetter("index")


class _Calls(list[dict[str, Any]]):
    """A choice's folded tool calls in arrival order, found by index in one lookup (`at`).

    A scan of the calls for each delta's index, and `max` over them for a renumbered one, made
    the fold quadratic in the number of calls a reply makes: a hostile reply of 100,000 calls
    (8 MB, far under `MAX_BODY_BYTES`) would have held the event loop for minutes."""

    __slots__ = ("at", "highest")
    at: dict[int, dict[str, Any]]
    highest: int | None  # the highest index of a call so far (indexes may be negative)


def _new_calls() -> _Calls:
    # No `__init__` of its own: one Python frame fewer per choice of every streamed reply.
    calls = _Calls()
    calls.at = {}
    calls.highest = None
    return calls


def _merge_calls(calls: _Calls, deltas: list[dict[str, Any]], fold: Fold) -> None:
    """Fold tool-call deltas in; a delta without `index` gets the one it belongs to (in place)."""
    for delta in deltas:
        index = delta.get("index")
        call_id = delta.get("id")
        if index is None:
            last = calls[-1] if calls else None
            if last is None or (call_id and last.get("id") and call_id != last["id"]):
                index = len(calls)
            else:
                index = last["index"]
        current = calls.at.get(index)
        if current is not None and call_id and current.get("id") and call_id != current["id"]:
            # The same index with another id: a server numbering every call 0. A new call.
            index = (calls.highest if calls.highest is not None else index) + 1
            current = None
        delta["index"] = index  # callbacks see the call each piece belongs to
        if current is None:
            current = {"index": index, "function": {"name": "", "arguments": ""}}
            calls.append(current)
            calls.at[index] = current
            if calls.highest is None or index > calls.highest:
                calls.highest = index
        if call_id:
            current["id"] = call_id
        kind = delta.get("type")
        if kind:
            current["type"] = kind
        fn = delta.get("function")
        if fn is not None:
            function = current["function"]
            for key, value in fn.items():
                if key == "arguments":
                    if value:
                        if function["arguments"]:
                            add_text(function, "arguments", value, fold)
                        else:  # the usual first piece, or the arguments whole
                            function["arguments"] = value
                elif key == "name":
                    if value:
                        function["name"] = value
                elif value is not None:
                    function[key] = value
        for key, value in delta.items():
            if value is not None and key not in _CALL_FIELDS:
                _replace(current, key, value)


class StreamAccumulator(Fold):
    """Collects `ChatCompletionChunk`s; `result()` gives the equivalent `ChatCompletion`."""

    __slots__ = ("_calls", "_choices", "_finish", "_top", "chunks")

    def __init__(self) -> None:
        self._top: dict[str, Any] = {}
        self._texts = []  # texts kept as pieces (`_joined`)
        self._items = {}  # long indexed lists' item maps
        self._choices: dict[int, dict[str, Any]] = {}
        self._calls: dict[int, _Calls] = {}
        self._finish: dict[int, str | None] = {}
        self.chunks = 0
        """Number of chunks added."""

    @property
    def finished(self) -> bool:
        """True once some choice reported a `finish_reason`."""
        return any(reason is not None for reason in self._finish.values())

    def add(self, chunk: ChatCompletionChunk) -> None:
        """Fold one chunk in (order matters; the usage chunk may come last with no choices).

        Tool-call deltas without an `index` get the index of the call they belong to.
        """
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
            delta = choice.delta
            dumped = delta.model_dump(exclude_none=True)
            self._add_choice(choice.index, dumped, choice.finish_reason)
            if delta.tool_calls:  # callbacks see the call each piece belongs to
                for call, folded in zip(delta.tool_calls, dumped["tool_calls"], strict=True):
                    call.index = folded["index"]

    def add_event(self, event: Mapping[str, Any]) -> None:
        """`add` for a chunk given as a dict (`chunk_parse.parse_event`; a null is an absent field).

        Tool-call dicts without an `index` get the index of the call they belong to (in place).
        """
        self.chunks += 1
        top = self._top
        for key, value in event.items():
            if value is None or key in _NOT_TOP:
                continue
            if key in _FIRST_TOP:
                if value and key not in top:
                    top[key] = value
            else:  # `usage`, and provider fields such as `x_groq` or `system_fingerprint`
                top[key] = value
        # `_add_choice` inline: this runs for every event of every streamed reply.
        for choice in event.get("choices", ()):
            get = choice.get
            index = get("index", 0)
            message = self._choices.get(index)
            if message is None:
                message = self._choices[index] = {"role": "assistant", "content": None}
                self._calls[index] = _new_calls()
                self._finish[index] = None
            delta = get("delta")
            if delta:
                _merge_message(message, delta, self)
                calls = delta.get("tool_calls")
                if calls:
                    _merge_calls(self._calls[index], calls, self)
            reason = get("finish_reason")
            if reason is not None:
                self._finish[index] = reason

    def _add_choice(self, index: int, delta: dict[str, Any] | None, reason: str | None) -> None:
        message = self._choices.get(index)
        if message is None:
            message = self._choices[index] = {"role": "assistant", "content": None}
            self._calls[index] = _new_calls()
            self._finish[index] = None
        if delta:
            _merge_message(message, delta, self)
            calls = delta.get("tool_calls")
            if calls:
                _merge_calls(self._calls[index], calls, self)
        if reason is not None:
            self._finish[index] = reason

    def plain_turn(
        self,
    ) -> tuple[dict[str, Any], str | None, dict[str, Any] | None, dict[str, Any]] | None:
        """The first choice as the assistant row's payload, without building a `ChatCompletion`.

        `(payload, finish reason, wire usage, the completion's top-level fields)`; None
        when the reply is not of the plain shape this reads by hand (content text or absent,
        tool calls with no field beyond id, type, name and arguments, each of its schema type),
        and `result()` with `turn_of` must give the turn. Every event was checked against the
        chunk schema already; what the whole's validation would add is checked here: the types
        of what was folded, and no choices at all (`MalformedResponse`, as `result()` says).
        The payload is what `turn_of(result())` gives (`tests/test_folded_turn.py`).
        """
        choices = self._choices
        if not choices:
            raise MalformedResponse("The stream ended without any choices; retry the request.")
        if self._texts:
            self._joined()
        index = min(choices) if len(choices) > 1 else next(iter(choices))
        message = choices[index]
        content = message["content"]
        if (content is not None and type(content) is not str) or type(message["role"]) is not str:
            return None
        payload: dict[str, Any] = {"content": content}
        calls: list[dict[str, Any]] = self._calls[index]
        if calls:
            if len(calls) > 1:
                calls = sorted(calls, key=_index_of)
            tool_calls = []
            for i, call in enumerate(calls):
                if len(call) > 4 or not _CALL_FIELDS.issuperset(call):
                    return None  # provider fields on the call: dumped as `turn_of` does
                fn = call["function"]
                name, arguments = fn["name"], fn["arguments"]
                call_id, kind = call.get("id") or f"call_{i}", call.get("type") or "function"
                if (
                    len(fn) != 2
                    or type(name) is not str
                    or type(arguments) is not str
                    or type(call_id) is not str
                    or type(kind) is not str
                ):
                    return None
                function = {"name": name, "arguments": arguments}
                tool_calls.append({"id": call_id, "type": kind, "function": function})
            payload["tool_calls"] = tool_calls
        if len(message) > 2:  # provider fields such as reasoning_content, kept as sent
            for key, value in message.items():
                if key != "role" and key != "content" and value is not None:
                    payload[key] = own(value)
        top = self._top
        usage = top.get("usage")
        if usage is not None and type(usage) is not dict:
            return None
        return payload, self._finish[index], usage, top

    def _joined(self) -> None:
        """Every text kept as pieces joined into its `str` (the fold can go on after it)."""
        for container, key in self._texts:
            value = container.get(key)
            if type(value) is Text:
                container[key] = "".join(value.pieces)
        self._texts = []

    def provider_fields(self) -> dict[str, Any]:
        """The completion's fields beyond the schema's (`x_groq`, `system_fingerprint`, ...)."""
        return {k: v for k, v in self._top.items() if k not in _DECLARED_TOP}

    def result(self) -> ChatCompletion:
        """The accumulated completion; `MalformedResponse` if no choice was ever streamed."""
        if not self._choices:
            raise MalformedResponse("The stream ended without any choices; retry the request.")
        if self._texts:
            self._joined()
        choices = []
        for index in sorted(self._choices):
            message = own(self._choices[index])
            calls = self._calls[index]
            if calls:
                ordered = sorted(calls, key=lambda c: c["index"])
                message["tool_calls"] = [
                    {"type": "function", **{k: v for k, v in call.items() if k != "index"}}
                    for call in ordered
                ]
                for call in message["tool_calls"]:
                    call.setdefault("id", "")
            choices.append(
                {"index": index, "message": message, "finish_reason": self._finish[index]}
            )
        body = {**self._top, "object": "chat.completion", "choices": choices}
        # The validator itself, not `model_validate`: the classmethod passes six keyword
        # arguments on (about 3 µs a reply, once per streamed round). Same schema, same errors.
        return _validate_completion(body)
