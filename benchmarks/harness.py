"""Running measurements: worker subprocesses pinned to the client CPU, interleaved repetitions.

`Harness.measure(server, jobs, reps)` runs every job once per repetition, rotating the order each
repetition so no contestant always goes first, and records the server's CPU over each job so a
result can say whether the server kept up. It must never run two measurements at once.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.server import CLIENT_CPU, ServerProcess, pin

ROOT = Path(__file__).resolve().parent.parent
PEERS_DIR = Path(__file__).resolve().parent / ".peers"
WORKER_TIMEOUT_SECONDS = 300.0
PEERS = ("openai-agents", "pydantic-ai", "openrath")


def python_for(contestant: str) -> str | None:
    """The interpreter that runs `contestant` (a peer's own venv; None when it is absent)."""
    if contestant not in PEERS:
        return sys.executable
    python = PEERS_DIR / contestant / "bin" / "python"
    return str(python) if python.exists() else None


@dataclass
class Job:
    """One contestant running one workload; `label` names its row in the results."""

    label: str
    contestant: str
    kind: str
    params: dict[str, Any] = field(default_factory=dict)
    reps: int | None = None
    """Repetitions for this job (None: the scenario's)."""
    src: str | None = None
    """Another checkout's `src/` to measure instead of this one (`--baseline-src`)."""
    timeout: float | None = None
    """Seconds the worker may take (None: `WORKER_TIMEOUT_SECONDS`)."""


@dataclass
class Sample:
    """One measurement of one job."""

    wall: float
    cpu: float
    peak_rss: int
    errors: int
    server_cpu: float
    extra: dict[str, Any]


def run_worker(job: Job, url: str, timeout: float = WORKER_TIMEOUT_SECONDS) -> dict[str, Any]:
    """Run `job` in a fresh worker pinned to the client CPU; its JSON result (or an error)."""
    python = python_for(job.contestant)
    if python is None:
        return {"skipped": f"{job.contestant} is not installed (run benchmarks/peers/setup.sh)"}
    spec = json.dumps({"contestant": job.contestant, "kind": job.kind, "url": url, **job.params})
    # Measure the Treadle of this checkout (its src/, or the tree a job names), whatever else
    # is installed.
    src = job.src or job.params.get("src") or str(ROOT / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, str(ROOT)])}
    proc = subprocess.Popen(
        [python, "-m", "benchmarks.worker", spec],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pin(proc.pid, CLIENT_CPU)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"failed": f"timed out after {timeout:.0f} s"}
    if proc.returncode != 0 or not out.strip():
        return {"failed": (err.strip().splitlines() or ["no output"])[-1][:300]}
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


class Harness:
    """Runs jobs, keeps samples per label, and notes what was skipped or failed."""

    def __init__(self, log: Any = print) -> None:
        self.log = log
        self.notes: list[str] = []

    def measure(self, server: ServerProcess, jobs: list[Job], reps: int) -> dict[str, list[Sample]]:
        """Every job `reps` times (or its own `reps`), interleaved; samples by label."""
        samples: dict[str, list[Sample]] = {job.label: [] for job in jobs}
        skipped: set[str] = set()
        for rep in range(max(job.reps or reps for job in jobs)):
            shift = rep % len(jobs)
            for job in jobs[shift:] + jobs[:shift]:
                if rep >= (job.reps or reps) or job.label in skipped:
                    continue
                cpu0 = server.cpu()
                started = time.perf_counter()
                result = run_worker(job, server.url, job.timeout or WORKER_TIMEOUT_SECONDS)
                elapsed = time.perf_counter() - started
                if "skipped" in result or "failed" in result:
                    skipped.add(job.label)
                    note = f"{job.label}: {result.get('skipped') or result.get('failed')}"
                    self.notes.append(note)
                    self.log(f"    {note}")
                    continue
                sample = Sample(
                    wall=result.pop("wall"),
                    cpu=result.pop("cpu"),
                    peak_rss=result.pop("peak_rss"),
                    errors=result.pop("errors", 0),
                    server_cpu=server.cpu() - cpu0,
                    extra=result,
                )
                # Over the worker's whole life (start-up included): a lower bound on the
                # server's load in the timed section, close to it when that section dominates.
                sample.extra["server_util"] = sample.server_cpu / max(elapsed, 1e-9)
                samples[job.label].append(sample)
                self.log(
                    f"    {job.label:<28} wall {sample.wall:8.3f} s  cpu {sample.cpu:8.3f} s"
                    f"  errors {sample.errors}"
                )
        return {label: s for label, s in samples.items() if s}


def median(values: list[float]) -> float:
    """The median (nan for no values)."""
    return statistics.median(values) if values else float("nan")
