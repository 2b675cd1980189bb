"""Fan-out (`map`, `amap`, `map_iter`), pipelines and brainstorms."""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

import treadle.agents
from treadle import ConfigurationError, ProviderError, Session, amap, map, map_iter
from treadle.agents import Agent, brainstorm, pipeline
from treadle.agents.fanout import Progress
from treadle.llm import Provider
from treadle.loop import CompletionRequest
from treadle.testing import FakeOpenAIServer
from treadle.testing.scripted import ScriptedExecutor, text


def _echo(request: CompletionRequest) -> dict[str, Any]:
    prompt = request.rows[0].content
    if prompt == "boom":
        return ProviderError("the endpoint refused the request")  # type: ignore[return-value]
    return text(f"re: {prompt}")


class Gauge:
    """An async executor that records how many completions are in flight at once."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0

    async def acomplete(self, request: CompletionRequest) -> Any:
        self.now += 1
        self.peak = max(self.peak, self.now)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        self.now -= 1
        return text(f"re: {request.rows[0].content}")


def test_map_2000_sessions_concurrency_200_in_order() -> None:
    gauge = Gauge()
    agent = Agent("echo", "Echo.", executor=gauge)
    pulled = 0

    def inputs() -> Iterator[Session]:
        nonlocal pulled
        for i in range(2000):
            pulled += 1
            yield Session.from_user_message(f"q{i}")

    outs = map(agent, inputs(), concurrency=200)
    assert len(outs) == 2000 and pulled == 2000
    assert [o.final_text for o in outs] == [f"re: q{i}" for i in range(2000)]
    assert all(o.stop_reason == "final_answer" for o in outs)
    assert 1 < gauge.peak <= 200


async def test_amap_pulls_inputs_lazily() -> None:
    gauge = Gauge()
    agent = Agent("echo", executor=gauge)
    pulled = 0

    def endless() -> Iterator[str]:
        nonlocal pulled
        i = 0
        while True:
            pulled += 1
            yield f"q{i}"
            i += 1

    results: list[int] = []
    stream = map_iter(agent, endless(), concurrency=5)
    async for index, out in stream:
        assert isinstance(out, Session)
        results.append(index)
        if len(results) == 20:
            break
    await stream.aclose()  # type: ignore[attr-defined]
    assert pulled <= 20 + 5 + 1  # only as many as slots freed up
    assert gauge.peak <= 5


def test_failing_item_does_not_stop_the_rest() -> None:
    agent = Agent("echo", executor=ScriptedExecutor(default=_echo))
    items = ["a", "boom", "c", "boom", "e"]
    outs = map(agent, items, concurrency=2, return_exceptions=True)
    assert [o.final_text if isinstance(o, Session) else "ERR" for o in outs] == [
        "re: a",
        "ERR",
        "re: c",
        "ERR",
        "re: e",
    ]
    assert isinstance(outs[1], ProviderError)
    with pytest.raises(ProviderError) as info:
        map(agent, items, concurrency=2)
    assert "2 of 5 items failed" in "".join(info.value.__notes__)


async def test_amap_async_iterable_and_callable() -> None:
    async def source() -> AsyncIterator[str]:
        for i in range(30):
            await asyncio.sleep(0)
            yield f"x{i}"

    agent = Agent("echo", executor=ScriptedExecutor(default=_echo))
    outs = await amap(lambda s: agent(s), source(), concurrency=4)
    assert [o.final_text for o in outs] == [f"re: x{i}" for i in range(30)]


def test_map_argument_errors() -> None:
    agent = Agent("echo", executor=ScriptedExecutor(default="ok"))
    with pytest.raises(ConfigurationError, match="is not a backend"):
        map(agent, ["a"], backend="cloud")
    with pytest.raises(ConfigurationError, match="concurrency"):
        map(agent, ["a"], concurrency=0)
    with pytest.raises(ConfigurationError, match="iterable"):
        map(agent, "abc")


def test_the_agents_map_is_a_deprecated_alias_of_treadle_map() -> None:
    agent = Agent("echo", executor=ScriptedExecutor(default=_echo))
    with pytest.warns(DeprecationWarning, match="use treadle.map"):
        outs = treadle.agents.map(agent, ["a", "b"])
    assert [o.final_text for o in outs] == ["re: a", "re: b"]
    with pytest.warns(DeprecationWarning, match="use treadle.amap"):
        assert len(asyncio.run(treadle.agents.amap(agent, ["a"]))) == 1
    with (
        pytest.warns(DeprecationWarning, match="use treadle.map"),
        pytest.raises(ConfigurationError, match="backend='local'"),
    ):
        treadle.agents.map(agent, ["a"], backend="ray")


async def test_map_refuses_to_block_an_event_loop() -> None:
    agent = Agent("echo", executor=ScriptedExecutor(default="ok"))
    with pytest.raises(ConfigurationError, match="amap"):
        map(agent, ["a"])


def test_progress_off_without_tty_and_plain_line() -> None:
    assert Progress.create(3, io.StringIO()) is None  # not a terminal: no output at all
    sink = io.StringIO()
    bar = Progress(3, sink, use_rich=False)
    for failed in (False, True, False):
        bar.advance(failed=failed)
    bar.close()
    assert sink.getvalue().rstrip().endswith("treadle.map 3/3, 1 failed")
    agent = Agent("echo", executor=ScriptedExecutor(default="ok"))
    assert len(map(agent, ["a", "b"], progress=True)) == 2  # stderr is not a TTY here


def test_rich_progress_bar() -> None:
    pytest.importorskip("rich")
    sink = io.StringIO()
    bar = Progress(2, sink, use_rich=True)
    bar.advance()
    bar.advance(failed=True)
    bar.close()
    assert "treadle.map 2/2, 1 failed" in sink.getvalue()


def test_pipeline_returns_at_once_and_chains_over_http() -> None:
    with FakeOpenAIServer(script="echo") as server:
        provider = Provider(model="fake", base_url=server.base_url, api_key="sk-test")
        writer = Agent("writer", "Write a draft.", provider=provider)
        editor = Agent("editor", "Edit the draft.", provider=provider)
        flow = pipeline(writer, editor)
        out = flow("A haiku about queues")
        assert out.chunk_table.kinds() == ["user", "assistant", "assistant"]
        systems = [r.body["messages"][0]["content"] for r in server.requests]
    assert systems == ["Write a draft.", "Edit the draft."]
    assert out.usage.requests == 2


async def test_pipeline_run_async() -> None:
    ex = ScriptedExecutor(default=lambda req: text(f"step {len(req.rows)}"))
    a, b = Agent("a", executor=ex), Agent("b", executor=ex)
    out = await pipeline(a, b).run("go")
    assert [r.content for r in out.rows] == ["go", "step 1", "step 2"]


def test_brainstorm_agents_take_turns() -> None:
    seen: list[tuple[str, int]] = []

    def voice(name: str) -> Any:
        def reply(request: CompletionRequest) -> dict[str, Any]:
            seen.append((name, len(request.rows)))
            return text(f"{name} idea {len(request.rows)}")

        return reply

    a = Agent("optimist", "Be hopeful.", executor=ScriptedExecutor(default=voice("optimist")))
    b = Agent("skeptic", "Find flaws.", executor=ScriptedExecutor(default=voice("skeptic")))
    out = brainstorm(a, b, rounds=2)("How do we ship faster?")
    assert [r.content for r in out.rows[1:]] == [
        "optimist idea 1",
        "skeptic idea 2",
        "optimist idea 3",
        "skeptic idea 4",
    ]
    assert seen == [("optimist", 1), ("skeptic", 2), ("optimist", 3), ("skeptic", 4)]
    with pytest.raises(ConfigurationError):
        brainstorm(a, rounds=0)
