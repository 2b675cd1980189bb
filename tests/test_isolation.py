"""Shared runtime, separate fates: no pass, tool or callback can hang or kill the others.

Each hostile tool or callback runs beside 100 bystander passes on the one background runtime; the
bystanders' transcripts must come out identical to a run without the hostile pass, and the runtime
must be the same living runtime afterwards. Nested passes started and read from sync tools and
sync guardrails must finish at any count. Timeouts here are generous hang guards, never
performance assertions.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from treadle import Session, load_session
from treadle.errors import HookError, SessionFailedError
from treadle.llm import Provider
from treadle.loop import Guardrail, HookContext, Hooks, Limits, ToolGuardrail, run_session_loop
from treadle.runtime import get_runtime, stats
from treadle.testing import FakeOpenAIServer
from treadle.testing.scripted import ScriptedExecutor, text, tool_call, tool_calls
from treadle.tools import tool

AGENT = Session.from_agent_prompt("You are terse.")
HANG_GUARD = 120.0
BYSTANDERS = 100


@tool
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: first addend
        b: second addend
    """
    return a + b


def _bystander_script(i: int) -> ScriptedExecutor:
    return ScriptedExecutor([tool_call("add", {"a": i, "b": 1}, id=f"b{i}"), text(f"sum {i + 1}")])


def _run_bystanders() -> list[Session]:
    return [
        run_session_loop(
            Session.from_user_message(f"add {i}"), AGENT, executor=_bystander_script(i)
        )
        for i in range(BYSTANDERS)
    ]


def _transcripts(outs: list[Session]) -> list[list[dict[str, Any]]]:
    return [o.synchronize(HANG_GUARD).to_messages() for o in outs]


@pytest.fixture(scope="module")
def baseline() -> list[list[dict[str, Any]]]:
    return _transcripts(_run_bystanders())


def _result(out: Session, index: int = -2) -> dict[str, Any]:
    """The tool result the model saw (by default the one before the final answer)."""
    row = out.rows[index]
    assert row.kind == "tool_result"
    return json.loads(row.payload["content"])  # type: ignore[no-any-return]


# -- the hostile tools and callbacks ------------------------------------------------------------
def _exit_like_argparse(args: str) -> str:
    import argparse

    parser = argparse.ArgumentParser(prog="count")
    parser.add_argument("--n", type=int, required=True)
    return str(parser.parse_args(args.split()).n)  # bad input: argparse calls sys.exit(2)


@tool
def parse_cli(args: str) -> str:
    """Parse a command line the argparse way."""
    with _quiet_stderr():
        return _exit_like_argparse(args)


class _quiet_stderr:
    def __enter__(self) -> None:
        self._old, sys.stderr = sys.stderr, open("/dev/null", "w")

    def __exit__(self, *exc: object) -> None:
        sys.stderr.close()
        sys.stderr = self._old


@tool
async def async_exit() -> None:
    """Calls sys.exit(1) on the event loop."""
    sys.exit(1)


@tool
def sync_interrupt() -> None:
    """Raises KeyboardInterrupt on a worker thread."""
    raise KeyboardInterrupt


@tool
async def async_interrupt() -> None:
    """Raises KeyboardInterrupt on the event loop."""
    raise KeyboardInterrupt


_release_stuck = threading.Event()


@tool
def stuck_sync() -> str:
    """Never returns in time and ignores cancellation."""
    _release_stuck.wait(HANG_GUARD)
    return "late"


@tool
async def stuck_async() -> str:
    """Never returns (until cancelled)."""
    await asyncio.sleep(3600)
    return "never"


def _tool_pass(name: str, **options: Any) -> Session:
    ex = ScriptedExecutor(
        [tool_call(name, {"args": "--n x"} if name == "parse_cli" else {}, id="h"), "done"]
    )
    tools = [parse_cli, async_exit, sync_interrupt, async_interrupt, stuck_sync, stuck_async]
    return run_session_loop(
        Session.from_user_message("go"), AGENT, executor=ex, tools=tools, **options
    )


def _raise_exit(*_args: Any) -> None:
    raise SystemExit(3)


def _raise_interrupt(*_args: Any) -> None:
    raise KeyboardInterrupt


class _SyncExitingExecutor:
    def complete(self, request: Any) -> Any:
        raise SystemExit(4)


def _guardrail_exit() -> Session:
    return run_session_loop(
        Session.from_user_message("go"),
        AGENT,
        executor=ScriptedExecutor(["never"]),
        guardrails=[Guardrail(_raise_exit)],
    )


def _on_message_interrupt() -> Session:
    return run_session_loop(
        Session.from_user_message("go"),
        AGENT,
        executor=ScriptedExecutor(["hello"]),
        on_message=_raise_interrupt,
    )


def _executor_exit() -> Session:
    return run_session_loop(Session.from_user_message("go"), AGENT, executor=_SyncExitingExecutor())


def _budget_exit() -> Session:
    provider = Provider(model="scripted", budget_total_tokens=1, on_budget_exceeded=_raise_exit)
    return run_session_loop(
        Session.from_user_message("go"),
        AGENT,
        agent_provider=provider,
        executor=ScriptedExecutor(["hello"]),
    )


def _tool_error(kind: str) -> Callable[[Session], None]:
    def check(out: Session) -> None:
        assert out.stop_reason == "final_answer"
        body = _result(out)
        assert body["ok"] is False
        assert body["error_kind"] == kind

    return check


def _pass_failed(cause: type[BaseException]) -> Callable[[Session], None]:
    def check(out: Session) -> None:
        for _ in range(2):  # re-raised on every read
            with pytest.raises(SessionFailedError) as info:
                out.synchronize(HANG_GUARD)
            assert isinstance(info.value.__cause__, cause)
            assert "other passes were not affected" in str(info.value)

    return check


class _ExitingHooks(Hooks):
    def on_model_start(self, ctx: HookContext, messages: list[dict[str, Any]]) -> None:
        raise SystemExit(5)


class _InterruptingHooks(Hooks):
    async def on_tool_start(self, ctx: HookContext, call: Any) -> None:
        raise KeyboardInterrupt


_release_hook = threading.Event()


class _HangingSyncHooks(Hooks):
    timeout = 0.2

    def on_model_end(self, ctx: HookContext, row: Any) -> None:
        _release_hook.wait(HANG_GUARD)  # ignores cancellation: its thread is abandoned


class _HangingAsyncHooks(Hooks):
    timeout = 0.2

    async def on_model_start(self, ctx: HookContext, messages: Any) -> None:
        await asyncio.sleep(3600)


def _hook_pass(hooks: Hooks) -> Session:
    ex = ScriptedExecutor([tool_call("add", {"a": 1, "b": 2}, id="k"), "done"])
    return run_session_loop(
        Session.from_user_message("go"), AGENT, executor=ex, tools=[add], hooks=hooks
    )


def _hanging_hook_pass() -> Session:
    _release_hook.clear()
    return _hook_pass(_HangingSyncHooks())


def _hook_failed(out: Session) -> None:
    for _ in range(2):  # re-raised on every read, as a plain exception of its own pass
        with pytest.raises(HookError, match="its pass failed"):
            out.synchronize(HANG_GUARD)
    _release_hook.set()  # let an abandoned hook thread end


async def _parallel_guard_exit(data: Any) -> None:
    raise SystemExit(6)


async def _parallel_guard_ok(data: Any) -> None:
    return None


def _parallel_guardrails_exit() -> Session:
    return run_session_loop(
        Session.from_user_message("go"),
        AGENT,
        executor=ScriptedExecutor(["never"]),
        guardrails=[
            Guardrail(_parallel_guard_ok, "input"),
            Guardrail(_parallel_guard_exit, "input"),
        ],
    )


async def _stuck_guard(data: Any) -> None:
    await asyncio.sleep(3600)


def _stuck_input_guardrail() -> Session:
    return run_session_loop(
        Session.from_user_message("go"),
        AGENT,
        executor=ScriptedExecutor(["answered"]),
        guardrails=[Guardrail(_stuck_guard, "input")],
    )


def _cancel_frees_it(out: Session) -> None:
    out.cancel()  # the hung guardrail holds only its own pass, which a cancel ends
    assert out.synchronize(HANG_GUARD).stop_reason == "cancelled"
    assert out.usage.requests == 0  # the raced model call is not charged


def _tool_guardrail_interrupt() -> Session:
    ex = ScriptedExecutor([tool_call("add", {"a": 1, "b": 2}, id="t"), "done"])
    return run_session_loop(
        Session.from_user_message("go"),
        AGENT,
        executor=ex,
        tools=[add],
        guardrails=[ToolGuardrail(_raise_interrupt)],
    )


HOSTILE: dict[str, tuple[Callable[[], Session], Callable[[Session], None]]] = {
    "sync tool exits like argparse": (
        lambda: _tool_pass("parse_cli"),
        _tool_error("tool_execution_exception"),
    ),
    "async tool calls sys.exit": (
        lambda: _tool_pass("async_exit"),
        _tool_error("tool_execution_exception"),
    ),
    "sync tool raises KeyboardInterrupt": (
        lambda: _tool_pass("sync_interrupt"),
        _tool_error("tool_execution_exception"),
    ),
    "async tool raises KeyboardInterrupt": (
        lambda: _tool_pass("async_interrupt"),
        _tool_error("tool_execution_exception"),
    ),
    "sync tool ignores cancellation past the pass's tool timeout": (
        lambda: _tool_pass("stuck_sync", limits=Limits(tool_timeout_seconds=0.2)),
        _tool_error("timeout"),
    ),
    "async tool never returns, bounded by the deadline": (
        lambda: _tool_pass("stuck_async", limits=Limits(deadline_seconds=0.3)),
        lambda out: (
            _result(out, -1)["error_kind"] == "timeout" or pytest.fail(str(out.rows)),
            out.stop_reason == "deadline" or pytest.fail(str(out.stop_reason)),
        ),
    ),
    "guardrail raises SystemExit": (_guardrail_exit, _pass_failed(SystemExit)),
    "on_message raises KeyboardInterrupt": (_on_message_interrupt, _pass_failed(KeyboardInterrupt)),
    "sync executor raises SystemExit": (_executor_exit, _pass_failed(SystemExit)),
    "budget callback raises SystemExit": (_budget_exit, _pass_failed(SystemExit)),
    "sync hook raises SystemExit": (lambda: _hook_pass(_ExitingHooks()), _hook_failed),
    "async hook raises KeyboardInterrupt": (
        lambda: _hook_pass(_InterruptingHooks()),
        _hook_failed,
    ),
    "sync hook hangs past Hooks.timeout": (_hanging_hook_pass, _hook_failed),
    "async hook never returns": (lambda: _hook_pass(_HangingAsyncHooks()), _hook_failed),
    "concurrent input guardrails, one raises SystemExit": (
        _parallel_guardrails_exit,
        _pass_failed(SystemExit),
    ),
    "input guardrail never returns; cancelling its pass frees it": (
        _stuck_input_guardrail,
        _cancel_frees_it,
    ),
    "tool guardrail raises KeyboardInterrupt": (
        _tool_guardrail_interrupt,
        _pass_failed(KeyboardInterrupt),
    ),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_pass_beside_bystanders(case: str, baseline: list[list[dict[str, Any]]]) -> None:
    runtime = get_runtime()
    start, check = HOSTILE[case]
    bystanders = _run_bystanders()
    hostile = start()
    check(hostile)
    assert _transcripts(bystanders) == baseline
    assert get_runtime() is runtime and runtime.alive  # the same runtime lived through it


def test_abandoned_sync_tool_is_counted_for_operators() -> None:
    before = stats()["abandoned_total"]
    out = _tool_pass("stuck_sync", limits=Limits(tool_timeout_seconds=0.1)).synchronize(HANG_GUARD)
    body = _result(out)
    assert body["error_kind"] == "timeout"
    assert "may still be running" in body["message"]
    counted = stats()
    assert counted["abandoned_total"] >= before + 1
    assert counted["abandoned_running"] >= 1
    _release_stuck.set()  # let the abandoned threads finish; the running count drops back
    deadline = time.monotonic() + HANG_GUARD
    while stats()["abandoned_running"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert stats()["abandoned_running"] == 0
    _release_stuck.clear()


def test_a_tool_without_timeout_gets_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    import treadle.tools.dispatch as dispatch

    assert dispatch.DEFAULT_TOOL_TIMEOUT == 600.0
    assert stuck_async.timeout is None
    monkeypatch.setattr(dispatch, "DEFAULT_TOOL_TIMEOUT", 0.1)  # no tool or pass timeout set
    out = _tool_pass("stuck_async").synchronize(HANG_GUARD)
    assert _result(out)["error_kind"] == "timeout"
    assert "0.1 s timeout" in _result(out)["message"]


# -- starvation: nested passes started and read from worker threads -----------------------------
def _sub_agent(i: int) -> str | None:
    """What a hand-written agent-as-tool does: start a pass (with a sync tool) and read it."""
    inner = run_session_loop(
        Session.from_user_message(f"inner {i}"), AGENT, executor=_bystander_script(i), tools=[add]
    )
    return inner.final_text


@tool
def delegate(i: int) -> str | None:
    """Ask a sub-agent."""
    return _sub_agent(i)


def test_two_hundred_nested_sync_sub_agents_in_one_round() -> None:
    calls = [("delegate", {"i": i}) for i in range(200)]
    ex = ScriptedExecutor([tool_calls(calls, ids=[f"d{i}" for i in range(200)]), "all done"])
    out = run_session_loop(Session.from_user_message("fan"), AGENT, executor=ex, tools=[delegate])
    out.synchronize(HANG_GUARD)
    assert out.stop_reason == "final_answer"
    results = [json.loads(r.payload["content"]) for r in out.rows if r.kind == "tool_result"]
    assert [r["result"] for r in results] == [f"sum {i + 1}" for i in range(200)]


@tool
def descend(depth: int) -> int:
    """Start a pass one level deeper and read it (from this sync tool's thread)."""
    if depth == 0:
        return 0
    script = ScriptedExecutor(
        [tool_call("descend", {"depth": depth - 1}, id=f"l{depth}"), text(str(depth))]
    )
    inner = run_session_loop(
        Session.from_user_message("down"), AGENT, executor=script, tools=[descend]
    )
    return int(inner.final_text or "-1")


def test_nesting_deeper_than_the_sync_tool_slots() -> None:
    depth = 70  # > SYNC_TOOL_THREADS: each level's thread waits on the next
    assert descend.timeout is None
    ex = ScriptedExecutor([tool_call("descend", {"depth": depth}, id="top"), "bottom reached"])
    out = run_session_loop(Session.from_user_message("dive"), AGENT, executor=ex, tools=[descend])
    assert out.synchronize(HANG_GUARD).final_text == "bottom reached"
    assert _result(out)["result"] == depth


def test_hundred_sync_guardrails_each_running_a_persisted_sub_pass(tmp_path: Path) -> None:
    def judge(data: Any) -> bool:
        verdict = run_session_loop(
            Session.from_user_message("judge"),
            AGENT,
            executor=ScriptedExecutor(["fine"]),
            persist_path=tmp_path / "judges",
        )
        return verdict.final_text != "fine"  # trips only if the judge misbehaved

    outs = [
        run_session_loop(
            Session.from_user_message(f"q {i}"),
            AGENT,
            executor=ScriptedExecutor([f"a {i}"]),
            guardrails=[Guardrail(judge)],
            persist_path=tmp_path / "outer",
        )
        for i in range(100)
    ]
    assert [o.synchronize(HANG_GUARD).final_text for o in outs] == [f"a {i}" for i in range(100)]
    assert len(list((tmp_path / "judges").glob("*.jsonl"))) == 100
    outer = list((tmp_path / "outer").glob("*.jsonl"))
    assert len(outer) == 100
    assert all(load_session(path).closed for path in outer)


def test_unrelated_passes_go_on_while_every_sync_tool_slot_waits(tmp_path: Path) -> None:
    gate = threading.Event()

    @tool
    def waiting(i: int) -> str | None:
        """Read a sub-pass that waits for the gate."""

        async def gated(_request: Any) -> str:
            while not gate.is_set():
                await asyncio.sleep(0.01)
            return "opened"

        inner = run_session_loop(
            Session.from_user_message("w"), AGENT, executor=ScriptedExecutor([gated])
        )
        return inner.final_text

    calls = [("waiting", {"i": i}) for i in range(80)]  # more than the 64 sync-tool slots
    ex = ScriptedExecutor([tool_calls(calls, ids=[f"w{i}" for i in range(80)]), "done"])
    blocked = run_session_loop(Session.from_user_message("x"), AGENT, executor=ex, tools=[waiting])
    # While 80 sync tools wait, an unrelated persisted pass with a sync tool still finishes.
    other = run_session_loop(
        Session.from_user_message("y"),
        AGENT,
        executor=_bystander_script(7),
        tools=[add],
        persist_path=tmp_path,
    )
    assert other.synchronize(HANG_GUARD).final_text == "sum 8"
    assert not blocked.done()
    gate.set()
    assert blocked.synchronize(HANG_GUARD).final_text == "done"


@pytest.mark.parametrize("stream", [False, True])
def test_on_event_raising_system_exit_ends_only_its_pass(
    stream: bool, baseline: list[list[dict[str, Any]]]
) -> None:
    runtime = get_runtime()
    with FakeOpenAIServer(script="echo") as server:
        provider = Provider(model="m", base_url=server.base_url, api_key="k", stream=stream)
        bystanders = _run_bystanders()
        hostile = run_session_loop(
            Session.from_user_message("talk"), AGENT, agent_provider=provider, on_event=_raise_exit
        )
        _pass_failed(SystemExit)(hostile)
        assert _transcripts(bystanders) == baseline
    assert get_runtime() is runtime and runtime.alive
