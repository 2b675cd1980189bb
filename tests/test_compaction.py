"""Compaction: cut-point invariants (property test), the summary row, automatic compaction in an
agent (estimate threshold, mid-pass) and one retry after a `ContextLengthError`."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from treadle import ContextLengthError, Session
from treadle.agents import (
    SUMMARY_PREFIX,
    Agent,
    TokenEstimator,
    compaction_cut,
    run_session_compress,
)
from treadle.llm import Provider
from treadle.loop import CompletionRequest
from treadle.session import ChunkRow
from treadle.testing import FakeOpenAIServer, Reply
from treadle.testing.scripted import ScriptedExecutor, text, tool_call

_ids = itertools.count()
AGENT = Session.from_agent_prompt("You help.")


def _is_summary_request(request: CompletionRequest) -> bool:
    first = request.rows[0].content if request.rows else ""
    return isinstance(first, str) and "<conversation>" in first


def _summariser(request: CompletionRequest) -> dict[str, Any]:
    if _is_summary_request(request):
        return text("SUMMARY of earlier work")
    return text("answer")


def _call_block(n_calls: int, with_results: bool = True) -> list[ChunkRow]:
    ids = [f"c{next(_ids)}" for _ in range(n_calls)]
    calls = [
        {"id": i, "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in ids
    ]
    rows = [ChunkRow("assistant", {"content": None, "tool_calls": calls})]
    if with_results:
        rows += [
            ChunkRow("tool_result", {"tool_call_id": i, "name": "f", "content": '{"ok":true}'})
            for i in ids
        ]
    return rows


block = st.one_of(
    st.just("user").map(lambda _: [ChunkRow.user("question")]),
    st.just("text").map(lambda _: [ChunkRow("assistant", {"content": "reply"})]),
    st.just("system").map(lambda _: [ChunkRow.system("rule")]),
    st.integers(1, 4).map(_call_block),
)


@st.composite
def transcripts(draw: st.DrawFn) -> list[ChunkRow]:
    rows = [row for b in draw(st.lists(block, max_size=25)) for row in b]
    if draw(st.booleans()):  # a pass that stopped with calls still unanswered
        rows += _call_block(draw(st.integers(1, 2)), with_results=False)
    return rows


def _pairs_ok(rows: list[ChunkRow]) -> bool:
    """Every result has its call earlier; every call before the last assistant row has a result."""
    issued: set[str] = set()
    answered: set[str] = set()
    for row in rows:
        if row.kind == "assistant":
            issued.update(str(c["id"]) for c in row.tool_calls)
        elif row.kind == "tool_result":
            if row.payload["tool_call_id"] not in issued:
                return False
            answered.add(row.payload["tool_call_id"])
    last_calls = next((r for r in reversed(rows) if r.kind == "assistant" and r.tool_calls), None)
    pending = {str(c["id"]) for c in last_calls.tool_calls} if last_calls else set()
    return issued - answered <= pending


@given(transcripts(), st.integers(0, 12))
def test_cut_never_splits_a_call_from_its_result(rows: list[ChunkRow], keep: int) -> None:
    cut = compaction_cut(rows, keep)
    assert 0 <= cut <= len(rows)
    head_calls = {str(c["id"]) for r in rows[:cut] if r.kind == "assistant" for c in r.tool_calls}
    tail_results = {r.payload["tool_call_id"] for r in rows[cut:] if r.kind == "tool_result"}
    assert not head_calls & tail_results
    kept = [r for r in rows[cut:] if r.kind != "system"]
    assert len(kept) >= min(keep, len([r for r in rows if r.kind != "system"]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(transcripts(), st.integers(0, 8))
def test_compress_invariants(rows: list[ChunkRow], keep: int) -> None:
    session = Session(rows)
    out = run_session_compress(
        session, AGENT, executor=ScriptedExecutor(default=_summariser), keep_last=keep
    )
    new = list(out.rows)
    assert [r.content for r in new if r.kind == "system"] == [
        r.content for r in rows if r.kind == "system"
    ]
    assert _pairs_ok(new)
    cut = compaction_cut(rows, keep)
    summarised = [r for r in rows[:cut] if r.kind != "system"]
    assert new[len(new) - (len(rows) - cut) :] == rows[cut:]  # the tail is verbatim
    summaries = [r for r in new if r.kind == "user" and str(r.content).startswith(SUMMARY_PREFIX)]
    assert len(summaries) == (1 if summarised else 0)
    if summarised:
        assert len(new) <= len(rows)
        assert out.metadata["compaction"]["summarised_rows"] == len(summarised)


def test_compress_summary_row_and_usage() -> None:
    rows = [ChunkRow.system("sys"), *[ChunkRow.user(f"u{i}") for i in range(10)]]
    session = Session(rows)
    ex = ScriptedExecutor([text("they asked ten things", usage={"prompt_tokens": 40})])
    out = run_session_compress(session, AGENT, executor=ex, keep_last=3)
    assert [r.content for r in out.rows] == [
        "sys",
        SUMMARY_PREFIX + "they asked ten things",
        "u7",
        "u8",
        "u9",
    ]
    assert out.usage.prompt_tokens == 40
    sent = ex.requests[0].rows[0].content
    assert "User: u0" in sent and "User: u6" in sent and "u7" not in sent
    assert ex.requests[0].agent_rows[0].content == "You help."
    assert session.id in out.lineage.parent_ids


def test_compress_with_nothing_to_summarise_keeps_rows() -> None:
    session = Session([ChunkRow.user("only")])
    ex = ScriptedExecutor()
    out = run_session_compress(session, AGENT, executor=ex, keep_last=4)
    assert [r.content for r in out.rows] == ["only"]
    assert ex.requests == []


def test_token_estimator_calibrates_from_usage() -> None:
    est = TokenEstimator()
    assert est.estimate(4000) == 1000
    est.observe(prompt_tokens=500, nbytes=4000)  # this model packs more bytes per token
    assert est.estimate(4000) < 1000
    user = Session.from_user_message("x" * 400)
    ex = ScriptedExecutor([text("ok", usage={"prompt_tokens": 50, "completion_tokens": 1})])
    agent = Agent("a", "sys", executor=ex)
    agent(user).synchronize()  # the agent calibrates after each pass
    sent = len(agent.agent_session.rows[0].message_json()) + len(user.rows[0].message_json())
    assert agent.estimator.tokens_per_byte == pytest.approx((0.25 + 50 / sent) / 2)


def test_agent_compacts_before_a_request_over_the_threshold() -> None:
    history = Session.from_messages(
        [{"role": "user", "content": "x" * 400}, {"role": "assistant", "content": "y" * 400}] * 5
    ).add_user_message("latest question")
    ex = ScriptedExecutor(default=_summariser)
    agent = Agent("a", "sys", executor=ex, compact_at_tokens=500, compact_keep_last=2)
    out = agent(history)
    assert out.final_text == "answer"
    assert [r.kind for r in out.rows] == ["user", "assistant", "user", "assistant"]
    assert out.rows[0].content == SUMMARY_PREFIX + "SUMMARY of earlier work"
    assert out.rows[2].content == "latest question"
    answer_request = ex.requests[-1]
    assert len(answer_request.rows) == 3  # summary, kept assistant row, the question


def test_agent_compacts_in_the_middle_of_a_tool_loop() -> None:
    calls = itertools.count()

    def script(request: CompletionRequest) -> dict[str, Any]:
        if _is_summary_request(request):
            return text("SUMMARY of the tool work")
        if next(calls) < 8:
            return tool_call("grow", {})
        return text("finished")

    def grow() -> str:
        """Return a lot of text."""
        return "z" * 600

    ex = ScriptedExecutor(default=script)
    agent = Agent("a", executor=ex, tools=[grow], compact_at_tokens=700, compact_keep_last=2)
    out = agent("start")
    assert out.final_text == "finished"
    assert out.stop_reason == "final_answer"
    assert any(str(r.content).startswith(SUMMARY_PREFIX) for r in out.rows if r.kind == "user")
    assert _pairs_ok(list(out.rows))
    assert sum(1 for r in ex.requests if _is_summary_request(r)) >= 1
    assert out.tripwire is None


def test_context_length_error_triggers_one_compaction_and_retry() -> None:
    def script(body: dict[str, Any]) -> Reply:
        messages = body["messages"]
        if "<conversation>" in str(messages[-1]["content"]):
            return Reply.text("short summary")
        if len(messages) > 4:
            return Reply.context_length_exceeded()
        return Reply.text("fits now")

    history = Session.from_messages([{"role": "user", "content": f"q{i}"} for i in range(8)])
    with FakeOpenAIServer(script=script) as server:
        provider = Provider(
            model="fake", base_url=server.base_url, api_key="sk-test", max_retries=0
        )
        agent = Agent("a", "sys", provider=provider, compact_keep_last=2)
        out = agent(history)
        assert out.final_text == "fits now"
        assert [r.content for r in out.rows[:3]] == [SUMMARY_PREFIX + "short summary", "q6", "q7"]
        assert len(server.requests) == 3  # overflow, summary, retry
        strict = Agent("b", "sys", provider=provider, compact_on_overflow=False)
        with pytest.raises(ContextLengthError):
            strict(history).synchronize()


def test_context_length_error_that_persists_is_raised() -> None:
    def script(body: dict[str, Any]) -> Reply:
        if "<conversation>" in str(body["messages"][-1]["content"]):
            return Reply.text("summary")
        return Reply.context_length_exceeded("vllm")

    with FakeOpenAIServer(script=script) as server:
        provider = Provider(
            model="fake", base_url=server.base_url, api_key="sk-test", max_retries=0
        )
        history = Session.from_messages([{"role": "user", "content": f"q{i}"} for i in range(8)])
        with pytest.raises(ContextLengthError):
            Agent("a", provider=provider, compact_keep_last=1)(history).synchronize()
        assert len(server.requests) == 3  # overflow, summary, overflow again: no loop


def test_compacted_rows_are_valid_json_messages() -> None:
    rows = [ChunkRow.user("a"), *_call_block(2), ChunkRow.user("b"), *_call_block(1)]
    out = run_session_compress(
        Session(rows), AGENT, executor=ScriptedExecutor(default=_summariser), keep_last=1
    )
    messages = out.to_messages()
    json.dumps(messages)
    assert messages[-2]["role"] == "assistant" and messages[-1]["role"] == "tool"
