"""A process worker's own per-pass work, made cheaper in session 19 (docs/performance.md, "Process
workers, second round"), gives what it gave before: the output's metadata as the worker sends
it (`portable_metadata`, pinned against the implementation it replaced, key order included),
the driver's request usage rebuilt from it (`local_metadata`), and the worker's input session
(`_input_session`), built without its frozen values' `__init__`s."""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import pydantic
import pytest

from test_distributed_outcome import USAGE  # one request's usage, as the outcome tests use it
from treadle import Session
from treadle.distributed.mapping import _result
from treadle.distributed.outcome import (
    PassFailed,
    PassOutcome,
    input_data,
    local_metadata,
    portable_metadata,
    received_session,
)
from treadle.distributed.outcome_metadata import _plain, json_data
from treadle.distributed.worker import _input_session
from treadle.loop import RequestUsage
from treadle.loop.control import GuardrailResult, Tripwire
from treadle.session import SessionData, Usage
from treadle.session.rows import ChunkRow, ChunkTable

_NAMES = tuple(f.name for f in dataclasses.fields(RequestUsage))


def _before(metadata: Mapping[str, Any], *, compact: bool = False) -> dict[str, Any]:
    """`portable_metadata` as it was before session 19 (the reference it must still equal)."""
    keys = ("agent", "handoffs", "handled_error", "cancel_mode", "interrupt_reason")
    out: dict[str, Any] = {k: json_data(metadata[k]) for k in keys if k in metadata}
    value = metadata.get("output")
    if isinstance(value, pydantic.BaseModel):
        out["output"] = value.model_dump(mode="json")
    elif value is not None:
        out["output"] = json_data(value)
    trip = metadata.get("tripwire")
    if trip is not None and dataclasses.is_dataclass(trip) and not isinstance(trip, type):
        out["tripwire"] = json_data(_plain(trip))
    if metadata.get("guardrail_results"):
        out["guardrail_results"] = [
            json_data({**_plain(r), "tripped": bool(r.tripped)})
            for r in metadata["guardrail_results"]
        ]
    if metadata.get("request_usage"):
        entries = metadata["request_usage"]
        compact = compact and all(type(v) is RequestUsage for v in entries)
        out["request_usage"] = [
            (
                tuple(getattr(v, n) for n in _NAMES)
                if compact
                else {n: getattr(v, n) for n in _NAMES}
            )
            if type(v) is RequestUsage
            else json_data(_plain(v))
            for v in entries
        ]
    return out


class _Answer(pydantic.BaseModel):
    text: str
    data: bytes = b""


@dataclasses.dataclass(frozen=True)
class _Usage2(RequestUsage):
    """A subclass: not an entry a worker of this version makes (sent as a dict, as before)."""


_ONE = RequestUsage(**USAGE)
_TWO = RequestUsage(**{**USAGE, "request_id": "q2"})
_TRIP = Tripwire("g", "no", {"why": "x"})

CASES: list[dict[str, Any] | Mapping[str, Any]] = [
    {},
    {"agent": "a"},
    {"request_usage": (_ONE, _TWO), "agent": "a"},  # a pass's own order: usage first
    {"request_usage": (), "agent": None, "handoffs": [{"to": "b"}], "cancel_mode": "soft"},
    {"request_usage": [_ONE, _Usage2(**USAGE)]},
    {"request_usage": [_Usage2(**USAGE)], "interrupt_reason": "stop"},
    {"output": _Answer(text="t"), "tripwire": _TRIP, "handled_error": "E: x"},
    {"output": {"k": [1, 2.5, None, True]}, "guardrail_results": (GuardrailResult("g", "after"),)},
    {"output": bytearray(b"raw"), "unknown": object(), "request_usage": (_ONE,)},
    MappingProxyType({"agent": "a", "request_usage": (_ONE,), "output": "o"}),
]


@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize("metadata", CASES)
def test_portable_metadata_is_what_it_was(metadata: Mapping[str, Any], compact: bool) -> None:
    made, before = portable_metadata(metadata, compact=compact), _before(metadata, compact=compact)
    assert made == before
    assert list(made) == list(before)  # the same keys in the same order
    for key in made:
        assert type(made[key]) is type(before[key])
    if "request_usage" in before:
        assert [type(e) for e in made["request_usage"]] == [
            type(e) for e in before["request_usage"]
        ]
    if isinstance(metadata.get("output"), bytearray):  # a caller's buffer stays itself
        assert made["output"] is metadata["output"]


@pytest.mark.parametrize(
    "entries",
    [
        [],
        [tuple(USAGE.values())],
        [tuple(USAGE.values()), tuple(_TWO.__getattribute__(n) for n in _NAMES)],
        [tuple(USAGE.values()), (1, 2)],  # one of another length: each on its own, as before
        [tuple(USAGE.values()), dict(USAGE)],  # a mix of forms
        [dict(USAGE), {**USAGE, "request_id": "q2"}],
        [dict(USAGE), {"colour": "red"}],
        ((1, 2, 3),),
    ],
)
def test_request_usage_is_rebuilt_as_before(entries: Any) -> None:
    metadata = pickle.loads(pickle.dumps({"agent": "a", "request_usage": entries}))
    rebuilt = local_metadata(metadata)["request_usage"]
    assert type(rebuilt) is tuple and len(rebuilt) == len(entries)
    every_tuple = all(type(e) is tuple and len(e) == len(_NAMES) for e in entries)
    for entry, value in zip(entries, rebuilt, strict=True):
        if every_tuple:  # a worker's compact form (a tuple among others stays data)
            assert type(value) is RequestUsage and value == RequestUsage(*entry)
        elif type(entry) is dict and set(entry) == set(_NAMES):
            assert type(value) is RequestUsage and value == RequestUsage(**entry)
        else:
            assert value == entry  # what does not fit stays data
    assert local_metadata({"agent": "a"}) == {"agent": "a"}
    assert local_metadata({"tripwire": None}) == {"tripwire": None}


def test_a_workers_input_session_is_the_one_the_constructor_makes() -> None:
    messages = [
        {"role": "developer", "content": "brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": None, "tool_calls": []},
    ]
    made = _input_session(messages)
    table = ChunkTable([ChunkRow.from_message(m) for m in messages])
    before = Session(table, operator="from_messages", kind="user")
    assert type(made) is Session and type(made.data) is SessionData
    assert made.data == before.data and made.chunk_table == before.chunk_table
    assert type(made.usage) is Usage and made.usage == Usage()
    assert made.stop_reason is None and made.metadata == {} and made.done()
    with pytest.raises(TypeError):
        made.metadata["x"] = 1  # type: ignore[index]  # read-only, as the default is
    assert (made.lineage.operator, made.lineage.kind, made.lineage.parents) == (
        "from_messages",
        "user",
        (),
    )
    assert made.lineage.usage == Usage() and made.id != before.id
    assert made.to_messages() == messages
    # Two inputs share nothing mutable: each its own table, its own usage value.
    other = _input_session([{"role": "user", "content": "x"}])
    assert other.chunk_table is not made.chunk_table and other.id != made.id
    assert input_data(table) == SessionData(table)
    # A message no worker of this version is sent takes the validating path, as before.
    with pytest.raises(Exception, match="narrator"):
        _input_session([{"role": "narrator", "content": "x"}])


def _finished(**changes: Any) -> dict[str, Any]:
    """A finished pass as a process worker sends it (`PassWorker.run_wire`)."""
    return {
        "index": 3,
        "session_id": "s-3",
        "status": "ok",
        "attempts": 2,
        "worker": "host:9",
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7, "requests": 1},
        "stop_reason": "final_answer",
        "metadata": {"agent": "a", "request_usage": [tuple(USAGE.values())]},
        "kinds": ["user", "assistant"],
        "payloads": [{"content": "hi"}, {"content": "done"}],
        **changes,
    }


def _crossed(value: Any) -> Any:
    """`value` as it comes out of a worker's socket (the pipe's own pickling)."""
    from treadle.distributed.pipe import Frames, dumps_batch, frame, messages, refuse_outcome

    (batch,) = messages(Frames(), frame(dumps_batch([("done", 1, value)], refuse_outcome)))
    return batch[0][2]


def test_a_finished_pass_crosses_without_what_the_driver_can_make() -> None:
    # No `messages`, `error` or `history` cross, and the rows as two lists: the outcome built
    # from it is the one the full form (every field, the rows as pairs) built before.
    wire = _crossed(_finished())
    rows = [("user", {"content": "hi"}), ("assistant", {"content": "done"})]
    record = {"attempt": 2, "worker": "host:9", "status": "ok", "error": None}
    full = {
        **{k: v for k, v in wire.items() if k not in ("kinds", "payloads")},
        "messages": None,
        "error": None,
        "history": [record],
        "rows": rows,
    }
    built, before = PassOutcome.from_json(wire), PassOutcome.from_json(full)
    assert built == before and built.rows == before.rows == rows
    assert built.history == (record,) and type(built.history) is tuple
    assert built._public() == before._public()
    assert built._public().to_json() == before._public().to_json()
    got, want = received_session(built), received_session(before)
    assert (
        got.to_messages()
        == want.to_messages()
        == [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "done"},
        ]
    )
    assert got.usage == want.usage and got.metadata == want.metadata
    assert got.metadata["treadle.distributed"]["attempts"] == 2


def test_a_callers_values_in_a_finished_pass_cross_as_they_do_today() -> None:
    # Buffer-protocol values and other picklable objects stay themselves (pickle, not marshal),
    # shared references included; a payload with the role of its kind is kept.
    shared = [1, 2]
    payloads = [
        {"role": "developer", "content": "brief"},
        {"content": bytearray(b"raw"), "a": shared, "b": shared, "when": ("t", 1.5)},
        {"content": None, "tool_calls": [], "odd": {1: frozenset({"x"}), None: b"\x00"}},
    ]
    wire = _crossed(_finished(kinds=["system", "user", "assistant"], payloads=payloads))
    outcome = PassOutcome.from_json(wire)
    assert outcome.rows is not None
    user = outcome.rows[1][1]
    assert type(user["content"]) is bytearray and user["content"] == bytearray(b"raw")
    assert user["a"] is user["b"] and type(user["when"]) is tuple
    assert outcome.rows[2][1]["odd"] == {1: frozenset({"x"}), None: b"\x00"}
    session = received_session(outcome)
    assert session.chunk_table.rows[1].payload is user  # taken as it came, not copied
    assert session.to_messages()[0] == {"role": "developer", "content": "brief"}


@pytest.mark.parametrize(
    "kinds, payloads",
    [
        (["user"], [{"content": "a"}, {"content": "b"}]),  # lengths that differ
        ("user", [{"content": "a"}]),  # not a list
        (["user"], ({"content": "a"},)),
        (["narrator"], [{"content": "a"}]),  # a kind no row has
        (["user"], ["not a dict"]),
        (["user"], [{"role": "assistant", "content": "a"}]),  # a role its kind does not have
        ([["unhashable"]], [{"content": "a"}]),
    ],
)
def test_a_finished_pass_with_rows_no_worker_sends_fails_alone(kinds: Any, payloads: Any) -> None:
    outcome = PassOutcome.from_json(_crossed(_finished(kinds=kinds, payloads=payloads)))
    public = outcome._public()
    assert public.status in ("ok", "error")
    result = _result(outcome, None)
    assert isinstance(result, (PassFailed, Exception)), result
    with pytest.raises(Exception):  # noqa: B017  # PassFailed or ConfigurationError, naming it
        received_session(outcome)


def test_a_finished_pass_pickle_refuses_names_the_message_and_keeps_its_attempt() -> None:
    import threading

    from treadle.distributed.pipe import refuse_outcome

    lock = threading.Lock()
    wire = _finished(payloads=[{"content": "hi"}, {"content": "x", "extra": [lock]}])
    try:
        pickle.dumps(wire)
    except TypeError as err:
        kind, call_id, failed = refuse_outcome(("done", 7, wire), err)
    assert (kind, call_id, failed["status"], failed["index"]) == ("done", 7, "error", 3)
    assert "(messages[1]['extra'][0] (_thread.lock)" in failed["error"], failed["error"]
    assert failed["history"] == [
        {"attempt": 2, "worker": "host:9", "status": "error", "error": failed["error"]}
    ]
    outcome = PassOutcome.from_json(_crossed(failed))
    assert outcome.status == "error" and outcome.attempts == 2 and len(outcome.history) == 1
