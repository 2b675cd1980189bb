"""`python -m benchmarks.run [--quick | --size tiny] [--out DIR]`: run the suite, write results.

Starts each scenario's fake server in its own process (pinned to CPU 1 where the machine has two
CPUs), runs Treadle and the reference loops interleaved in fresh workers pinned to CPU 0, and
writes `results.json`, `results.md` and `results.png` under `benchmarks/results/`. It prints each
target with PASS/FAIL; a FAIL is a finding, not an error (the exit code stays 0).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import (
    goodput,
    imports_bench,
    report,
    sandbox_bench,
    scale_bench,
    scenarios,
    stores_bench,
    ttft_bench,
    workers_bench,
)
from benchmarks.harness import Harness
from benchmarks.server import can_pin

SIZES: dict[str, dict[str, Any]] = {
    "full": {
        "serial_n": 200,
        "serial_reps": 5,
        "stream_reps": 5,  # as serial_reps: S6a's target is at the floor's edge (1.0x)
        "fanout_ns": [1000, 10000],
        "fanout_reps": 3,
        "fanout_big_reps": 1,
        "growth_rounds": 200,
        "growth_window": 20,
        "growth_reps": 3,
        "parallel_n": 2,
        "parallel_rounds": 3,
        "parallel_reps": 3,
        "import_runs": 9,
        "sandbox_commands": 200,
        "sandbox_reps": 5,
        "variants": True,
        "peers": True,
        "goodput_n": 3000,
        "goodput_rpm": 1200,
        "goodput_tpm": 200_000,
        "goodput_window": 6.0,
        # The process row: (long passes, their tool rounds, short passes, requests per window).
        "goodput_workers": (16, 60, 600, 600),
        "store_conversations": 1000,
        "store_turns": 10,
        "store_reps": 5,
    },
    "quick": {
        "serial_n": 60,
        "serial_reps": 2,
        "stream_reps": 1,
        "fanout_ns": [300],
        "fanout_reps": 1,
        "fanout_big_reps": 1,
        "growth_rounds": 60,
        "growth_window": 10,
        "growth_reps": 1,
        "parallel_n": 1,
        "parallel_rounds": 2,
        "parallel_reps": 1,
        "import_runs": 3,
        "sandbox_commands": 50,
        "sandbox_reps": 2,
        "variants": False,
        "peers": False,
        "goodput_n": 1000,
        "goodput_rpm": 400,
        "goodput_tpm": 66_000,
        "goodput_window": 2.0,
        "goodput_workers": (8, 40, 200, 200),
        "store_conversations": 300,
        "store_turns": 5,
        "store_reps": 1,
    },
    "tiny": {
        "serial_n": 5,
        "serial_reps": 1,
        "stream_reps": 1,
        "fanout_ns": [20],
        "fanout_reps": 1,
        "fanout_big_reps": 1,
        "growth_rounds": 8,
        "growth_window": 2,
        "growth_reps": 1,
        "parallel_n": 1,
        "parallel_rounds": 1,
        "parallel_reps": 1,
        "parallel_kinds": ("async",),
        "import_runs": 1,
        "sandbox_commands": 5,
        "sandbox_reps": 1,
        "variants": False,
        "peers": False,
        "goodput_n": 30,
        "goodput_rpm": 10,
        "goodput_tpm": 2000,
        "goodput_window": 1.0,
        "goodput_workers": (2, 3, 6, 10),
        "store_conversations": 10,
        "store_turns": 2,
        "store_reps": 1,
    },
}
"""Workload sizes: `full` for `make bench`, `quick` for `make bench-quick`, `tiny` for tests."""

DEFAULT_OUT = Path(__file__).resolve().parent / "results"


def main(argv: list[str] | None = None) -> int:
    """Run the suite; returns the process exit code."""
    parser = argparse.ArgumentParser(description="Treadle benchmark suite.")
    parser.add_argument("--quick", action="store_true", help="small sizes, under a minute")
    parser.add_argument("--size", choices=sorted(SIZES), help="full, quick or tiny")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results directory")
    parser.add_argument(
        "--peer-fanout", action="store_true", help="also run installed peers in the fan-out"
    )
    parser.add_argument("--only", help="comma-separated scenario keys (s1,s2,...,s10)")
    parser.add_argument("--goodput-n", type=int, help="passes of the rate-limited scenario (s7)")
    parser.add_argument(
        "--goodput-window", type=float, help="seconds the s7 limits hold for (60: real minutes)"
    )
    parser.add_argument(
        "--baseline-src",
        help="another checkout's src/ to run as 'treadle before' in s1, s2, s6a and s13 "
        "(in s1 and s6a its lazy and await rows)",
    )
    args = parser.parse_args(argv)
    size_name = args.size or ("quick" if args.quick else "full")
    size = {**SIZES[size_name], "peer_fanout": args.peer_fanout}
    if args.baseline_src:
        size["baseline_src"] = str(Path(args.baseline_src).resolve())
    if args.goodput_n is not None:
        size["goodput_n"] = args.goodput_n
    if args.goodput_window is not None:
        size["goodput_window"] = args.goodput_window
    only = set(args.only.split(",")) if args.only else None
    h = Harness(log=lambda msg: print(msg, flush=True))
    started = time.perf_counter()
    plan = [
        ("s1", lambda: scenarios.per_round(h, size, stream=False)),
        ("s2", lambda: scenarios.fanout(h, size, stream=False)),
        ("s3", lambda: scenarios.growth(h, size)),
        ("s4", lambda: scenarios.parallel(h, size)),
        ("s5", lambda: scenarios.import_time(h, size)),
        (
            "s6",
            lambda: scenarios.per_round(
                h, {**size, "serial_reps": size["stream_reps"]}, stream=True
            ),
        ),
        ("s6", lambda: scenarios.fanout(h, size, stream=True)),
        ("s7", lambda: goodput.goodput(h, size)),
        ("s8", lambda: sandbox_bench.sandbox_overhead(h, size)),
        ("s9", lambda: stores_bench.store_overhead(h, size)),
        ("s10", lambda: scenarios.first_fanout(h, size)),
        ("s11", lambda: scale_bench.scale(h, size, size_name)),
        ("s12", lambda: ttft_bench.ttft(h, size)),
        ("s13", lambda: workers_bench.many_cores(h, size)),
        ("s14", lambda: imports_bench.imports(h, size)),
    ]
    results = []
    for key, run in plan:
        if only is not None and key not in only:
            continue
        print(f"== {key} ({time.perf_counter() - started:.0f} s)", flush=True)
        result = run()
        # A ratio to a reference that did not run (small sizes, skipped peers) is left blank.
        result.rows = [
            {k: v for k, v in row.items() if k == "label" or scenarios.finite(v)}
            for row in result.rows
        ]
        results.append(result)
    meta = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "size": size_name,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "pinned": can_pin(),
        "seconds": round(time.perf_counter() - started, 1),
        "notes": list(dict.fromkeys(h.notes)),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    report.write_json(args.out / "results.json", results, meta)
    (args.out / "results.md").write_text(report.markdown(results, meta))
    skipped = report.plot(args.out / "results.png", results)
    print()
    for r in results:
        for t in r.targets:
            print(f"{'PASS' if t.passed else 'FAIL'}  {t.name}: {t.value:.3g} (goal {t.goal})")
    if skipped:
        print(skipped)
    print(f"\nwrote {args.out}/results.{{json,md,png}} in {meta['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
