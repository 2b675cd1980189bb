"""`merge` and `with_data` on pending sessions return at once, like `append`/`fork`/`to`.

Before, both read the pending side and so blocked the caller until its pass ended; from the
runtime thread that read raised instead. Passes here are real ones, held open by a gate in a
tool, so "pending" is certain and not a matter of timing.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from treadle import ConfigurationError, Provider, Session, run_session_loop, tool
from treadle.runtime import submit
from treadle.testing import FakeOpenAIServer, Reply

AGENT = Session.from_agent_prompt("sys")


def _script(request: dict[str, Any]) -> Reply:
    """Ask for the gate tool once, then answer with the user's text plus " done"."""
    messages = request["messages"]
    if messages[-1]["content"] == "fail":
        return Reply.error(400, "bad request")
    if not any(m["role"] == "tool" for m in messages):
        return Reply.tool_calls_of([("wait_for_gate", {})])
    user = next(m["content"] for m in messages if m["role"] == "user")
    return Reply.text(f"{user} done")


def _gated_pass(server: FakeOpenAIServer, gate: threading.Event, text: str) -> Session:
    """A pass whose one tool waits on `gate`: pending until the test opens it. Its final answer
    is `text` (the user message is `text` less its last word)."""

    @tool
    def wait_for_gate() -> str:
        """Wait until the test lets the pass finish."""
        assert gate.wait(60)
        return "opened"

    provider = Provider(model="m", base_url=server.base_url, api_key="k", max_retries=0)
    user = Session.from_user_message(text.rsplit(" ", 1)[0])
    return run_session_loop(user, AGENT, agent_provider=provider, tools=[wait_for_gate])


def test_merging_two_pending_passes_returns_at_once() -> None:
    gate = threading.Event()
    with FakeOpenAIServer(script=_script) as server:
        left = _gated_pass(server, gate, "left done")
        right = _gated_pass(server, gate, "right done")
        merged = left.merge(right)  # would block here until both passes end
        assert not merged.done() and not left.done() and not right.done()
        assert merged.lineage.operator == "merge"
        assert set(merged.lineage.parent_ids) == {left.id, right.id}
        gate.set()
        rows = merged.synchronize(timeout=60).rows
    eager = left.synchronize().data.table.extend(())  # both settled: the eager path now
    assert rows == left.merge(right).rows
    assert rows[: len(eager)] == eager.rows
    assert rows[-1].content == "right done"
    assert merged.usage == left.merge(right).usage


def test_merging_a_pending_pass_with_a_settled_session() -> None:
    gate = threading.Event()
    settled = Session.from_user_message("go").add_user_message("extra")
    with FakeOpenAIServer(script=_script) as server:
        pending = _gated_pass(server, gate, "it done")
        for merged in (pending.merge(settled), settled.merge(pending)):
            assert not merged.done()
        gate.set()
        assert [r.content for r in pending.merge(settled).synchronize(timeout=60).rows][-1] == (
            "extra"
        )
        assert settled.merge(pending).synchronize(timeout=60).rows[-1].content == "it done"


def test_merge_from_the_runtime_thread_does_not_raise() -> None:
    # A sync read of a pending session on the runtime thread raises (it would deadlock); a merge
    # there must not read.
    gate = threading.Event()
    with FakeOpenAIServer(script=_script) as server:
        left = _gated_pass(server, gate, "l done")
        right = _gated_pass(server, gate, "r done")

        async def merge_on_runtime() -> Session:
            return left.merge(right)

        merged = submit(merge_on_runtime()).result(timeout=30)
        gate.set()
        assert merged.synchronize(timeout=60).rows[-1].content == "r done"


def test_a_failed_side_fails_the_merge_without_waiting_for_the_other() -> None:
    gate, merged_made = threading.Event(), threading.Event()

    def script(request: dict[str, Any]) -> Reply:
        if request["messages"][-1]["content"] == "fail":
            # The failure waits for the merge: a side that failed before `merge` is read by it
            # and raises there (on a loaded machine the pass could end before the next line).
            assert merged_made.wait(60)
        return _script(request)

    with FakeOpenAIServer(script=script) as server:
        slow = _gated_pass(server, gate, "slow done")
        provider = Provider(model="m", base_url=server.base_url, api_key="k", max_retries=0)
        failing = run_session_loop(
            Session.from_user_message("fail"), AGENT, agent_provider=provider
        )
        merged = slow.merge(failing)
        merged_made.set()
        with pytest.raises(Exception, match="bad request"):
            merged.synchronize(timeout=30)  # settles with the error while `slow` still runs
        assert not slow.done()
        gate.set()
        assert slow.synchronize(timeout=60).final_text == "slow done"


def test_cancelling_a_merge_cancels_both_passes() -> None:
    gate = threading.Event()
    with FakeOpenAIServer(script=_script) as server:
        left = _gated_pass(server, gate, "l done")
        right = _gated_pass(server, gate, "r done")
        merged = left.merge(right)
        merged.cancel()
        gate.set()  # the tools return; the passes see their cancellation
        for side in (left, right):
            side.synchronize(timeout=60)
            assert side.stop_reason == "cancelled"


def test_with_data_on_a_pending_pass() -> None:
    gate = threading.Event()
    with FakeOpenAIServer(script=_script) as server:
        pending = _gated_pass(server, gate, "it done")
        relabelled = pending.with_data(stop_reason="reviewed", metadata={"by": "test"})
        assert not relabelled.done() and relabelled.id == pending.id
        with pytest.raises(ConfigurationError, match="unknown: nope"):
            pending.with_data(nope=1)  # checked at the call, not when the pass ends
        gate.set()
        assert relabelled.synchronize(timeout=60).stop_reason == "reviewed"
        assert relabelled.metadata == {"by": "test"}
        assert relabelled.rows == pending.rows and pending.stop_reason == "final_answer"
