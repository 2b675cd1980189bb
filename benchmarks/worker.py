"""One measurement in a fresh process: `python -m benchmarks.worker '<job JSON>'`.

The orchestrator (`benchmarks.run`) starts a worker per measurement, pinned to the client CPU,
so each contestant starts from the same state (no warm caches, garbage or threads left by
another). The worker imports only the contestant it runs (peer runners use other venvs without
Treadle), measures the timed section the contestant marks and prints one JSON line.
It must never import Treadle itself.
"""

from __future__ import annotations

import gc
import importlib
import json
import resource
import sys
import time
from typing import Any

CONTESTANTS = {
    "treadle": "benchmarks.contestants.treadle_loop",
    "httpx": "benchmarks.reference.httpx_loop",
    "aiohttp": "benchmarks.reference.aiohttp_loop",
    "raw": "benchmarks.reference.raw_loop",
    "treadle-scale": "benchmarks.contestants.treadle_scale",
    "openai-agents": "benchmarks.peers.openai_agents_loop",
    "pydantic-ai": "benchmarks.peers.pydantic_ai_loop",
    "openrath": "benchmarks.peers.openrath_loop",
}
"""Contestant name -> module with `serial`, `fanout`, `growth`, `parallel` functions."""


class Meter:
    """Wall and process-CPU time of the section between `start()` and `stop()`."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0
        self._wall0 = self._cpu0 = 0.0

    def start(self) -> None:
        """Begin the timed section (after warm-up), from a collected heap.

        The first full collection after start-up is a one-off whose timing depends on what the
        process imported (about 30 ms for Treadle's imports, less for a bare aiohttp loop): left
        to chance, it lands inside one contestant's timed section and not another's. Collecting
        here, for every contestant alike, measures the steady state.
        """
        gc.collect()
        self._wall0, self._cpu0 = time.perf_counter(), time.process_time()

    def stop(self) -> None:
        """End the timed section."""
        self.wall = time.perf_counter() - self._wall0
        self.cpu = time.process_time() - self._cpu0


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    """Run `job` (contestant, kind and parameters) and return its measurements."""
    # A scenario with its own workload module names it (`module`); the kind is a function there.
    module = importlib.import_module(job.get("module") or CONTESTANTS[job["contestant"]])
    if job.get("gc") == "freeze":
        gc.collect()
        gc.freeze()  # start-up objects leave the collector's view: fewer, cheaper collections
    meter = Meter()
    extra = getattr(module, job["kind"])(job, meter) or {}
    return {
        "wall": meter.wall,
        "cpu": meter.cpu,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        **extra,
    }


def main() -> None:
    """Entry point: the job is argv[1] as JSON; the result is printed as one JSON line."""
    job = json.loads(sys.argv[1])
    print(json.dumps(run_job(job)), flush=True)


if __name__ == "__main__":
    main()
