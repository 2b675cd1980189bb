"""`python -m benchmarks.telemetry_bench [--before REV] [--passes 200] [--reps 5]`.

What tracing costs per round, measured like scenario 1 (one pass at a time, three tool rounds,
0 ms latency; fresh workers pinned to the client CPU, repetitions interleaved): Treadle with
OpenTelemetry not imported (tracing off, the default), with the API imported but no SDK
configured (still off), and with an SDK tracer and meter provider (spans batched to an exporter
that drops them). With `--before REV` the same run also measures the Treadle of git revision
`REV` (its `src/`, exported with `git archive` to a temporary directory), so "off" can be compared
with the code before the telemetry hooks. Prints a markdown table; results go in
docs/observability.md.
"""

from __future__ import annotations

import argparse
import io
import subprocess
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.harness import ROOT, Harness, Job, median
from benchmarks.scenarios import COMPLETIONS_PER_PASS
from benchmarks.server import ServerProcess


def _export_src(rev: str, into: Path) -> Path:
    """The `src/` tree of git revision `rev`, written under `into`."""
    archive = subprocess.run(
        ["git", "archive", "--format=tar", rev, "src"], cwd=ROOT, capture_output=True, check=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def main(argv: list[str] | None = None) -> None:
    """Run the comparison and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="a git revision to measure alongside (e.g. e6d5848)")
    parser.add_argument("--passes", type=int, default=200)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    params: dict[str, Any] = {"n": args.passes, "stream": False}
    jobs = [
        Job("tracing off (otel not imported)", "treadle", "serial", params),
        Job("tracing off (otel API imported)", "treadle", "serial", {**params, "otel": "api"}),
        Job("tracing on (SDK, spans dropped)", "treadle", "serial", {**params, "otel": "sdk"}),
        Job("aiohttp+orjson floor", "aiohttp", "serial", params),
    ]
    with tempfile.TemporaryDirectory(prefix="treadle-before-") as tmp:
        if args.before:
            src = _export_src(args.before, Path(tmp))
            jobs.insert(
                0, Job(f"before ({args.before})", "treadle", "serial", {**params, "src": str(src)})
            )
        with ServerProcess("tool_loop", rounds=3) as server:
            data = Harness(log=lambda msg: print(msg, flush=True)).measure(server, jobs, args.reps)
    rounds = args.passes * COMPLETIONS_PER_PASS
    cpu = {
        label: median([s.cpu for s in samples]) / rounds * 1e6 for label, samples in data.items()
    }
    spread = {
        label: (
            min(s.cpu for s in samples) / rounds * 1e6,
            max(s.cpu for s in samples) / rounds * 1e6,
        )
        for label, samples in data.items()
    }
    off = cpu[jobs[1 if args.before else 0].label]
    print("\n| Treadle | CPU µs/round (median) | min-max | x off |")
    print("| --- | ---: | ---: | ---: |")
    for label, value in cpu.items():
        low, high = spread[label]
        print(f"| {label} | {value:.0f} | {low:.0f}-{high:.0f} | {value / off:.2f} |")


if __name__ == "__main__":
    main()
