"""What cannot cross a process worker's pipe fails alone: an input or an output pickle refuses
becomes that pass's failed outcome, the rest of its batch still crosses; and a worker that ran
out of file descriptors still closes cleanly. Real worker processes, the fake server."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import pytest

from pipe_agents import BadRepr, bad_key_locker, garbler, locker, stopper
from treadle import Session
from treadle.distributed import AgentSpec, PassFailed, PassLost, amap
from treadle.distributed.process import ProcessPool
from treadle.llm import Provider
from treadle.testing import FakeOpenAIServer
from treadle.testing.sample_tools import shout_script, shouter


class Unpicklable(str):
    """A str that refuses pickling (a driver-side value that cannot go to a worker)."""

    def __reduce__(self) -> Any:
        raise TypeError("cannot pickle Unpicklable")


async def middle_lost(agent: Any, items: list[Any]) -> PassLost:
    """Map `items` on one worker: the first and last pass end as sessions, the middle one's
    worker is lost; that `PassLost`."""
    out = await asyncio.wait_for(
        amap(agent, items, backend="process", workers=1, max_attempts=2, return_exceptions=True),
        60,
    )
    assert [type(o).__name__ for o in out] == ["Session", "PassLost", "Session"], out
    lost = out[1]
    assert isinstance(lost, PassLost)
    return lost


async def test_an_input_that_cannot_be_pickled_fails_alone() -> None:
    with FakeOpenAIServer(script=shout_script) as server:
        bad = Session.from_messages([{"role": "user", "content": Unpicklable("boom")}])
        out = await asyncio.wait_for(
            amap(
                shouter(server.base_url),
                ["a", bad, "b", "c"],
                backend="process",
                workers=1,
                return_exceptions=True,
            ),
            60,
        )
    assert [type(o).__name__ for o in out] == ["Session", "PassFailed", "Session", "Session"]
    failed = out[1]
    assert isinstance(failed, PassFailed)
    assert failed.outcome.worker == "driver"
    assert "Unpicklable" in str(failed.outcome.error)
    assert "cannot be sent to a worker" in str(failed.outcome.error)


async def test_an_output_that_cannot_be_pickled_fails_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with FakeOpenAIServer(script=shout_script) as server:
        # The spec carries the provider's data: the worker's import of the agent uses this URL.
        monkeypatch.setattr(
            locker, "provider", Provider(model="fake", base_url=server.base_url, api_key="k")
        )
        inputs = ["a", "evil", "b", "c", "d", "e"]
        out = await asyncio.wait_for(
            amap(locker, inputs, backend="process", workers=1, return_exceptions=True), 60
        )
    kinds = [type(o).__name__ for o in out]
    assert kinds == ["Session", "PassFailed", "Session", "Session", "Session", "Session"], kinds
    failed = out[1]
    assert isinstance(failed, PassFailed)
    assert "_thread.lock" in str(failed.outcome.error), failed.outcome.error
    assert failed.outcome.history[-1]["status"] == "error"


async def test_an_output_whose_path_cannot_be_named_still_fails_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Naming where the value is raised (a key's repr, a list too deep to walk): the refusal
    # failed, the worker dropped the whole batch, and with no call timeout the map never ended.
    with FakeOpenAIServer(script=shout_script) as server:
        monkeypatch.setattr(
            bad_key_locker,
            "provider",
            Provider(model="fake", base_url=server.base_url, api_key="k"),
        )
        inputs = ["a", "evil", "b", "deep", "c"]
        out = await asyncio.wait_for(
            amap(bad_key_locker, inputs, backend="process", workers=1, return_exceptions=True),
            60,
        )
    kinds = [type(o).__name__ for o in out]
    assert kinds == ["Session", "PassFailed", "Session", "PassFailed", "Session"], kinds
    evil, deep = out[1], out[3]
    assert isinstance(evil, PassFailed) and isinstance(deep, PassFailed)
    assert "<BadRepr key>" in str(evil.outcome.error), evil.outcome.error
    assert "_thread.lock" in str(evil.outcome.error), evil.outcome.error
    # Too deep for the worker to make its wire form: that pass fails there, alone.
    assert "RecursionError" in str(deep.outcome.error), deep.outcome.error


def test_refusing_an_outcome_never_raises() -> None:
    import pickle
    import threading

    from treadle.distributed.pipe import refuse_outcome

    nested: Any = [threading.Lock()]
    for _ in range(3000):
        nested = [nested]
    for payload in ({"extra": {BadRepr(): threading.Lock()}}, {"extra": nested}):
        outcome = {"index": 0, "session_id": "s", "status": "ok", "attempts": 1,
                   "worker": "w", "usage": {}, "stop_reason": "final_answer", "metadata": {},
                   "kinds": ["assistant"], "payloads": [payload]}  # fmt: skip
        try:
            pickle.dumps(outcome)
        except Exception as err:  # TypeError, or RecursionError for the deep one
            kind, call_id, failed = refuse_outcome(("done", 1, outcome), err)
        else:
            raise AssertionError("the outcome pickled")
        assert (kind, call_id, failed["status"], failed["index"]) == ("done", 1, "error", 0)
        assert failed["history"][0]["status"] == "error"
        pickle.dumps(failed)  # the failure itself crosses


async def test_a_worker_out_of_file_descriptors_still_closes() -> None:
    with FakeOpenAIServer(script=shout_script) as server:
        spec = AgentSpec.from_agent(shouter(server.base_url))
        pool = ProcessPool(
            spec.to_json(), size=1, worker_init="worker_fd_limit:lower_fd_limit_soon"
        )
        await pool.start()
        worker = pool._workers[0]
        assert worker is not None
        await asyncio.sleep(0)
        await pool.close()
    # It ran its cleanup and exited itself (a crash at close exits 1).
    assert worker.process.returncode == 0


class OnlyInTheDriver(str):
    """A str subclass the driver pickles by reference but a worker cannot find (it claims
    `__main__`, which in a worker is another program)."""


async def test_an_input_a_worker_cannot_unpickle_is_lost_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(OnlyInTheDriver, "__module__", "__main__")
    monkeypatch.setattr(sys.modules["__main__"], "OnlyInTheDriver", OnlyInTheDriver, raising=False)
    with FakeOpenAIServer(script=shout_script) as server:
        odd = Session.from_messages([{"role": "user", "content": OnlyInTheDriver("boom")}])
        lost = await middle_lost(shouter(server.base_url), ["a", odd, "b"])
    assert "could not read" in str(lost.outcome.error), lost.outcome.error
    assert "OnlyInTheDriver" in str(lost.outcome.error), lost.outcome.error


def test_frames_are_read_as_a_connection_writes_them_whatever_the_split() -> None:
    # Both ends read the socket on their event loops, in whatever pieces it hands over: the
    # frames are `Connection.send_bytes`'s (a worker's first message is still read by one).
    import random
    import socket
    from multiprocessing.connection import Connection

    from treadle.distributed.pipe import Frames, frame

    payloads = [b"", b"x", bytes(range(256)) * 3, b"y" * 70_000, b"z" * 5]
    ours, theirs = socket.socketpair()
    with ours, theirs:
        sender = Connection(theirs.detach())
        wire = b""
        for payload in payloads:
            sender.send_bytes(payload)
            while len(wire) < sum(len(frame(p)) for p in payloads[: payloads.index(payload) + 1]):
                wire += ours.recv(1 << 20)
        sender.close()
    assert wire == b"".join(frame(p) for p in payloads)  # our frames are its frames
    chance = random.Random(7)
    for _ in range(50):
        frames, got, at = Frames(), [], 0
        while at < len(wire):
            step = chance.choice((1, 3, 4, 5, 17, 4096, 100_000))
            got += frames.feed(wire[at : at + step])
            at += step
        assert got == payloads and frames.partial == 0
    torn = Frames()
    assert torn.feed(frame(b"abc")[:-1]) == [] and torn.partial == 6  # a frame cut at EOF
    # Past 2 GiB the length is -1 then 8 bytes (the header alone checked: no 2 GiB here).
    long_head = frame(b"")[:0] + (-1).to_bytes(4, "big", signed=True) + (3).to_bytes(8, "big")
    assert Frames().feed(long_head + b"abc") == [b"abc"]


def test_a_frame_length_no_connection_writes_is_refused() -> None:
    # A negative length (other than -1, the long form's mark) or one past any machine's memory
    # is garbage on the socket: refused at once, naming it, never read as a frame (a length of
    # -4 used to loop forever on the event loop).
    from treadle.distributed.pipe import FrameError, Frames, frame

    for head in (-2, -3, -4, -5, -(2**31)):
        frames = Frames()
        with pytest.raises(FrameError, match=f"length {head}") as caught:
            frames.feed(frame(b"ok") + head.to_bytes(4, "big", signed=True) + b"rest")
        assert caught.value.frames == [b"ok"]  # the frames before it are still read
        with pytest.raises(FrameError):  # and it stays broken
            frames.feed(frame(b"later"))
    absurd = (-1).to_bytes(4, "big", signed=True) + (2**63).to_bytes(8, "big")
    with pytest.raises(FrameError, match=f"length {2**63}"):
        Frames().feed(absurd)


async def test_a_worker_that_writes_a_negative_frame_length_loses_its_passes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with FakeOpenAIServer(script=shout_script) as server:
        monkeypatch.setattr(
            garbler, "provider", Provider(model="fake", base_url=server.base_url, api_key="k")
        )
        lost = await middle_lost(garbler, ["a", "garble", "b"])
    assert "frame that cannot be read" in str(lost.outcome.error), lost.outcome.error
    assert "length -4" in str(lost.outcome.error), lost.outcome.error


def test_an_output_that_cannot_be_pickled_names_the_field_a_caller_knows() -> None:
    # A worker sends its rows as (kind, payload) pairs; the error names the output's messages
    # and metadata as a caller reads them, not the wire's `['rows'][0][1]`.
    import pickle
    import threading

    from treadle.distributed.pipe import refuse_outcome

    lock = threading.Lock()
    wire = {
        "index": 3,
        "session_id": "s",
        "status": "ok",
        "attempts": 1,
        "worker": "w",
        "rows": [("user", {"content": "hi"}), ("assistant", {"content": "x", "extra": [lock]})],
        "usage": {},
        "history": [],
        "metadata": {},
    }
    for outcome, where in (
        (wire, "messages[1]['extra'][0] (_thread.lock)"),
        (
            {**wire, "rows": [], "metadata": {"output": {"lock": lock}}},
            "metadata['output']['lock']",
        ),
    ):
        try:
            pickle.dumps(outcome)
        except TypeError as err:
            kind, call_id, failed = refuse_outcome(("done", 7, outcome), err)
        assert (kind, call_id, failed["status"], failed["index"]) == ("done", 7, "error", 3)
        assert f"({where}" in failed["error"], failed["error"]


async def test_a_stop_on_first_tool_agent_stops_on_a_worker_as_it_does_here(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # `tool_use_behavior` is not in an `AgentSpec`'s data: the agent crossed as data without it,
    # and its worker asked the model again (4 rows and 2 requests where a local pass has 3 and 1,
    # no `stopped_at_tool`).
    with FakeOpenAIServer(script=shout_script) as server:
        provider = Provider(model="fake", base_url=server.base_url, api_key="k")
        monkeypatch.setattr(stopper, "provider", provider)
        monkeypatch.setattr(stopper, "_provider", provider)  # what a local pass sends with
        assert AgentSpec.from_agent(stopper).agent_path == "pipe_agents:stopper"
        here = await amap(stopper, ["hello"])
        there = await asyncio.wait_for(amap(stopper, ["hello"], backend="process", workers=1), 60)
    local, remote = here[0], there[0]
    assert isinstance(local, Session) and isinstance(remote, Session)
    assert [r.kind for r in remote.rows] == [r.kind for r in local.rows]
    assert remote.output == local.output
    assert remote.metadata["stopped_at_tool"] == local.metadata["stopped_at_tool"]
    assert len(remote.metadata["request_usage"]) == len(local.metadata["request_usage"]) == 1


def test_an_agent_with_settings_the_spec_cannot_carry_is_refused_unless_importable() -> None:
    from treadle.agents import Agent
    from treadle.errors import ConfigurationError

    built_here = Agent(
        "local-stopper",
        "Shout.",
        provider=Provider(model="fake", base_url="http://127.0.0.1:1/v1", api_key="k"),
        tool_use_behavior="stop_on_first_tool",
    )
    with pytest.raises(ConfigurationError, match="tool_use_behavior"):
        AgentSpec.from_agent(built_here)
