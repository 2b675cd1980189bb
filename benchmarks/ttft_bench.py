"""Scenario 12: time to first token through a pass, 1,000 streams at once (50 ms latency).

Every pass is one streamed completion (the fake server answers in text at once); each contestant
stamps when its first piece of text arrived, counted from the moment the fan-out starts. The
rows give the median, p90 and last first-token times; the target compares Treadle's median with
the aiohttp+orjson floor's in the same run. Never asserts on timing.
"""

from __future__ import annotations

from typing import Any

from benchmarks.harness import Harness, Job, median
from benchmarks.scenarios import Result, Target
from benchmarks.server import ServerProcess

TTFT_LATENCY_MS = 50.0
TTFT_GOAL = 1.1
"""Treadle's median time to first token at most this times the floor's."""


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ttft(h: Harness, size: dict[str, Any]) -> Result:
    """Run scenario 12 with as many streams as the size's first fan-out (1,000 in `make bench`)."""
    n = size["fanout_ns"][0]
    params = {"n": n, "module": "benchmarks.ttft_loops"}
    jobs = [
        Job("treadle (stream_session_loop)", "treadle", "treadle", params),
        Job("aiohttp+orjson floor", "aiohttp", "aiohttp", params),
    ]
    with ServerProcess("tool_loop", rounds=0, latency_ms=TTFT_LATENCY_MS) as server:
        data = h.measure(server, jobs, size["fanout_reps"])
    result = Result(
        "s12",
        f"12. Time to first token, {n:,} concurrent streams ({TTFT_LATENCY_MS:.0f} ms latency)",
        ["streams", "median ms", "p90 ms", "last ms", "x floor (median)", "errors"],
    )
    medians: dict[str, float] = {}
    for label, samples in data.items():
        medians[label] = median([median(s.extra["ttft"]) for s in samples])
        result.rows.append(
            {
                "label": label,
                "streams": n,
                "median ms": medians[label] * 1000,
                "p90 ms": median([_percentile(s.extra["ttft"], 0.9) for s in samples]) * 1000,
                "last ms": median([max(s.extra["ttft"], default=0.0) for s in samples]) * 1000,
                "errors": sum(s.errors for s in samples),
            }
        )
        result.series[label] = medians[label] * 1000
    floor = medians.get("aiohttp+orjson floor", float("nan"))
    for row in result.rows:
        row["x floor (median)"] = medians[row["label"]] / floor
    mine = medians.get("treadle (stream_session_loop)")
    if mine is not None:
        ratio = mine / floor
        result.targets.append(
            Target(
                f"S12 time to first token, {n:,} streams: median vs floor",
                ratio,
                f"<= {TTFT_GOAL}x",
                ratio <= TTFT_GOAL,
            )
        )
    result.notes.append(f"the latency alone puts the first token at {TTFT_LATENCY_MS:.0f} ms")
    return result
