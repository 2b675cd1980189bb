"""The Ray backend on a local Ray instance bound to 127.0.0.1 (`make test-ray`).

Skipped when Ray is not installed (`pip install 'treadle[ray]'`). Ray starts once for the module.
Passes run against the fake OpenAI server started in this process; workers reach it over
loopback.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from treadle import Session, amap
from treadle.distributed import AgentSpec, PassOutcome, map, map_outcomes
from treadle.testing import FakeOpenAIServer, Reply
from treadle.testing.sample_agents import Capital, geographer, geographer_script, librarian
from treadle.testing.sample_tools import shout_inputs, shout_script, shouter

pytestmark = pytest.mark.ray

#: The variable naming the file `treadle.testing.sample_agents`' hooks append to.
HOOK_LOG = "TREADLE_SAMPLE_HOOK_LOG"

ray = pytest.importorskip(
    "ray", reason="Ray is not installed: run `make test-ray` (installs the treadle[ray] extra)"
)


@pytest.fixture(scope="module", autouse=True)
def ray_cluster(request: pytest.FixtureRequest) -> Iterator[None]:
    """A two-CPU local Ray instance on loopback, for the whole module."""
    if "ray" not in (request.config.option.markexpr or ""):
        pytest.skip("Ray tests run with `make test-ray` (pytest -m ray), not in the default suite")
    settings = {
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # bind to 127.0.0.1, not a routable address
        "RAY_AUTH_MODE": "disabled",  # no token file written to ~/.ray
    }
    saved = {k: os.environ.get(k) for k in (*settings, "RAY_TMPDIR", HOOK_LOG)}
    with tempfile.TemporaryDirectory(prefix="treadle-ray-") as tmp:
        # Workers inherit the environment Ray starts with: where the sample agents' hooks log.
        os.environ.update(settings, RAY_TMPDIR=tmp, **{HOOK_LOG: str(Path(tmp) / "hooks.log")})
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            yield
        finally:
            ray.shutdown()
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


_agent = shouter
_inputs = shout_inputs


def _view(session: Session) -> tuple[Any, ...]:
    return (session.to_messages(), session.stop_reason, session.usage)


def _left(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


async def test_two_thousand_passes_match_the_local_backend(tmp_path: Path) -> None:
    sandboxes = tmp_path / "sandboxes"
    with FakeOpenAIServer(script=shout_script) as server:
        agent = _agent(server.base_url)
        local = await amap(agent, _inputs(2000), concurrency=200)
        remote = await amap(
            agent,
            _inputs(2000),
            backend="ray",
            workers=2,
            concurrency=100,
            sandbox_base=str(sandboxes),
        )
    assert len(remote) == 2000
    assert [_view(s) for s in remote] == [_view(s) for s in local]
    workers = {s.metadata["treadle.distributed"]["worker"] for s in remote}
    assert len(workers) == 2
    assert _left(sandboxes) == []


async def test_a_killed_worker_has_every_pass_finish(tmp_path: Path) -> None:
    killed: list[str] = []
    outcomes: list[PassOutcome] = []
    results = tmp_path / "results.jsonl"
    with FakeOpenAIServer(script=shout_script, latency_ms=50) as server:
        async for outcome in map_outcomes(
            _agent(server.base_url),
            _inputs(300),
            backend="ray",
            workers=2,
            concurrency=20,
            sandbox_base=str(tmp_path / "sandboxes"),
            results_path=str(results),
        ):
            outcomes.append(outcome)
            if not killed:  # SIGKILL the worker that just answered, with passes in flight
                killed.append(outcome.worker)
                os.kill(int(outcome.worker.rsplit(":", 1)[1]), signal.SIGKILL)
    assert sorted(o.index for o in outcomes) == list(range(300))
    assert {o.status for o in outcomes} == {"ok"}
    retried = [o for o in outcomes if o.attempts > 1]
    assert retried, "the killed worker had passes in flight"
    for outcome in retried:
        assert [h["status"] for h in outcome.history] == ["lost"] * (outcome.attempts - 1) + ["ok"]
        assert outcome.history[0]["worker"] == killed[0]
    assert len(results.read_text().splitlines()) == 300
    assert _left(tmp_path / "sandboxes") == []  # including the dead worker's root


async def test_shared_limiter_holds_its_rate_across_two_workers(tmp_path: Path) -> None:
    arrivals: list[float] = []
    lock = threading.Lock()

    def timed(request: dict[str, Any]) -> Reply:
        with lock:
            arrivals.append(time.monotonic())
        return Reply.text("ok")

    n, per_minute = 60, 1200  # 20 requests/s over both workers
    with FakeOpenAIServer(script=timed) as server:
        outcomes = [
            o
            async for o in map_outcomes(
                _agent(server.base_url, requests_per_minute=per_minute),
                [f"q{i}" for i in range(n)],
                backend="ray",
                workers=2,
                concurrency=30,
                rate_limit="shared",
                sandbox_base=str(tmp_path),
            )
        ]
    assert {o.status for o in outcomes} == {"ok"}
    assert len({o.worker for o in outcomes}) == 2
    assert len(arrivals) == n
    # Tokens cannot be made faster than the bucket's rate: the whole run spans about
    # (n - burst) / rate seconds wherever the requests came from (burst: one batch per worker;
    # a few tokens' worth of slack for the jitter between reserving a token and the request
    # arriving). Unlimited, the 60 requests would arrive within a fraction of a second.
    rate = per_minute / 60
    assert max(arrivals) - min(arrivals) >= (n - 5) / rate


def test_passes_on_actors_are_children_of_the_callers_span() -> None:
    pytest.importorskip("opentelemetry.sdk", reason="needs opentelemetry-sdk (dev)")
    here = Path(__file__).resolve().parent
    result = subprocess.run(
        [sys.executable, str(here / "otel_scenarios.py"), "ray_backend"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=here,
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), (
        result.stdout[-3000:] + result.stderr[-5000:]
    )


async def test_ray_workers_share_the_learned_limit_under_uneven_load(tmp_path: Path) -> None:
    from test_shared_limits_process import CONCURRENCY, LONG_ROUNDS, _inputs, _uneven
    from treadle.distributed import AgentSpec
    from treadle.distributed.driver import drive
    from treadle.distributed.ray_backend import RayPool

    # 20 requests per 0.5 s, nothing configured; one worker has the ten-request passes.
    with FakeOpenAIServer(
        script=_uneven, latency_ms=20, requests_per_minute=20, rate_window=0.5
    ) as server:
        spec = AgentSpec.from_agent(_agent(server.base_url, max_retries=30))
        pool = RayPool(spec.to_json(), size=2, concurrency=CONCURRENCY, sandbox_base=str(tmp_path))
        await pool.start()
        try:
            outcomes = [
                o
                async for o in drive(
                    pool,
                    _inputs(CONCURRENCY, 24),
                    concurrency=CONCURRENCY,
                    max_attempts=3,
                    call_timeout=120,
                )
            ]
            stats = await pool.shared_stats()
        finally:
            await pool.close()
        limits = server.limits
        assert limits is not None
    assert {o.status for o in outcomes} == {"ok"} and len(outcomes) == CONCURRENCY + 24
    sent = limits.admitted + limits.rejected
    assert sent >= CONCURRENCY * LONG_ROUNDS + 24
    assert limits.rejected <= sent // 100  # under 1% answered 429
    assert 0 < stats["leases"] < sent / 2  # leased from the named actor, in batches


def test_an_agent_with_code_parts_runs_on_actors_by_its_import_path() -> None:
    # The agent crosses by its path; its endpoint (the fake server here) travels in the spec.
    spec = AgentSpec.from_agent(geographer)
    assert spec.agent_path == "treadle.testing.sample_agents:geographer"
    log = Path(os.environ[HOOK_LOG])
    log.unlink(missing_ok=True)
    inputs = ["capital of France", "forbidden capital of Spain", "books about Italy"] * 2
    with FakeOpenAIServer(script=geographer_script) as server:
        spec = dataclasses.replace(spec, base_url=server.base_url)
        outs = map(spec, inputs, backend="ray", workers=2)
    for capital, blocked, handed in (outs[:3], outs[3:]):
        # structured output, after the validator sent the model back once, as the caller's type
        assert capital.output == Capital(country="France", city="Paris")
        assert capital.metadata["agent"] == "geographer"
        assert capital.usage.requests == 2
        # the input guardrail ran on the actor and tripped; its result came back
        assert blocked.stop_reason == "blocked"
        assert blocked.tripwire is not None and blocked.tripwire.reason == "forbidden topic"
        assert blocked.metadata["guardrail_results"][0].tripped is True
        # the handoff, on the same transcript
        assert handed.metadata["agent"] == librarian.name
        assert [h["to"] for h in handed.metadata["handoffs"]] == ["librarian"]
        assert handed.output == Capital(country="Italy", city="Paris")
        assert [e.agent for e in handed.metadata["request_usage"]] == ["geographer", "librarian"]
    assert all(s.metadata["treadle.distributed"]["status"] == "ok" for s in outs)
    # the hooks ran in the actors' processes, not here
    lines = log.read_text().splitlines()
    assert str(os.getpid()) not in {line.split()[0] for line in lines}
    assert sum(1 for line in lines if line.endswith("start geographer")) == 6
