"""What `run_session_loop` does on the caller's thread, kept cheap (issue 33, 100,000 submissions).

The lazy entry point plans by position (`plan_in_order`, `PassPlan` by field order) instead of
re-binding twenty-odd keywords, and lineage nodes keep plain weak references to their children.
These tests hold what that must not change: every argument lands where its keyword would, bad
input raises at the call with nothing submitted, the caller's contextvars reach its pass, and
lineage lists each living child once while a parent's list of dead ones stays bounded.
"""

from __future__ import annotations

import ast
import contextvars
import gc
import inspect
import itertools
import os
import signal
import textwrap
import threading
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from treadle import ConfigurationError, Limits, Provider, Session, run_session_loop, tool
from treadle.loop import Guardrail, Hooks, ToolGuardrail, api, planning
from treadle.loop.api import next_pass_name
from treadle.loop.plan import PassPlan
from treadle.loop.planning import PLAN_FIELDS, plan_in_order, plan_pass
from treadle.loop.soft_stop import StopRequest, sharing_stop
from treadle.runtime.background import stats
from treadle.session.lineage import PRUNE_FROM, LineageNode
from treadle.stores import Store
from treadle.testing import FakeOpenAIServer
from treadle.tools import ToolContext, ToolSet

USER = Session.from_user_message("hi")
AGENT = Session.from_agent_prompt("be brief")
UNUSED = Provider(model="m", base_url="http://127.0.0.1:9/v1", api_key="k")

flavour: contextvars.ContextVar[str] = contextvars.ContextVar("flavour", default="none")


def test_plan_in_order_gives_every_plan_field_by_position() -> None:
    # Which value goes to which field is held by `test_each_argument_lands_in_its_own_plan_field`.
    assert tuple(f.name for f in fields(PassPlan)) == PLAN_FIELDS
    assert len(_call_args(plan_in_order, "PassPlan")) == len(PLAN_FIELDS)


def test_plan_in_order_takes_plan_pass_arguments_in_plan_pass_order() -> None:
    assert list(inspect.signature(plan_in_order).parameters) == list(
        inspect.signature(plan_pass).parameters
    )


def _call_args(fn: Any, callee: str) -> list[str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == callee:
            assert not node.keywords
            return [a.id if isinstance(a, ast.Name) else ast.unparse(a) for a in node.args]
    raise AssertionError(f"{callee} is not called")


def test_run_session_loop_gives_each_argument_in_its_place() -> None:
    given = _call_args(api.run_session_loop, "plan_in_order")
    order = list(inspect.signature(plan_pass).parameters)
    assert given == [*order[:3], "None", *order[4:]]  # `emit` is None: no events
    assert _call_args(plan_pass, "plan_in_order") == order


def test_each_argument_lands_in_its_own_plan_field(tmp_path: Path) -> None:
    # The plan `plan_in_order` builds by position against one built here by keyword from the
    # call's inputs, field by field. Every field gets a value no other field has (only
    # `trace_parent` is None: tracing is off), so any two swapped positions show.
    def emit(event: Any) -> None: ...

    def on_event(event: Any) -> None: ...

    def seen(row: Any, control: Any, *, ctx: ToolContext) -> None: ...

    class Watch(Hooks):
        pass

    streaming = Provider(model="m", base_url="http://127.0.0.1:9/v1", api_key="k", stream=True)
    guard, tool_guard = Guardrail(lambda i: None, "before"), ToolGuardrail(lambda i: None)
    limits, hooks, stop, deps = Limits(max_steps=3), Watch(), StopRequest(), {"who": 1}
    with Store.sqlite(tmp_path / "s.db") as store, sharing_stop(stop):
        token = next_pass_name.set("named")  # what the next pass is called (an agent's name)
        try:
            got = plan_in_order(
                USER, AGENT, "x", emit, streaming, None, [ping], None, 7, on_event, False,
                tmp_path / "p.jsonl", limits, [guard, tool_guard], seen, {"c1": True}, hooks, deps,
                "stop_on_first_tool", False, store, "talk",
            )  # fmt: skip
        finally:
            next_pass_name.reset(token)
        want = PassPlan(
            user=USER, agent=AGENT, provider=streaming.resolve(), tools=ToolSet.build([ping]),
            executor=planning._HTTP, max_tool_rounds=7, on_event=on_event,
            persist_path=tmp_path / "p.jsonl", stream=True, limits=limits, guardrails=(guard,),
            on_message=seen, approvals={"c1": True}, emit=emit, trace_parent=None,
            agent_name="named", hooks=hooks, stop=stop, tool_guardrails=(tool_guard,),
            tool_use_behavior="stop_on_first_tool", reset_tool_choice=False,
            on_message_context="ctx", deps=deps, store=store, conversation="talk",
        )  # fmt: skip
    values = {f.name: getattr(want, f.name) for f in fields(PassPlan)}
    for a, b in itertools.combinations(values, 2):  # the test's own premise
        assert a == "trace_parent" or values[a] != values[b], (a, b)
    for name, value in values.items():
        if name == "tools":  # built anew for each pass
            assert list(got.tools) == list(value) == ["ping"]
        else:
            assert getattr(got, name) == value, name


@tool
def ping() -> str:
    """Answer pong."""
    return "pong"


@tool(name="ping")
def other_ping() -> str:
    """Answer pong too."""
    return "pong"


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"max_tool_rounds": 0}, "max_tool_rounds must be at least 1"),
        ({"max_tool_rounds": True}, "max_tool_rounds must be an int"),
        ({"tools": [ping, other_ping]}, "two tools are named 'ping'"),
        ({"tools": [ping, 3]}, "a tool must be a function or a Tool"),
        ({"limits": {"max_steps": 2}}, "limits must be a treadle Limits"),
        ({"hooks": object()}, "hooks must be a treadle Hooks"),
        ({"approvals": ["c1"]}, "approvals must map"),
        ({"on_message": "no"}, "on_message must be callable"),
        ({"tool_use_behavior": "sometimes"}, "tool_use_behavior"),
        ({"provider": UNUSED}, "give the model endpoint once"),
    ],
)
def test_bad_input_raises_at_the_call_and_starts_nothing(
    options: dict[str, Any], match: str
) -> None:
    before = stats()["pending"]
    with pytest.raises(ConfigurationError, match=match):
        run_session_loop(USER, AGENT, agent_provider=UNUSED, **options)
    assert stats()["pending"] == before


def test_no_provider_raises_at_the_call() -> None:
    with pytest.raises(ConfigurationError, match="needs agent_provider"):
        run_session_loop(USER, AGENT)


def test_the_callers_contextvars_reach_each_pass() -> None:
    @tool(name="noop")
    def noop(round: int) -> str:
        """Report the caller's flavour."""
        return flavour.get()

    with FakeOpenAIServer(script="tool_loop") as server:
        provider = Provider(model="m", base_url=server.base_url, api_key="k")
        outs: dict[str, Session] = {}

        def submit(name: str) -> None:  # from threads of their own, as a fan-out might
            flavour.set(name)
            outs[name] = run_session_loop(USER, AGENT, agent_provider=provider, tools=[noop])

        threads = [threading.Thread(target=submit, args=(n,)) for n in ("mint", "lemon")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        token = flavour.set("plain")
        try:
            outs["plain"] = run_session_loop(USER, AGENT, agent_provider=provider, tools=[noop])
        finally:
            flavour.reset(token)
        for name, out in outs.items():
            results = [r.payload["content"] for r in out.rows if r.kind == "tool_result"]
            assert results and all(name in str(text) for text in results), (name, results)


def test_a_parent_given_twice_lists_its_child_once() -> None:
    parent = LineageNode("p", "new", "user")
    child = LineageNode("c", "merge", "user", [parent, parent])
    assert parent.children == [child]
    assert parent.descendants() == [child]


def test_dead_children_are_dropped_and_the_list_stays_bounded() -> None:
    parent = LineageNode("p", "new", "agent")
    kept = [LineageNode(f"k{i}", "run", "output", [parent]) for i in range(3)]
    for i in range(20 * PRUNE_FROM):
        LineageNode(f"d{i}", "run", "output", [parent])  # dropped at once
    gc.collect()
    assert parent._children is not None
    assert len(parent._children) <= 2 * PRUNE_FROM
    assert parent.children == kept
    assert len(parent._children) == 3  # reading dropped the dead ones


def test_a_child_lives_no_longer_for_its_parent() -> None:
    import weakref

    parent = LineageNode("p", "new", "user")
    child = LineageNode("c", "fork", "user", [parent])
    seen = weakref.ref(child)
    del child
    gc.collect()
    assert seen() is None
    assert parent.children == []


def test_pending_outputs_are_children_of_both_inputs() -> None:
    with FakeOpenAIServer(script="echo") as server:
        provider = Provider(model="m", base_url=server.base_url, api_key="k")
        user, agent = Session.from_user_message("hello"), Session.from_agent_prompt("sys")
        outs = [run_session_loop(user, agent, agent_provider=provider) for _ in range(5)]
        ids = sorted(o.id for o in outs)
        assert [n.id for n in user.lineage.children] == ids
        assert [n.id for n in agent.lineage.children] == ids
        for out in outs:
            assert out.lineage.parent_ids == (user.id, agent.id)
            out.synchronize(30)
        follow = outs[0].add_user_message("more")
        assert outs[0].lineage.children == [follow.lineage]
        assert follow.lineage in user.lineage.descendants()


def test_a_pending_output_is_the_facade_session_pending_would_build() -> None:
    with FakeOpenAIServer(script="echo") as server:
        provider = Provider(model="m", base_url=server.base_url, api_key="k")
        out = run_session_loop(USER, AGENT, agent_provider=provider)
        node = out.lineage
        assert (node.id, node.operator, node.kind) == (out.id, "run_session_loop", "output")
        assert node.parents == (USER.lineage, AGENT.lineage)
        assert not out.done() or node.usage is not None
        out.synchronize(30)
        assert node.usage == out.usage and out.usage.requests == 1  # recorded when it settled
        merged = out.merge(out.fork())  # merge counts the shared usage once
        assert merged.usage == out.usage


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_while_a_thread_derives_sessions_can_derive_its_own() -> None:
    # Another thread takes lineage's module lock for every session it derives; a child forked
    # while that thread held it must not inherit it held (the after-fork hook renews it).
    stop = threading.Event()

    def derive() -> None:
        while not stop.is_set():
            USER.fork()

    deriver = threading.Thread(target=derive, daemon=True)
    deriver.start()
    outcomes: list[int] = []
    try:
        for _ in range(200):
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    # A child that deadlocks is killed (pytest-timeout's own SIGALRM handler
                    # would raise instead, and the child would exit as if it had finished).
                    signal.signal(signal.SIGALRM, signal.SIG_DFL)
                    signal.alarm(20)
                    USER.fork().add_user_message("more")
                    code = 0
                finally:
                    os._exit(code)
            _, status = os.waitpid(pid, 0)
            outcomes.append(status)
            if status != 0:
                break  # one hung child is the failure: do not wait out the others
    finally:
        stop.set()
        deriver.join()
    hung = [s for s in outcomes if os.WIFSIGNALED(s) and os.WTERMSIG(s) == signal.SIGALRM]
    assert not hung, f"{len(hung)} of {len(outcomes)} forked children deadlocked"
    assert outcomes == [0] * 200
