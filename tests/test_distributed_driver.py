"""The process backend's scheduler (`treadle.distributed.driver.drive`) over real worker processes
and the fake OpenAI server: inputs keep their positions whatever mix of values and sources feeds
the map, a failing input iterable fails the map, and a map closed early leaves no worker running.

The driver takes plain inputs without its lock and rebuilds outputs without a second session
(docs/performance.md, issue 33): these are the behaviours those shortcuts must keep.
"""

from __future__ import annotations

import asyncio
import os
import queue
import random
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from treadle import Agent, Provider, Session
from treadle.distributed import PassFailed, amap, map_outcomes, read_results
from treadle.errors import ProviderError
from treadle.testing import FakeOpenAIServer, Reply
from treadle.testing.sample_tools import shout_script, shouter


def _text(letter: str) -> str:
    return f'shouted: {{"ok":true,"result":"{letter.upper()}"}}'


def _mixed() -> Iterator[Any]:
    """Strings, sessions (they wait for their rows) and values that are not inputs, mixed."""
    for i, letter in enumerate("abcdefgh"):
        if i % 3 == 1:
            yield Session.from_user_message(letter)
        elif i == 5:
            yield 42
        else:
            yield letter


async def _amixed() -> AsyncIterator[Any]:
    for value in _mixed():
        await asyncio.sleep(0)
        yield value


@pytest.mark.parametrize("source", [_mixed, _amixed])
async def test_mixed_inputs_keep_their_positions(source: Any, tmp_path: Path) -> None:
    with FakeOpenAIServer(script=shout_script) as server:
        outs = await asyncio.wait_for(  # a guard against a hang, not a timing assertion
            amap(
                shouter(server.base_url),
                source(),
                backend="process",
                workers=1,
                concurrency=2,
                return_exceptions=True,
                sandbox_base=str(tmp_path),
            ),
            120,
        )
    assert len(outs) == 8
    for i, (letter, out) in enumerate(zip("abcdefgh", outs, strict=True)):
        if i == 5:
            assert isinstance(out, PassFailed) and "Sessions or strs" in str(out.outcome.error)
        else:
            assert isinstance(out, Session) and out.final_text == _text(letter), i
            # The rebuilt output is a working session: it takes more rows.
            assert out.add_user_message("more").to_messages()[-1]["content"] == "more"


def _breaks_after_three() -> Iterator[str]:
    yield from ("a", "b", "c")
    raise RuntimeError("the input source broke")


async def test_a_failing_input_iterable_fails_the_map(tmp_path: Path) -> None:
    server = FakeOpenAIServer(script=shout_script)
    # The error comes in the scheduler's task group, as it did before its fast path.
    with server, pytest.raises(ExceptionGroup) as raised:
        await asyncio.wait_for(
            amap(
                shouter(server.base_url),
                _breaks_after_three(),
                backend="process",
                workers=1,
                sandbox_base=str(tmp_path),
            ),
            120,
        )
    errors = raised.value.subgroup(RuntimeError)
    assert errors is not None and "the input source broke" in str(errors.exceptions[0])


async def test_a_map_closed_early_leaves_no_worker_running(tmp_path: Path) -> None:
    with FakeOpenAIServer(script=shout_script, latency_ms=200) as server:
        stream = map_outcomes(
            shouter(server.base_url),
            (f"item {i}" for i in range(200)),
            backend="process",
            workers=2,
            concurrency=4,
            sandbox_base=str(tmp_path),
        )
        first = await asyncio.wait_for(anext(stream), 120)
        await asyncio.wait_for(stream.aclose(), 120)
    assert first.status == "ok"
    pid = int(first.worker.rsplit(":", 1)[1])
    with pytest.raises(ProcessLookupError):  # stopped and reaped, not left running
        os.kill(pid, 0)


async def test_a_cancelled_map_leaves_no_worker_running(tmp_path: Path) -> None:
    seen: list[str] = []

    async def run(server: FakeOpenAIServer) -> None:
        async for outcome in map_outcomes(
            shouter(server.base_url),
            [f"item {i}" for i in range(200)],
            backend="process",
            workers=1,
            concurrency=4,
            sandbox_base=str(tmp_path),
        ):
            seen.append(outcome.worker)

    with FakeOpenAIServer(script=shout_script, latency_ms=200) as server:
        task = asyncio.create_task(run(server))
        while not seen and not task.done():
            await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 120)
    assert seen
    with pytest.raises(ProcessLookupError):
        os.kill(int(seen[0].rsplit(":", 1)[1]), 0)


def _hangs_on_slow(request: dict[str, Any]) -> Reply:
    messages = request.get("messages") or []
    if messages and messages[-1].get("content") == "slow":
        return Reply.text("late").with_latency(60_000)
    return shout_script(request)


async def test_a_call_past_call_timeout_loses_its_worker_and_ends_lost(tmp_path: Path) -> None:
    with FakeOpenAIServer(script=_hangs_on_slow) as server:
        outcomes = [
            o
            async for o in map_outcomes(
                shouter(server.base_url, max_retries=0),
                ["a", "slow", "b"],
                backend="process",
                workers=1,
                max_attempts=2,
                call_timeout=3,
                sandbox_base=str(tmp_path),
            )
        ]
    by_index = {o.index: o for o in outcomes}
    assert sorted(by_index) == [0, 1, 2]
    assert by_index[0].status == by_index[2].status == "ok"
    slow = by_index[1]
    assert slow.status == "lost" and slow.attempts == 2
    assert [h["status"] for h in slow.history] == ["lost", "lost"]
    assert all("TimeoutError" in h["error"] for h in slow.history)
    assert slow.history[0]["worker"] != slow.history[1]["worker"]  # restarted in between


# -- pending sessions among plain inputs (the fifth round's lock-free input path lost and
# misplaced these: a session taken by one consumer got its position after a later plain input,
# and a session left for the locked path behind the input's end was never run) ------------------


def _held_script(request: dict[str, Any]) -> Reply:
    """The producer's script: answer after the delay the user message names (`w3 120`)."""
    text = next(m.get("content") for m in reversed(request["messages"]) if m["role"] == "user")
    return Reply.text("ready").with_latency(float(str(text).split()[1]))


def _pending_mix(producer: Agent, pattern: str, n: int) -> list[Any]:
    """`n` inputs, `p` a pending session (a producer's pass still running; later ones finish
    first), `s` a plain string, cycling through `pattern`."""
    out: list[Any] = []
    for i in range(n):
        if pattern[i % len(pattern)] == "p":
            out.append(producer(Session.from_user_message(f"w{i} {10 + 15 * (n - i) % 240}")))
        else:
            out.append(f"w{i} 0")
    return out


def _check_positions(outcomes: list[Any], n: int) -> None:
    indices = sorted(o.index for o in outcomes)
    assert indices == list(range(n)), "an input lost or run twice"
    for o in outcomes:
        assert o.status == "ok", (o.index, o.error)
        shouted = o.messages[-1]["content"]
        # Each pending input's last user row is `w<i> <delay>`, each plain one `w<i> 0`.
        assert shouted.startswith(f'shouted: {{"ok":true,"result":"W{o.index} '), (o.index, shouted)


@pytest.mark.parametrize(
    ("pattern", "n"),
    [("p", 9), ("ps", 17), ("sp", 16), ("ssp", 25), ("pps", 24), ("spsss", 31), ("sssssp", 12)],
)
async def test_pending_sessions_among_plain_inputs_keep_positions(
    pattern: str, n: int, tmp_path: Path
) -> None:
    with (
        FakeOpenAIServer(script=shout_script) as server,
        FakeOpenAIServer(script=_held_script) as held,
    ):
        producer = Agent(
            "producer", "Say ready.", provider=Provider(model="f", base_url=held.base_url)
        )
        outcomes = [
            o
            async for o in map_outcomes(
                shouter(server.base_url),
                iter(_pending_mix(producer, pattern, n)),
                backend="process",
                workers=1,
                concurrency=4,
                sandbox_base=str(tmp_path),
            )
        ]
    _check_positions(outcomes, n)


async def test_pending_sessions_from_a_threaded_iterable_keep_positions(tmp_path: Path) -> None:
    # The inputs come from a producer thread (it starts the pending passes there) through a
    # queue: items arrive while the map already runs, pending and plain in a random order.
    n = 40
    rng = random.Random(33)
    kinds = [rng.choice("ps") for _ in range(n)]
    inbox: queue.Queue[Any] = queue.Queue()

    def feed(producer: Agent) -> None:
        for i, kind in enumerate(kinds):
            if kind == "p":
                delay = rng.randrange(0, 200)
                inbox.put(producer(Session.from_user_message(f"w{i} {delay}")))
            else:
                inbox.put(f"w{i} 0")
            time.sleep(rng.random() / 200)
        inbox.put(None)

    def inputs() -> Iterator[Any]:
        while (value := inbox.get(timeout=60)) is not None:
            yield value

    with (
        FakeOpenAIServer(script=shout_script) as server,
        FakeOpenAIServer(script=_held_script) as held,
    ):
        producer = Agent(
            "producer", "Say ready.", provider=Provider(model="f", base_url=held.base_url)
        )
        thread = threading.Thread(target=feed, args=(producer,))
        thread.start()
        try:
            outcomes = [
                o
                async for o in map_outcomes(
                    shouter(server.base_url),
                    inputs(),
                    backend="process",
                    workers=2,
                    concurrency=3,
                    sandbox_base=str(tmp_path),
                )
            ]
        finally:
            thread.join(60)
    _check_positions(outcomes, n)


async def test_pending_sessions_from_an_async_source_keep_positions(tmp_path: Path) -> None:
    with (
        FakeOpenAIServer(script=shout_script) as server,
        FakeOpenAIServer(script=_held_script) as held,
    ):
        producer = Agent(
            "producer", "Say ready.", provider=Provider(model="f", base_url=held.base_url)
        )

        async def inputs() -> AsyncIterator[Any]:
            for value in _pending_mix(producer, "psp", 20):
                await asyncio.sleep(0)
                yield value

        outcomes = [
            o
            async for o in map_outcomes(
                shouter(server.base_url),
                inputs(),
                backend="process",
                workers=1,
                concurrency=4,
                sandbox_base=str(tmp_path),
            )
        ]
    _check_positions(outcomes, 20)


def _refusing_script(request: dict[str, Any]) -> Reply:
    return Reply.error(400, "no")


@pytest.mark.parametrize("return_exceptions", [True, False])
async def test_a_pending_input_whose_own_pass_fails_is_that_items_outcome(
    return_exceptions: bool, tmp_path: Path
) -> None:
    # The input's producer pass fails (HTTP 400): as an in-process map, that error is the
    # item's outcome (or raised, without return_exceptions), the other items run, and the map
    # does not fail as a whole (it raised an ExceptionGroup from the driver's task group).
    with (
        FakeOpenAIServer(script=shout_script) as server,
        FakeOpenAIServer(script=_refusing_script) as refusing,
    ):
        producer = Agent(
            "producer", "x", provider=Provider(model="f", base_url=refusing.base_url, max_retries=0)
        )
        inputs = ["a", producer(Session.from_user_message("b")), "c"]
        run = amap(
            shouter(server.base_url),
            inputs,
            backend="process",
            workers=1,
            sandbox_base=str(tmp_path),
            return_exceptions=return_exceptions,
        )
        if not return_exceptions:
            with pytest.raises(ProviderError) as raised:
                await asyncio.wait_for(run, 60)  # a guard against a hang, not a timing one
            assert "1 of 3 items failed" in raised.value.__notes__[-1]
            return
        outs = await asyncio.wait_for(run, 60)
    assert [type(o) for o in outs] == [Session, ProviderError, Session]
    assert [o.final_text for o in outs if isinstance(o, Session)] == [_text("a"), _text("c")]
    assert "HTTP 400" in str(outs[1])


async def test_a_pending_input_whose_own_pass_fails_is_an_error_outcome(tmp_path: Path) -> None:
    with (
        FakeOpenAIServer(script=shout_script) as server,
        FakeOpenAIServer(script=_refusing_script) as refusing,
    ):
        producer = Agent(
            "producer", "x", provider=Provider(model="f", base_url=refusing.base_url, max_retries=0)
        )
        pending = producer(Session.from_user_message("b"))
        inputs = ["a", pending, "c"]
        outcomes = {
            o.index: o
            async for o in map_outcomes(
                shouter(server.base_url),
                inputs,
                backend="process",
                workers=1,
                sandbox_base=str(tmp_path),
                results_path=str(tmp_path / "r.jsonl"),
            )
        }
    assert [outcomes[i].status for i in range(3)] == ["ok", "error", "ok"]
    failed = outcomes[1]
    assert failed.error is not None and failed.error.startswith("ProviderError: ")
    assert (failed.worker, failed.attempts, failed.session_id) == ("driver", 0, pending.id)
    written = {o.index: o for o in read_results(tmp_path / "r.jsonl")}
    assert written[1].error == failed.error


async def test_request_usage_from_real_workers_reaches_callers_as_field_dicts(
    tmp_path: Path,
) -> None:
    # Workers send each request's usage as a tuple of its fields (docs/performance.md, process
    # workers, ninth round); `map_outcomes`, the results file and the output sessions must give
    # what they gave before: a dict per request with the field names, a `RequestUsage` value.
    from treadle.loop import RequestUsage

    results = tmp_path / "r.jsonl"
    with FakeOpenAIServer(script=shout_script) as server:
        outcomes = [
            o
            async for o in map_outcomes(
                shouter(server.base_url),
                ["a", "b", "c"],
                backend="process",
                workers=2,
                results_path=str(results),
                sandbox_base=str(tmp_path),
            )
        ]
    names = {
        "input_tokens", "output_tokens", "cached_tokens", "reasoning_tokens",
        "response_id", "latency_seconds", "agent", "request_id",
    }  # fmt: skip
    written = {o.index: o for o in read_results(results)}
    assert sorted(written) == [0, 1, 2]
    for outcome in outcomes:
        assert outcome.status == "ok"
        for seen in (outcome, written[outcome.index]):
            usage = seen.metadata["request_usage"]
            assert len(usage) == 2  # the tool call's round and the answer's
            assert all(type(u) is dict and set(u) == names for u in usage), usage
            assert all(u["input_tokens"] > 0 and u["output_tokens"] > 0 for u in usage)
        session = outcome.session()
        kept = session.metadata["request_usage"]
        assert all(type(u) is RequestUsage for u in kept)
        assert [u.input_tokens for u in kept] == [u["input_tokens"] for u in usage]
