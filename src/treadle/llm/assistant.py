"""The finished model turn: `AssistantTurn`, and how a reply becomes one.

`turn_of` reads a whole `ChatCompletion` (a non-streamed reply, or a fold validated as a
whole); `folded_turn` reads a folded stream directly, its events each already checked against
the chunk schema, and builds the `ChatCompletion` only when someone reads `completion`. Pure: no
I/O. `treadle.llm.turn` re-exports these names.
"""

from __future__ import annotations

import threading
from dataclasses import MISSING, dataclass, fields
from typing import TYPE_CHECKING, Any, cast

from treadle.llm.accumulate import StreamAccumulator
from treadle.llm.inband import provider_usage
from treadle.llm.wire import ChatCompletion, MessageToolCall
from treadle.session import Usage

__all__ = ["AssistantTurn", "folded_turn", "turn_of"]

# Taken only by a turn's first read of a completion not built yet (guardrails, tracing): one
# lock for all turns, so a turn costs no lock of its own.
_BUILD = threading.Lock()


@dataclass(init=False, eq=False, repr=False, frozen=True)
class AssistantTurn:
    """A finished model turn: the assistant row's payload, its usage and why it ended.

    A frozen dataclass of `payload`, `usage`, `finish_reason`, `completion` and `request_id`.
    `completion` is the reply as a `ChatCompletion`; for a streamed reply it is validated from
    the folded events when first read (a pass reads it only for `after` guardrails and
    tracing), the payload and usage being read from the fold directly.
    """

    # Hand-written slots, `__init__`, `__eq__` and `__repr__` (the decorator makes only the
    # fields, `__match_args__` and the frozen `__setattr__`); at run time `completion` is a
    # property over `_got` and `_fold`. Type checkers see the plain frozen dataclass.
    __slots__ = ("_fold", "_got", "finish_reason", "payload", "request_id", "usage", "wire")

    payload: dict[str, Any]
    """The assistant row payload: `content`, `tool_calls`, and provider fields kept as sent."""
    usage: Usage
    """This request's usage (`requests == 1`)."""
    finish_reason: str | None
    """The provider's finish reason (`stop`, `tool_calls`, `length`, ...)."""
    completion: ChatCompletion
    """The reply as received (what `after` guardrails inspect)."""
    if TYPE_CHECKING:
        request_id: str | None = None
        """The reply's `x-request-id` header, when Treadle's client carried it and it had one."""
    else:  # a slot has no class default: set on the field below
        request_id: str | None

    def __init__(
        self,
        payload: dict[str, Any],
        usage: Usage,
        finish_reason: str | None,
        completion: ChatCompletion | None,
        request_id: str | None = None,
        *,
        fold: StreamAccumulator | None = None,
        wire: tuple[Any, str] | None = None,
    ) -> None:
        # Not fields (declared here, not in the class body, so no type checker takes them for
        # ones): `wire` is the reply's usage as sent (a `CompletionUsage`, its dict, or None)
        # and its id, what a pass's request entry reads instead of `completion`.
        self.wire: tuple[Any, str]
        self._got: ChatCompletion | None
        self._fold: StreamAccumulator | None
        setter = object.__setattr__
        setter(self, "payload", payload)
        setter(self, "usage", usage)
        setter(self, "finish_reason", finish_reason)
        setter(self, "_got", completion)
        setter(self, "request_id", request_id)
        setter(self, "_fold", fold)
        if wire is None:
            wire = (completion.usage, completion.id) if completion is not None else (None, "")
        setter(self, "wire", wire)

    def _completion(self) -> ChatCompletion:
        """The reply as received (what `after` guardrails inspect); a streamed reply's is
        validated from its fold when first read."""
        got = self._got
        if got is None and self._fold is not None:
            got = self._build()
        # None only when the turn was made so (the dataclass took it unchecked).
        return cast(ChatCompletion, got)

    def _set_completion(self, value: ChatCompletion | None) -> None:
        # Reached only through `object.__setattr__` (the frozen `__setattr__` refuses the rest):
        # pydantic's validation and unpickling set each field so, never calling `__init__`.
        setter = object.__setattr__
        setter(self, "_got", value)
        setter(self, "_fold", None)
        setter(self, "wire", (value.usage, value.id) if value is not None else (None, ""))

    if not TYPE_CHECKING:
        completion = property(_completion, _set_completion, doc=_completion.__doc__)

    def _build(self) -> ChatCompletion:
        """The fold's completion, validated once whichever threads read it first."""
        with _BUILD:
            got = self._got
            if got is None:
                assert self._fold is not None
                got = self._fold.result()
                object.__setattr__(self, "_got", got)
        return got

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        assert isinstance(other, AssistantTurn)
        return self._fields() == other._fields()

    __hash__ = None  # type: ignore[assignment]  # the payload is a dict

    def __repr__(self) -> str:
        values = zip(_FIELDS, self._fields(), strict=True)
        inner = ", ".join(f"{n}={v!r}" for n, v in values)
        return f"{self.__class__.__qualname__}({inner})"

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickle and copy set each field of the instance's class (a dataclass subclass's own
        # too), as the frozen dataclass's state did; `completion` is built and sets `wire`.
        values = tuple((f.name, getattr(self, f.name)) for f in fields(self))
        return (_rebuilt, (self.__class__, values))

    def __setstate__(self, state: list[Any]) -> None:
        # A pickle of the plain slotted dataclass (its `__getstate__` listed the field values).
        for field, value in zip(fields(self), state, strict=False):
            object.__setattr__(self, field.name, value)

    def _fields(self) -> tuple[Any, ...]:
        return (self.payload, self.usage, self.finish_reason, self.completion, self.request_id)


_FIELDS = ("payload", "usage", "finish_reason", "completion", "request_id")


def _rebuilt(cls: type[AssistantTurn], values: tuple[tuple[str, Any], ...]) -> AssistantTurn:
    """A pickled or copied turn: its fields set past the frozen `__setattr__`, as pickle did."""
    turn = cls.__new__(cls)
    for name, value in values:
        object.__setattr__(turn, name, value)
    return turn


# The fields' defaults as the plain dataclass had them (pydantic and `fields()` read them):
# `completion` has none (its class attribute is the property), `request_id` None (a slot).
AssistantTurn.__dataclass_fields__["completion"].default = MISSING
AssistantTurn.__dataclass_fields__["request_id"].default = None


def folded_turn(acc: StreamAccumulator, request_id: str | None = None) -> AssistantTurn:
    """The `AssistantTurn` of a folded stream: `turn_of(acc.result())`, mostly without it.

    Every event was validated against the chunk schema as it came; a reply of the plain shape
    (`StreamAccumulator.plain_turn`) becomes its payload directly and its `completion` is built
    when first read. Any other goes through the whole validation and `turn_of`, as before.
    """
    plain = acc.plain_turn()
    if plain is None:
        return turn_of(acc.result(), request_id)
    payload, finish_reason, wire_usage, top = plain
    if not wire_usage or not (wire_usage.get("prompt_tokens") or wire_usage.get("total_tokens")):
        wire_usage = provider_usage(acc.provider_fields()) or wire_usage
    wire = (top.get("usage"), top.get("id", ""))
    usage = Usage.from_wire(wire_usage)
    return AssistantTurn(payload, usage, finish_reason, None, request_id, fold=acc, wire=wire)


def turn_of(completion: ChatCompletion, request_id: str | None = None) -> AssistantTurn:
    """The `AssistantTurn` of one whole completion (`request_id`: the reply's `x-request-id`)."""
    message = completion.message
    payload: dict[str, Any] = {"content": message.content}
    if message.tool_calls:
        payload["tool_calls"] = [
            _call_payload(i, call) for i, call in enumerate(message.tool_calls)
        ]
    extra = message.__pydantic_extra__  # `model_extra`, without its property call
    if extra:
        # Keep provider fields such as reasoning_content; `role` is implied by the row kind.
        for key, value in extra.items():
            if key != "role" and value is not None:
                payload[key] = value
    usage = completion.usage
    wire_usage = usage.model_dump() if usage is not None else None
    if not wire_usage or not any(wire_usage.get(k) for k in ("prompt_tokens", "total_tokens")):
        wire_usage = provider_usage(completion.__pydantic_extra__) or wire_usage
    return AssistantTurn(
        payload, Usage.from_wire(wire_usage), completion.finish_reason, completion, request_id
    )


def _call_payload(i: int, call: MessageToolCall) -> dict[str, Any]:
    """A tool call of the reply as the assistant row keeps it; an empty id (Gemini's endpoint)
    gets the one its tool_result row will answer."""
    fn = call.function
    function: dict[str, Any]
    if fn.__pydantic_extra__:  # provider fields beside name and arguments: kept as dumped
        function = {**fn.model_dump(exclude_none=True), "name": fn.name, "arguments": fn.arguments}
    else:  # the dump would be exactly these two (every round's case: no second serialisation)
        function = {"name": fn.name, "arguments": fn.arguments}
    if call.__pydantic_extra__:
        return {
            **call.model_dump(exclude_none=True),
            "id": call.id or f"call_{i}",
            "type": call.type or "function",
            "function": function,
        }
    return {"id": call.id or f"call_{i}", "type": call.type or "function", "function": function}
