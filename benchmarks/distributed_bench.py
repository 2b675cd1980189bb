"""`python -m benchmarks.distributed_bench [--passes 2000] [--backends local,process,ray]`.

2,000 passes of the `file_worker` script (write a file, `cat` it in a shell, answer: each pass
runs real subprocesses in its own sandbox directory) against the fake server at 50 ms latency,
run by `treadle.map` on the local backend (one event loop), the process backend (one worker per
core) and the Ray backend (one async actor per core). The fake server runs in its own process so
the driver does not also serve HTTP. Prints one markdown row per backend: wall time, passes per
second, and the driver's CPU. Ray's start-up is timed apart. Results go in docs/distributed.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import subprocess
import sys
import tempfile
import time
from typing import Any

from treadle import Session, amap
from treadle.agents import Agent
from treadle.llm import Provider


def _start_server(latency_ms: float) -> tuple[subprocess.Popen[str], str]:
    process = subprocess.Popen(
        [sys.executable, "-m", "treadle.testing.fake_server", "--latency-ms", str(latency_ms),
         "--script", "file_worker"],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert process.stdout is not None
    return process, process.stdout.readline().strip()


def _sessions(n: int) -> Any:
    for i in range(n):
        yield Session.from_user_message(f"Create a file, then read it back ({i}).").to("local")


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _run(agent: Agent, backend: str, n: int, in_flight: int, base: str) -> list[Any]:
    if backend == "local":
        return await amap(agent, _sessions(n), concurrency=in_flight, return_exceptions=True)
    workers = os.cpu_count() or 1
    return await amap(
        agent,
        _sessions(n),
        backend=backend,
        workers=workers,
        concurrency=max(1, in_flight // workers),
        sandbox_base=base,
        return_exceptions=True,
    )


def main(argv: list[str] | None = None) -> None:
    """Run the comparison and print a markdown table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--passes", type=int, default=2000)
    parser.add_argument("--in-flight", type=int, default=200, help="over all workers")
    parser.add_argument("--latency-ms", type=float, default=50.0)
    parser.add_argument("--backends", default="local,process,ray")
    args = parser.parse_args(argv)
    server, base_url = _start_server(args.latency_ms)
    rows = []
    try:
        agent = Agent("worker", "Use tools.", provider=Provider(model="fake", base_url=base_url))
        with tempfile.TemporaryDirectory(prefix="treadle-bench-") as base:
            for backend in args.backends.split(","):
                note = ""
                if backend == "ray":
                    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
                    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
                    os.environ.setdefault("RAY_TMPDIR", os.path.join(base, "ray"))
                    import ray

                    started = time.perf_counter()
                    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
                    note = f"ray.init {time.perf_counter() - started:.1f} s"
                cpu, wall = _cpu(), time.perf_counter()
                results = asyncio.run(_run(agent, backend, args.passes, args.in_flight, base))
                wall, cpu = time.perf_counter() - wall, _cpu() - cpu
                failed = sum(isinstance(r, BaseException) for r in results)
                if failed:
                    note += f" {failed} failed"
                rows.append(
                    f"| {backend} | {args.passes} | {wall:.1f} s | {args.passes / wall:.0f} "
                    f"| {cpu:.1f} s | {note.strip()} |"
                )
                if backend == "ray":
                    ray.shutdown()
                print(rows[-1], flush=True)
    finally:
        server.terminate()
        server.wait()
    print("\n| backend | passes | wall | passes/s | driver CPU | notes |")
    print("| --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
