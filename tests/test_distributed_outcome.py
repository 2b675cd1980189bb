"""A map's driver rebuilds each output session its worker sent without validating the rows again
(the worker built them with the same checks): the session it makes is the one
`PassOutcome.session()` makes from the same data, which still validates (an outcome read from a
results file, or built by hand, may hold anything)."""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle
import re
from typing import Any

import pydantic
import pytest

from treadle import ConfigurationError, Session
from treadle.distributed.mapping import _result
from treadle.distributed.outcome import (
    OUTCOME_METADATA_KEY,
    PassFailed,
    PassItem,
    PassOutcome,
    local_metadata,
    portable_metadata,
    received_rows,
    received_session,
)
from treadle.loop import RequestUsage
from treadle.loop.control import GuardrailResult, Tripwire

MESSAGES: list[dict[str, Any]] = [
    {"role": "developer", "content": "Be brief."},
    {"role": "system", "content": "You are a test."},
    {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ],
        "reasoning_content": "kept, as a provider's extra field",
    },
    {"role": "tool", "tool_call_id": "c1", "name": "f", "content": '{"ok":true}'},
    {"role": "assistant", "content": "done"},
]

USAGE: dict[str, Any] = {
    "input_tokens": 5,
    "output_tokens": 2,
    "cached_tokens": 0,
    "reasoning_tokens": 0,
    "response_id": "r1",
    "latency_seconds": 0.5,
    "agent": "a",
    "request_id": "q1",
}


def _outcome(**changes: Any) -> PassOutcome:
    fields: dict[str, Any] = {
        "messages": copy.deepcopy(MESSAGES),
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7, "requests": 2},
        "stop_reason": "final_answer",
        "metadata": {"agent": "a", "request_usage": [USAGE, {**USAGE, "request_id": "q2"}]},
        **changes,
    }
    return PassOutcome(3, "in-id", "ok", 1, "host:1", **fields)


def _same(a: Session, b: Session) -> None:
    assert a.chunk_table == b.chunk_table
    assert [r.message_json() for r in a.chunk_table] == [r.message_json() for r in b.chunk_table]
    assert a.to_messages() == b.to_messages() == MESSAGES
    assert a.usage == b.usage and a.stop_reason == b.stop_reason
    assert a.metadata == b.metadata
    assert a.lineage.operator == b.lineage.operator and a.lineage.kind == b.lineage.kind


def test_a_received_session_is_the_one_the_validating_rebuild_makes() -> None:
    outcome = _outcome()
    sent = copy.deepcopy(outcome)
    received = received_session(outcome)
    _same(received, outcome.session())
    assert received.metadata["request_usage"][1] == RequestUsage(**{**USAGE, "request_id": "q2"})
    assert received.metadata[OUTCOME_METADATA_KEY]["input_session_id"] == "in-id"
    assert outcome == sent  # the outcome (the map's record, its results line) is left as it was
    assert received.id != received_session(outcome).id  # a fresh session each time
    # What `treadle.map(..., backend="process")` returns for it.
    mapped = _result(outcome, None)
    assert isinstance(mapped, Session)
    _same(mapped, received)


def test_a_received_outcome_with_an_unknown_role_is_still_refused() -> None:
    # Only a worker of another version could send it: the validating rebuild names the problem.
    outcome = _outcome(messages=[{"role": "narrator", "content": "x"}])
    with pytest.raises(ConfigurationError, match="narrator"):
        received_session(outcome)
    with pytest.raises(ConfigurationError, match="narrator"):
        outcome.session()


def test_metadata_that_is_not_request_usage_stays_data() -> None:
    odd = {"request_usage": [{"input_tokens": 1}, "text"], "agent": "a"}  # another version's
    received = received_session(_outcome(metadata=odd))
    assert received.metadata["request_usage"] == ({"input_tokens": 1}, "text")
    assert received.metadata == _outcome(metadata=odd).session().metadata


def test_a_workers_input_rows_are_the_ones_the_driver_meant() -> None:
    # A str input crosses as a user message, a session as its messages: a worker builds the
    # same rows from them as the validating constructor would.
    for value in ("hello", Session.from_messages(MESSAGES)):
        item = PassItem.from_input(0, value)
        assert received_rows(item.messages) == Session.from_messages(item.messages).chunk_table
    assert received_rows([{"role": "narrator", "content": "x"}]) is None


def test_request_usage_entries_that_do_not_all_fit_are_rebuilt_one_by_one() -> None:
    # Every entry a dict, one of them another version's shape: the others are still rebuilt.
    odd = {"request_usage": [USAGE, {"input_tokens": 1, "colour": "red"}], "agent": "a"}
    received = received_session(_outcome(metadata=odd))
    assert received.metadata["request_usage"] == (
        RequestUsage(**USAGE),
        {"input_tokens": 1, "colour": "red"},
    )
    assert received.metadata == _outcome(metadata=odd).session().metadata


def test_a_received_session_grows_and_forks_like_any_other() -> None:
    received = received_session(_outcome())
    longer = received.add_user_message("again")
    assert longer.to_messages() == [*MESSAGES, {"role": "user", "content": "again"}]
    assert received.to_messages() == MESSAGES  # the table it grew from is unchanged
    assert received.usage.total_tokens == 7 and received.lineage.usage == received.usage


@dataclasses.dataclass
class _Point:
    x: int
    tags: list[Any]


class _Answer(pydantic.BaseModel):
    text: str
    score: float


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        (None, None),
        ("plain", "plain"),
        (_Answer(text="t", score=0.5), {"text": "t", "score": 0.5}),
        (_Point(1, [_Point(2, [])]), {"x": 1, "tags": [{"x": 2, "tags": []}]}),
        ({"p": [_Point(3, [])]}, {"p": [{"x": 3, "tags": []}]}),
    ],
)
def test_a_workers_outcome_crosses_as_to_json_would_make_it(output: Any, expected: Any) -> None:
    # A worker sends its outcome's metadata as `portable_metadata` made it, without walking it
    # a second time: that must be what `to_json` makes, whatever the pass's output and records
    # hold.
    trip = Tripwire(reason="r", guardrail="g", when="after", info={"n": [1, 2]})
    metadata = {
        "agent": "a",
        "handoffs": ("b", "c"),
        "output": output,
        "tripwire": trip,
        "guardrail_results": (GuardrailResult(guardrail="g", when="after", tripwire=trip),),
        "request_usage": (RequestUsage(**USAGE), RequestUsage(**{**USAGE, "request_id": "q2"})),
        "not_portable": object(),
    }
    outcome = _outcome(metadata=portable_metadata(metadata))
    sent = outcome.metadata
    assert sent == outcome.to_json()["metadata"]
    assert json.dumps(sent) == json.dumps(outcome.to_json()["metadata"])  # JSON data, all of it
    # The values themselves, not only the two ways agreeing (both start from
    # `portable_metadata`): the records kept, the tripwire without its `info`, nothing else.
    trip_data = {"reason": "r", "guardrail": "g", "when": "after"}
    want: dict[str, Any] = {
        "agent": "a",
        "handoffs": ["b", "c"],
        "tripwire": trip_data,
        "guardrail_results": [
            {"guardrail": "g", "when": "after", "tripwire": trip_data, "tripped": True}
        ],
        "request_usage": [USAGE, {**USAGE, "request_id": "q2"}],
    }
    if expected is not None:
        want["output"] = expected
    assert json.loads(json.dumps(sent)) == want


def _as_rows(outcome: PassOutcome) -> PassOutcome:
    """`outcome` as a process worker sends it: its rows as `(kind, payload)` pairs."""
    table = Session.from_messages(outcome.messages or []).chunk_table
    rows = [(row.kind, row.payload) for row in table]
    return dataclasses.replace(outcome, messages=None, rows=rows)


def test_an_outcome_sent_as_rows_is_the_one_sent_as_messages() -> None:
    # A worker sends its output's rows as they are (no `to_messages`); the session the map
    # builds, what a caller of `map_outcomes` or a results file gets, are the same as from
    # messages.
    outcome = _outcome()
    sent = _as_rows(outcome)
    _same(received_session(sent), received_session(outcome))
    _same(received_session(sent), outcome.session())
    _same(sent.session(), outcome.session())
    assert sent._public() == outcome and sent._public().rows is None
    assert sent.to_json() == outcome.to_json() and "rows" not in sent.to_json()
    wire = {**outcome.to_json(), "messages": None, "rows": sent.rows}  # what crosses the pipe
    assert PassOutcome.from_json(wire).rows == sent.rows and PassOutcome.from_json(wire) == sent
    mapped = _result(sent, None)
    assert isinstance(mapped, Session)
    _same(mapped, received_session(outcome))


def test_rows_no_worker_of_this_version_sends_take_the_validating_path() -> None:
    unknown = [("narrator", {"content": "x"})]
    narrating = dataclasses.replace(_outcome(), messages=None, rows=unknown)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="narrator"):
        received_session(narrating)
    # Rows no worker sends fail that pass with an error naming the row, wherever they are read:
    # the map's output (one item, not the whole map), map_outcomes and the results file.
    hostile = {
        "row 0 is not a (kind, payload) pair": [("user",)],
        "row 1 is not a (kind, payload) pair": [("user", {"content": "a"}), "abc"],
        "row 0's payload is a str, not a dict": [("user", "notadict")],
        "row 0 (user) has the role 'system'": [("user", {"content": "x", "role": "system"})],
        "the rows are a str, not a list": "abc",
        "row 0's kind is a list, not a str": [(["user"], {"content": "x"})],
        "row 0 (user) has the role None": [("user", {"content": "x", "role": None})],
        "row 0 (system) has the role ['developer']": [("system", {"role": ["developer"]})],
    }
    for problem, rows in hostile.items():
        bad = dataclasses.replace(_outcome(), messages=None, rows=rows)  # type: ignore[arg-type]
        with pytest.raises(PassFailed, match=re.escape(problem)):
            received_session(bad)
        failed = _result(bad, None)
        assert isinstance(failed, PassFailed), failed
        assert failed.outcome.status == "error" and failed.outcome.messages is None
        assert failed.outcome.error == f"MalformedOutput: the worker's output: {problem}"
        assert bad._public() == failed.outcome and bad.to_json() == failed.outcome.to_json()
    # An unknown kind fails that item too (the validating rebuild names it).
    narrator = _result(narrating, None)
    assert isinstance(narrator, PassFailed) and "narrator" in str(narrator.outcome.error)


def test_a_system_row_that_keeps_its_developer_role_is_trusted() -> None:
    # The one role a row's payload keeps (`ChunkRow`): it agrees with its kind.
    outcome = _outcome(messages=[{"role": "developer", "content": "be brief"}])
    sent = _as_rows(outcome)
    assert sent.rows == [("system", {"role": "developer", "content": "be brief"})]
    received, rebuilt = received_session(sent), outcome.session()
    assert received.chunk_table == rebuilt.chunk_table
    assert received.to_messages() == rebuilt.to_messages() == outcome.messages
    assert sent._public() == outcome


def test_request_usage_entries_crossing_the_pipe_are_rebuilt_field_by_field() -> None:
    # Unpickled keys (equal to the field names, not the same strings) are read by name into
    # the positional build: every field lands where it belongs, whatever the keys' order, and
    # an entry as long as a full one but with another key stays data.
    full: dict[str, Any] = {f.name: f"v-{f.name}" for f in dataclasses.fields(RequestUsage)}
    shuffled = dict(reversed(list(full.items())))
    other = {**{k: v for k, v in full.items() if k != "agent"}, "colour": "red"}
    for entries in ([full, shuffled], [full, other]):
        metadata = pickle.loads(pickle.dumps({"request_usage": entries}))
        rebuilt = local_metadata(metadata)["request_usage"]
        for entry, value in zip(entries, rebuilt, strict=True):
            if "colour" in entry:
                assert value == entry
            else:
                assert value == RequestUsage(**full)


def test_a_wire_outcome_with_every_field_is_built_as_the_keyword_call_builds_it() -> None:
    # A worker's outcome has every field and is built positionally; its keys come unpickled
    # (equal, not the same strings) and in any order. The same outcome as the keyword call
    # makes, history a tuple; a dict of as many keys with one unknown is refused as before.
    sent = _as_rows(_outcome())
    wire = {**sent.to_json(), "messages": None, "rows": sent.rows}
    shuffled = pickle.loads(pickle.dumps(dict(reversed(list(wire.items())))))
    built = PassOutcome.from_json(shuffled)
    assert built == PassOutcome(**{**wire, "history": tuple(wire["history"])})
    assert type(built.history) is tuple and built.rows == sent.rows
    assert PassOutcome.from_json({**wire, "history": []}).history == ()
    odd = {**{k: v for k, v in wire.items() if k != "rows"}, "bogus": 1}
    assert len(odd) == len(wire)
    with pytest.raises(TypeError, match="bogus"):
        PassOutcome.from_json(odd)


def test_a_workers_request_usage_crosses_as_tuples_and_comes_back_as_before() -> None:
    # A worker sends each `RequestUsage` as the tuple of its fields (fewer objects to pickle and
    # unpickle than a dict of eight keys); a caller's outcome (`map_outcomes`, the results file)
    # still has the dicts `to_json` gives, and the output session the `RequestUsage` values.
    usages = (RequestUsage(**USAGE), RequestUsage(**{**USAGE, "request_id": "q2"}))
    compact = portable_metadata({"agent": "a", "request_usage": usages}, compact=True)
    assert compact["request_usage"] == [tuple(USAGE.values()), (*list(USAGE.values())[:-1], "q2")]
    plain = portable_metadata({"agent": "a", "request_usage": usages})
    sent = pickle.loads(pickle.dumps(_as_rows(_outcome(metadata=compact))))
    before = pickle.loads(pickle.dumps(_as_rows(_outcome(metadata=plain))))
    assert sent._public() == before._public()
    assert (
        sent._public().to_json() == before._public().to_json() == _outcome(metadata=plain).to_json()
    )
    assert received_session(sent).metadata["request_usage"] == usages
    assert received_session(sent).to_messages() == received_session(before).to_messages()
    # An outcome whose rows are malformed fails its item, and its caller still gets the dicts.
    bad = dataclasses.replace(sent, rows="not rows")
    failed = bad._public()
    assert failed.status == "error" and "MalformedOutput" in (failed.error or "")
    assert failed.metadata["request_usage"] == plain["request_usage"]
    # A tuple of another length is no entry a worker sends: it stays data on both paths.
    odd = _as_rows(_outcome(metadata={"request_usage": [(1, 2)]}))
    assert odd._public().metadata["request_usage"] == [(1, 2)]
    assert received_session(odd).metadata["request_usage"] == ((1, 2),)
