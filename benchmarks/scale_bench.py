"""Scenario 11: a hundred thousand passes submitted at once, against the aiohttp+orjson floor.

Each size runs Treadle's lazy facade (`run_session_loop` called `n` times, then every output read)
and the floor's hand loop (`asyncio.gather` of `n` passes) against one fake server in its own
process (50 ms latency, 3 tool rounds, both at the default cap of 1,000 connections). Reported:
wall, the time submission took to return, peak RSS and its growth per pass from one size to the
next (flat when a pass costs the same at any scale), and, against a server that holds every reply
back, the memory of a running pass (holding a connection) and of a pending one (waiting for one).
"""

from __future__ import annotations

from typing import Any

from benchmarks.harness import Harness, Job, Sample, median
from benchmarks.scenarios import COMPLETIONS_PER_PASS, FANOUT_LATENCY_MS, Result, Target
from benchmarks.server import ServerProcess

SUBMIT_SECONDS_PER_100K = 2.0
RSS_CEILING = 1.5 * 2**30
SECONDS_PER_PASS_AT_WORST = 0.02
"""A worker's time limit per pass (a loaded 2-core machine runs 100,000 in about 10 minutes)."""
SIZES: dict[str, dict[str, Any]] = {
    "full": {"scale_ns": [1000, 10000, 100000], "scale_reps": 1, "scale_memory": (1000, 9000)},
    "quick": {"scale_ns": [1000, 5000], "scale_reps": 1, "scale_memory": (500, 2000)},
    "tiny": {"scale_ns": [20, 40], "scale_reps": 1, "scale_memory": (10, 20)},
}
"""This scenario's sizes by suite size (kept here: `benchmarks.run` only names the size)."""
MEMORY_LATENCY_MS = 60_000.0
"""The memory probe's server answers after a minute: every pass it weighs is still in flight."""


def _peak(samples: list[Sample]) -> float:
    return max((s.peak_rss for s in samples), default=float("nan"))


def scale(h: Harness, size: dict[str, Any], size_name: str) -> Result:
    """Scenario 11 at the sizes `SIZES[size_name]` gives, plus the per-pass memory probe."""
    size = {**size, **SIZES[size_name]}
    ns: list[int] = size["scale_ns"]
    result = Result(
        "s11",
        "11. A hundred thousand passes (50 ms latency, 3 tool rounds, submitted at once)",
        ["passes", "wall s", "x floor (wall)", "submit s", "peak RSS MB", "x floor (RSS)",
         "KB/pass growth", "errors", "server CPU %"],
    )  # fmt: skip
    previous: dict[str, tuple[int, float]] = {}
    for n in ns:
        timeout = max(300.0, n * SECONDS_PER_PASS_AT_WORST)
        jobs = [
            Job("treadle (lazy facade)", "treadle-scale", "scale", {"n": n}, timeout=timeout),
            Job("aiohttp+orjson floor", "aiohttp", "fanout", {"n": n}, timeout=timeout),
        ]
        # `--baseline-src`: before/after in the same run (up to 10,000: the tree before this
        # scenario took 95 s for 10,000 where this one took 65 s: 100,000 would not fit a run).
        if size.get("baseline_src") and n <= 10_000:
            jobs.append(
                Job(
                    "treadle before (baseline)",
                    "treadle-scale",
                    "scale",
                    {"n": n},
                    src=size["baseline_src"],
                    timeout=timeout,
                )
            )
        with ServerProcess("tool_loop", rounds=3, latency_ms=FANOUT_LATENCY_MS) as server:
            data = h.measure(server, jobs, size["scale_reps"])
        floor = data.get("aiohttp+orjson floor", [])
        floor_wall, floor_rss = median([s.wall for s in floor]), _peak(floor)
        for label, samples in data.items():
            wall, peak = median([s.wall for s in samples]), _peak(samples)
            before = previous.get(label)
            growth = (peak - before[1]) / (n - before[0]) / 1024 if before else float("nan")
            previous[label] = (n, peak)
            result.rows.append(
                {
                    "label": f"{label}, {n:,}",
                    "passes": n,
                    "wall s": wall,
                    "x floor (wall)": wall / floor_wall,
                    "submit s": median([s.extra["submit"] for s in samples if "submit" in s.extra]),
                    "peak RSS MB": peak / 2**20,
                    "x floor (RSS)": peak / floor_rss,
                    "KB/pass growth": growth,
                    "errors": sum(s.errors for s in samples),
                    "server CPU %": median([s.extra["server_util"] for s in samples]) * 100,
                }
            )
            result.series[f"{label}, {n:,}"] = wall
        mine = data.get("treadle (lazy facade)", [])
        if mine and n == ns[-1]:
            result.targets += _targets(n, mine, floor_wall, floor_rss)
    result.rows += _memory_rows(h, size)
    ideal = COMPLETIONS_PER_PASS * FANOUT_LATENCY_MS / 1000
    result.notes.append(
        f"latency-bound ideal at 1,000 connections: {ideal:.2f} s per 1,000 passes; KB/pass "
        "growth: peak RSS added per pass from the size before"
    )
    return result


def _targets(n: int, mine: list[Sample], floor_wall: float, floor_rss: float) -> list[Target]:
    errors = sum(s.errors for s in mine)
    wall = median([s.wall for s in mine]) / floor_wall
    peak = _peak(mine)
    submit = median([s.extra["submit"] for s in mine])
    submit_goal = max(SUBMIT_SECONDS_PER_100K * n / 100_000, 0.05)  # start-up: a constant
    return [
        Target(f"S11 {n:,} passes: errors", errors, "0", errors == 0),
        Target(f"S11 {n:,} passes: wall vs floor", wall, "<= 1.1x", wall <= 1.1),
        Target(f"S11 {n:,} passes: peak RSS GiB", peak / 2**30, "<= 1.5", peak <= RSS_CEILING),
        Target(
            f"S11 {n:,} passes: peak RSS vs floor",
            peak / floor_rss,
            "<= 1.5x",
            peak / floor_rss <= 1.5,
        ),
        Target(
            f"S11 {n:,} passes: submission s",
            submit,
            f"< {submit_goal:.3g}",
            submit < submit_goal,
        ),
    ]


def _memory_rows(h: Harness, size: dict[str, Any]) -> list[dict[str, Any]]:
    running, pending = size["scale_memory"]
    # Not learning limits: a first wave would keep all but a few passes waiting for the first
    # reply, which the probe's server never sends in time.
    params = {"running": running, "pending": pending, "settle": 8.0, "learn_rate_limits": False}
    job = Job("treadle memory probe", "treadle-scale", "memory", params)
    with ServerProcess("tool_loop", rounds=3, latency_ms=MEMORY_LATENCY_MS) as server:
        data = h.measure(server, [job], 1)
    rows = []
    for samples in data.values():
        rows += [
            {
                "label": f"treadle, KB per running pass ({running:,} in flight)",
                "KB/pass growth": median([s.extra["per_running"] for s in samples]) / 1024,
            },
            {
                "label": f"treadle, KB per pending pass ({pending:,} more, waiting to start or "
                "for a connection)",
                "KB/pass growth": median([s.extra["per_pending"] for s in samples]) / 1024,
            },
        ]
    return rows
