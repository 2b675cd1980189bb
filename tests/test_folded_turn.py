"""A streamed reply becomes its turn from the fold, without a `ChatCompletion` unless one is read.

`folded_turn` must give what `turn_of(acc.result())` gave (payload with its key order, usage,
finish reason, the completion when read), for every shape of stream: plain ones read by hand,
the rest (provider fields on a call, content parts) through the whole validation as before.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle
import sys
import threading
from typing import Any

import pytest
from pydantic import TypeAdapter

from recorded_replies import replies_dir
from treadle import Session
from treadle.errors import MalformedResponse, ProviderError
from treadle.llm import Provider, SSEDecoder, StreamAccumulator
from treadle.llm import accumulate as accumulate_module
from treadle.llm.assistant import AssistantTurn, folded_turn, turn_of
from treadle.llm.chunk_parse import parse_event
from treadle.llm.sse import DONE
from treadle.llm.wire import ChatCompletion
from treadle.loop import Guardrail, GuardrailInput, run_session_loop
from treadle.session import Usage
from treadle.testing import FakeOpenAIServer
from treadle.testing.fake_replies import Reply, ToolCallSpec


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The bodies every `ChatCompletion` validation of the fold got, in order."""
    bodies: list[object] = []
    real = accumulate_module._validate_completion

    def counting(body: dict[str, Any]) -> ChatCompletion:
        bodies.append(body)
        return real(body)

    monkeypatch.setattr(accumulate_module, "_validate_completion", counting)
    return bodies


def _fold(events: list[dict[str, Any]]) -> StreamAccumulator:
    """The events through the turn's parser (schema checks) and fold."""
    acc = StreamAccumulator()
    for event in events:
        parsed, _, _ = parse_event(json.dumps(event).encode(), None, None)
        acc.add_event(parsed)
    return acc


def _both(events: list[dict[str, Any]]) -> tuple[AssistantTurn, AssistantTurn]:
    """(the folded turn, the turn of the whole validated completion), from two folds."""
    return folded_turn(_fold(events), "req-1"), turn_of(_fold(events).result(), "req-1")


def _assert_same(got: AssistantTurn, want: AssistantTurn) -> None:
    assert got.payload == want.payload
    assert list(got.payload) == list(want.payload)
    for mine, theirs in zip(
        got.payload.get("tool_calls", ()), want.payload.get("tool_calls", ()), strict=True
    ):
        assert list(mine) == list(theirs)
        assert list(mine["function"]) == list(theirs["function"])
    assert (got.usage, got.finish_reason, got.request_id) == (
        want.usage,
        want.finish_reason,
        want.request_id,
    )
    assert got.wire[1] == want.wire[1]
    assert got.completion == want.completion
    assert got == want


def _ev(
    delta: dict[str, Any] | None = None, finish: str | None = None, **top: Any
) -> dict[str, Any]:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    return {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": choices, **top}  # fmt: skip


USAGE = {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13}

STREAMS: dict[str, list[dict[str, Any]]] = {
    "text": [_ev({"role": "assistant"}), _ev({"content": "Hel"}), _ev({"content": "lo"}, "stop"),
             _ev(usage=USAGE)],
    "tool calls": [
        _ev({"role": "assistant", "content": None}),
        _ev({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                             "function": {"name": "f", "arguments": ""}}]}),
        _ev({"tool_calls": [{"index": 0, "function": {"arguments": '{"x":'}}]}),
        _ev({"tool_calls": [{"index": 0, "function": {"arguments": " 1}"}}]}),
        _ev({"tool_calls": [{"index": 1, "id": "call_b", "function": {"name": "g"}}]}),
        _ev({}, "tool_calls"),
        _ev(usage=USAGE),
    ],
    "a call without a name or an id": [
        _ev({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}, "tool_calls"),
    ],
    "calls out of order, without index": [
        _ev({"tool_calls": [{"index": 1, "id": "b", "function": {"name": "g", "arguments": ""}}]}),
        _ev({"tool_calls": [{"index": 0, "id": "a", "function": {"name": "f", "arguments": ""}}]}),
        _ev({"tool_calls": [{"id": "c", "function": {"name": "h", "arguments": "{}"}}]}),
        _ev({"tool_calls": [{"function": {"arguments": "{}"}}]}, "tool_calls"),
    ],
    "empty type and id": [
        _ev({"tool_calls": [{"index": 0, "id": "", "type": "",
                             "function": {"name": "f", "arguments": None}}]}, "tool_calls"),
    ],
    "reasoning and provider fields": [
        _ev({"role": "assistant", "reasoning_content": "th"}, system_fingerprint="fp"),
        _ev({"reasoning_content": "ink", "reasoning_details": [{"index": 0, "text": "a"}]}),
        _ev({"content": "ok", "annotations": [{"url": "u"}]}, "stop"),
    ],
    "two choices": [
        {**_ev({"content": "second"}), "choices": [{"index": 1, "delta": {"content": "2"}}]},
        _ev({"content": "first"}, "stop"),
    ],
    "usage under the provider's key": [
        _ev({"content": "x"}, "stop", x_groq={"usage": USAGE}),
        _ev(usage={"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}),
    ],
    "no usage at all": [_ev({"content": "x"}, "stop")],
    "usage with details": [
        _ev({"content": "x"}, "stop"),
        _ev(usage={**USAGE, "prompt_tokens_details": {"cached_tokens": 3}}),
    ],
    "no id, model or created": [
        {"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": "stop"}]},
    ],
    # not plain: read through the whole validation, as before
    "provider fields on a call": [
        _ev({"tool_calls": [{"index": 0, "id": "a", "function": {"name": "f", "arguments": "{}"},
                             "extra_content": {"google": {"thought_signature": "s"}}}]}),
    ],
    "provider fields on a function": [
        _ev({"tool_calls": [{"index": 0, "id": "a",
                             "function": {"name": "f", "arguments": "{}", "strict": True}}]}),
    ],
    "content parts": [
        _ev({"content": [{"type": "thinking", "thinking": [{"type": "text", "text": "hm"}]}]}),
        _ev({"content": [{"type": "text", "text": "ok"}]}, "stop"),
    ],
}  # fmt: skip
PLAIN = {"provider fields on a call": False, "provider fields on a function": False,
         "content parts": False}  # fmt: skip


@pytest.mark.parametrize("name", list(STREAMS))
def test_a_folded_turn_is_the_turn_of_the_whole_completion(name: str) -> None:
    got, want = _both(STREAMS[name])
    _assert_same(got, want)
    assert (_fold(STREAMS[name]).plain_turn() is not None) is PLAIN.get(name, True)


def test_a_folded_tool_call_without_a_name_or_an_id_is_what_it_was() -> None:
    """The whole validation let these through (an empty name, the id a tool_result answers):
    the folded turn keeps them so, and the pass answers the unknown tool as before."""
    got, _ = _both(STREAMS["a call without a name or an id"])
    assert got.payload["tool_calls"] == [
        {"id": "call_0", "type": "function", "function": {"name": "", "arguments": "{}"}}
    ]


def test_a_stream_without_choices_is_malformed_either_way() -> None:
    acc = _fold([_ev(usage=USAGE)])
    with pytest.raises(MalformedResponse, match="without any choices"):
        folded_turn(acc)
    with pytest.raises(MalformedResponse, match="without any choices"):
        acc.result()


def test_a_plain_turn_builds_its_completion_only_when_read(built: list[object]) -> None:
    turn = folded_turn(_fold(STREAMS["tool calls"]))
    assert built == []
    first = turn.completion
    assert turn.completion is first and len(built) == 1
    assert first.message.tool_calls is not None and first.message.tool_calls[0].id == "call_a"
    assert turn.wire == (USAGE, "c1")


def test_a_turn_stays_immutable() -> None:
    turn = folded_turn(_fold(STREAMS["text"]))
    with pytest.raises(AttributeError):
        turn.payload = {}  # type: ignore[misc]
    with pytest.raises(AttributeError):
        del turn.usage
    with pytest.raises(TypeError):
        hash(turn)
    assert "completion=ChatCompletion(" in repr(turn)
    for again in (pickle.loads(pickle.dumps(turn)), copy.copy(turn), copy.deepcopy(turn)):
        assert again == turn and again.wire[1] == turn.wire[1]


def test_a_turn_is_the_dataclass_it_was() -> None:
    """`AssistantTurn` is public: dataclasses' functions, `match` and pydantic see its fields."""
    names = ["payload", "usage", "finish_reason", "completion", "request_id"]
    folded, whole = _both(STREAMS["tool calls"])
    assert dataclasses.is_dataclass(folded) and AssistantTurn.__match_args__ == tuple(names)
    for turn in (folded, whole):
        assert [f.name for f in dataclasses.fields(turn)] == names
        assert list(dataclasses.asdict(turn)) == names
        changed = dataclasses.replace(turn, finish_reason="length")
        assert (changed.finish_reason, changed.payload) == ("length", turn.payload)
        assert changed.completion == whole.completion and changed.wire[1] == "c1"
        match turn:
            case AssistantTurn(payload, usage, reason):
                assert (payload, usage, reason) == (whole.payload, whole.usage, "tool_calls")
            case _:
                pytest.fail("no positional match")
    adapter = TypeAdapter(AssistantTurn)
    assert adapter.dump_json(folded) == adapter.dump_json(whole)
    back = adapter.validate_json(adapter.dump_json(folded))
    assert back == whole and back.wire == (whole.completion.usage, "c1")
    with pytest.raises(dataclasses.FrozenInstanceError):
        folded.finish_reason = "stop"  # type: ignore[misc]
    # A turn made without its completion keeps None there, as the dataclass did.
    bare = AssistantTurn({"content": "x"}, Usage.from_wire(None), None, None)
    completion: object = bare.completion  # typed as the reply: None only when made so
    assert (completion, bare.request_id, bare.wire) == (None, None, (None, ""))
    assert bare == AssistantTurn({"content": "x"}, Usage.from_wire(None), None, None)


def test_threads_reading_a_lazy_completion_first_build_it_once(built: list[object]) -> None:
    """Threads reading `completion` at once get the same one, built once."""
    calls = [{"index": i, "id": f"c{i}", "function": {"name": "f", "arguments": "{}"}}
             for i in range(50)]  # fmt: skip
    events = [_ev({"content": "x", "tool_calls": calls}, "tool_calls")]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, inside the build
    try:
        for _ in range(40):
            turn = folded_turn(_fold(events))
            seen: list[ChatCompletion] = []
            barrier = threading.Barrier(4)

            def read(
                turn: AssistantTurn = turn,
                seen: list[ChatCompletion] = seen,
                barrier: threading.Barrier = barrier,
            ) -> None:
                barrier.wait()
                seen.append(turn.completion)

            threads = [threading.Thread(target=read) for _ in range(4)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert len(seen) == 4 and all(got is seen[0] for got in seen)
    finally:
        sys.setswitchinterval(interval)
    assert len(built) == 40


class _Mine(AssistantTurn):
    """A subclass, as a caller may make one."""

    __slots__ = ()


def test_a_subclass_keeps_its_equality_and_type() -> None:
    """Equality and pickling use the instance's class, as a dataclass's do."""
    acc = _fold(STREAMS["text"])
    whole = turn_of(acc.result())
    args = (whole.payload, whole.usage, whole.finish_reason, whole.completion)
    mine, again = _Mine(*args), _Mine(*args)
    assert mine == again and mine != whole and whole != mine
    for copied in (pickle.loads(pickle.dumps(mine)), copy.copy(mine), copy.deepcopy(mine)):
        assert type(copied) is _Mine and copied == mine
    assert repr(mine).startswith("_Mine(payload=")
    tagged = _Tagged(*args, tag=3)
    for copied in (pickle.loads(pickle.dumps(tagged)), copy.deepcopy(tagged)):
        assert type(copied) is _Tagged and copied == tagged and copied.tag == 3
        assert copied.wire == whole.wire


def test_a_turn_pickled_as_the_plain_dataclass_loads() -> None:
    """A pickle of the plain slotted dataclass (`__newobj__` and its field values) still loads."""
    whole = turn_of(_fold(STREAMS["text"]).result(), "req-1")
    state = [whole.payload, whole.usage, whole.finish_reason, whole.completion, "req-1"]
    old = AssistantTurn.__new__(AssistantTurn)
    old.__setstate__(state)  # what unpickling did with the dataclass's `__getstate__` list
    assert old == whole and old.wire == whole.wire


@dataclasses.dataclass(frozen=True)
class _Tagged(AssistantTurn):
    """A dataclass subclass with a field of its own."""

    tag: int = 0


def _provider(server: FakeOpenAIServer) -> Provider:
    return Provider(model="m", base_url=server.base_url, api_key="k", stream=True, max_retries=0)


def test_a_streamed_pass_builds_no_completion_and_its_guardrail_gets_one(
    built: list[object],
) -> None:
    """A pass reads the turn's payload and usage; an `after` guardrail still gets the reply."""

    def lookup(key: str) -> str:
        """Look a key up."""
        return f"value of {key}"

    seen: list[ChatCompletion | None] = []

    def check(data: GuardrailInput) -> None:
        seen.append(data.reply)

    watch = Guardrail(check, "after")

    with FakeOpenAIServer() as server:
        server.enqueue(Reply(tool_calls=(ToolCallSpec("lookup", '{"key": "a"}', id="call_1"),)))
        server.enqueue(Reply(content="done"))
        user = Session.from_user_message("go")
        agent = Session.from_agent_prompt("Use tools.")
        out = run_session_loop(
            user, agent, agent_provider=_provider(server), tools=[lookup], lazy=False
        )
        assert out.stop_reason == "final_answer" and built == []
        assert out.rows[-1].payload["content"] == "done"
        assert len(out.metadata["request_usage"]) == 2
        server.enqueue(Reply(content="again"))
        run_session_loop(
            user, agent, agent_provider=_provider(server), guardrails=[watch], lazy=False
        )
    assert len(built) == 1
    assert isinstance(seen[0], ChatCompletion) and seen[0].message.content == "again"


def test_streamed_usage_details_reach_the_request_entries() -> None:
    """The entry reads the streamed usage's details from its dict, as from a whole reply's."""
    events = [
        STREAMS["usage with details"][0],
        _ev(usage={**USAGE, "prompt_tokens_details": {"cached_tokens": 3},
                   "completion_tokens_details": {"reasoning_tokens": 2}}),
    ]  # fmt: skip
    sse = b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"
    with FakeOpenAIServer() as server:
        server.enqueue(Reply.raw(sse, content_type="text/event-stream"))
        user = Session.from_user_message("go")
        agent = Session.from_agent_prompt("Talk.")
        out = run_session_loop(user, agent, agent_provider=_provider(server), lazy=False)
    [entry] = out.metadata["request_usage"]
    assert (entry.input_tokens, entry.output_tokens) == (9, 4)
    assert (entry.cached_tokens, entry.reasoning_tokens, entry.response_id) == (3, 2, "c1")


REPLIES = replies_dir()
RECORDED = sorted(REPLIES.glob("*.sse")) if REPLIES is not None else []


@pytest.mark.skipif(not RECORDED, reason="no recorded provider replies here")
def test_every_recorded_stream_folds_to_the_turn_of_its_completion() -> None:
    checked = 0
    for path in RECORDED:
        decoder = SSEDecoder()
        datas = [d for d in decoder.feed(path.read_bytes()) + decoder.flush() if d != DONE]
        accs = (StreamAccumulator(), StreamAccumulator())
        try:
            for data in datas:
                event = parse_event(data, None, None)[0]
                for acc in accs:
                    acc.add_event(json.loads(json.dumps(event)))  # each fold its own dicts
            want = turn_of(accs[1].result())
        except (ProviderError, MalformedResponse):
            continue  # an error reply: no turn either way
        _assert_same(folded_turn(accs[0]), want)
        checked += 1
    assert checked >= 10, f"only {checked} recorded streams folded"
