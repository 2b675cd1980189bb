"""The assistant row's tool calls as `turn_of` builds them from a whole completion.

`turn_of` skips serialising a tool call again when it has no provider fields: the payload must be
what the model's dump gave (same keys, same order, same values), extras or not.
"""

from __future__ import annotations

from typing import Any

from treadle.llm.turn import turn_of
from treadle.llm.wire import ChatCompletion


def _dumped(completion: ChatCompletion) -> list[dict[str, Any]]:
    """The tool calls as the dump of each validated call gave them (the reference)."""
    return [
        {
            **call.model_dump(exclude_none=True),
            "id": call.id or f"call_{i}",
            "type": call.type or "function",
            "function": {
                **call.function.model_dump(exclude_none=True),
                "name": call.function.name,
                "arguments": call.function.arguments,
            },
        }
        for i, call in enumerate(completion.message.tool_calls or ())
    ]


def _completion(calls: list[dict[str, Any]]) -> ChatCompletion:
    message = {"role": "assistant", "content": None, "tool_calls": calls}
    choice = {"index": 0, "message": message, "finish_reason": "tool_calls"}
    return ChatCompletion.model_validate({"id": "c1", "choices": [choice]})


def test_tool_calls_without_provider_fields_are_the_dump_of_the_call() -> None:
    completion = _completion(
        [
            {"id": "call_a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "", "type": "", "function": {"name": "g", "arguments": ""}},
            {"id": "call_c", "function": {"name": "h"}},
        ]
    )
    payload = turn_of(completion).payload["tool_calls"]
    assert payload == _dumped(completion)
    assert [list(call) for call in payload] == [list(call) for call in _dumped(completion)]
    assert [call["id"] for call in payload] == ["call_a", "call_1", "call_c"]
    assert payload[1]["type"] == "function"


def test_tool_calls_with_provider_fields_keep_them_as_dumped() -> None:
    completion = _completion(
        [
            {
                "id": "call_a",
                "type": "function",
                "function": {"name": "f", "arguments": "{}", "strict": True, "gone": None},
                "extra_content": {"google": {"thought_signature": "sig"}},
                "dropped": None,
            },
            {"id": "call_b", "function": {"name": "g", "arguments": "{}", "note": [1, None]}},
        ]
    )
    payload = turn_of(completion).payload["tool_calls"]
    assert payload == _dumped(completion)
    assert [list(call) for call in payload] == [list(call) for call in _dumped(completion)]
    assert [list(call["function"]) for call in payload] == [
        list(call["function"]) for call in _dumped(completion)
    ]
    assert "dropped" not in payload[0] and "gone" not in payload[0]["function"]
    assert payload[0]["extra_content"] == {"google": {"thought_signature": "sig"}}
