"""Many cores, worker side: one CPU-bound fan-out (0 ms latency, 3 tool rounds a pass) run in
this process, or on a pool of worker processes (scenario 13, `benchmarks/workers_bench.py`).

Client CPU counts every process that did the work: this one, plus each pool worker's user and
system time from /proc over the timed section. `process` times a pool started and warmed before
the timed section: the steady-state cost per completion (what S13's target measures).
`treadle.map(..., backend="process")` builds and closes a pool per call, so a one-off call also
pays each worker's start-up (spawn, imports, the agent's rebuild, the start-up collection):
`fresh_map` times whole calls, start-up and close included (informational, no target).
"""

from __future__ import annotations

import asyncio
import resource
from typing import Any

from benchmarks.server import machine_cpus, pin, proc_cpu_seconds, unpin
from benchmarks.worker import Meter
from benchmarks.workload import API_KEY, SYSTEM_PROMPT

CONCURRENCY = 64
"""Passes in flight: in this process, or on each worker (`treadle.map`'s `concurrency` is per
worker on the process backend)."""


def _agent(job: dict[str, Any]) -> Any:
    from benchmarks.contestants.treadle_loop import _provider, noop
    from treadle.agents import Agent

    return Agent("cpu-bound", SYSTEM_PROMPT, tools=[noop], provider=_provider(job))


def single(job: dict[str, Any], meter: Meter) -> dict[str, Any]:
    """`treadle.map` on the local backend: every pass on this process's one event loop."""
    import treadle

    agent = _agent(job)
    inputs = [f"item {i}" for i in range(job["n"])]
    treadle.map(agent, inputs[:CONCURRENCY], concurrency=CONCURRENCY)  # warm the pool and code
    meter.start()
    outs = treadle.map(agent, inputs, concurrency=CONCURRENCY, return_exceptions=True)
    meter.stop()
    errors = sum(1 for o in outs if isinstance(o, BaseException) or o.stop_reason != "final_answer")
    return {"errors": errors, "worker_cpu": 0.0}


def process(job: dict[str, Any], meter: Meter) -> dict[str, Any]:
    """The same map on `workers` worker processes (what `backend="process"` runs), worker `i`
    pinned to CPU `i` (modulo the machine's); the reported CPU adds the workers' to this
    driver's. The driver's share counts rebuilding every outcome as an output session, as
    `treadle.map` returns them."""
    import treadle.distributed.process as pool_module
    from treadle import Session
    from treadle.distributed import AgentSpec
    from treadle.distributed.driver import drive
    from treadle.distributed.mapping import _result

    agent = _agent(job)
    spec = AgentSpec.from_agent(agent, api_key_env="TREADLE_BENCH_KEY")
    inputs = [f"item {i}" for i in range(job["n"])]

    async def main() -> tuple[int, float]:
        pool = pool_module.ProcessPool(spec.to_json(), size=job["workers"], api_key=API_KEY)
        await pool.start()  # start-up is not timed
        pids = [pid for pid in pool.pids() if pid is not None]
        # Each worker on a CPU of its own, as the harness pins the single process to the
        # client CPU: what is measured is the workers' work, not where the scheduler moved
        # them. Free to move, a worker migrated between the CPUs (the fake server's is one)
        # and cost 5-15% more CPU a completion (docs/performance.md, issue 33, S13 placement).
        # On a 2-CPU machine worker 0 shares the client CPU with this driver and worker 1
        # the server's: no placement gives two workers a CPU each beside those two.
        cpus = machine_cpus()
        for i, pid in enumerate(pids):
            pin(pid, cpus[i % len(cpus)])
        try:
            # Every worker warms as many passes as it runs at once, as the single process
            # does: with one warm-up of CONCURRENCY for the pool, each of two workers opened
            # half its connections inside the timed section.
            warm = drive(pool, inputs[: CONCURRENCY * job["workers"]], concurrency=CONCURRENCY,
                         max_attempts=1, call_timeout=None)  # fmt: skip
            _ = [o async for o in warm]
            before = sum(proc_cpu_seconds(pid) for pid in pids)
            meter.start()
            # What `treadle.map(..., backend="process")` does past its pool's start-up: drive
            # the passes and rebuild each outcome as the caller's output session as it arrives
            # (`remote_map_iter`), keeping the sessions, not the outcomes: keeping every
            # outcome too made the driver's collections walk objects no caller keeps.
            sessions = [
                _result(o, agent)
                async for o in drive(
                    pool, inputs, concurrency=CONCURRENCY, max_attempts=1, call_timeout=None
                )
            ]
            meter.stop()
            worker_cpu = sum(proc_cpu_seconds(pid) for pid in pids) - before
        finally:
            await pool.close()
        return sum(not isinstance(s, Session) for s in sessions), worker_cpu

    errors, worker_cpu = asyncio.run(main())
    return {"errors": errors, "worker_cpu": worker_cpu}


def unpin_worker() -> None:
    """A `worker_init`: the harness pins the driver to one CPU and spawned workers inherit it;
    `process` unpins its pool's workers the same way."""
    unpin(0)


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # exited and reaped children only
    return usage.ru_utime + usage.ru_stime


def fresh_map(job: dict[str, Any], meter: Meter) -> dict[str, Any]:
    """One whole `treadle.map(..., backend="process")` call, as a user makes it: the pool's
    start-up, the passes, the outputs' rebuild and the pool's close all timed. The workers'
    CPU is the reaped children's (`RUSAGE_CHILDREN`): the call waits for every worker to exit."""
    import treadle

    agent = _agent(job)
    inputs = [f"item {i}" for i in range(job["n"])]
    options = {"backend": "process", "workers": job["workers"], "concurrency": CONCURRENCY,
               "worker_init": unpin_worker, "return_exceptions": True}  # fmt: skip
    treadle.map(agent, inputs[:CONCURRENCY], **options)  # the driver's own imports and code
    before = _children_cpu()
    meter.start()
    outs = treadle.map(agent, inputs, **options)
    meter.stop()
    errors = sum(1 for o in outs if isinstance(o, BaseException) or o.stop_reason != "final_answer")
    return {"errors": errors, "worker_cpu": _children_cpu() - before}
