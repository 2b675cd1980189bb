"""The six scenarios: which jobs run against which server, and what is reported of them.

Each scenario returns a `Result`: a table (rows of named numbers, medians over repetitions),
targets with PASS/FAIL, and series for the plot. Ratios compare contestants measured in the same
run; absolute times are not comparable across runs or machines. Never asserts on timing.
"""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

from benchmarks.harness import PEERS, ROOT, Harness, Job, Sample, median
from benchmarks.server import CLIENT_CPU, ServerProcess, pin

COMPLETIONS_PER_PASS = 4
"""3 tool rounds plus the final answer: a "round" below is one chat completion request."""
FANOUT_LATENCY_MS = 50.0
IMPORT_TARGET_MS = 200.0


@dataclass
class Target:
    """A goal the suite reports on (not a test assertion)."""

    name: str
    value: float
    goal: str
    passed: bool


@dataclass
class Result:
    """One scenario's table, targets and plot series."""

    key: str
    title: str
    columns: list[str]
    rows: list[dict[str, Any]] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    series: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _m(samples: list[Sample], attr: str) -> float:
    return median([getattr(s, attr) for s in samples])


def _mx(samples: list[Sample], key: str) -> float:
    return median([float(s.extra[key]) for s in samples if key in s.extra])


def _peer_jobs(size: dict[str, Any], kind: str, params: dict[str, Any]) -> list[Job]:
    if not size["peers"]:
        return []
    return [Job(f"{p} (peer)", p, kind, params, reps=1) for p in PEERS]


def _baseline(
    size: dict[str, Any],
    kind: str,
    params: dict[str, Any],
    label: str = "treadle before (baseline)",
) -> list[Job]:
    """Treadle from another checkout (`--baseline-src`), for before/after in the same run."""
    src = size.get("baseline_src")
    return [Job(label, "treadle", kind, params, src=src)] if src else []


def per_round(h: Harness, size: dict[str, Any], *, stream: bool) -> Result:
    """Scenarios 1 and 6a: one pass at a time, 0 ms latency, CPU and wall per round."""
    n = size["serial_n"]
    params = {"n": n, "stream": stream}
    jobs = [
        Job("treadle (lazy facade)", "treadle", "serial", params),
        Job("treadle (await arun)", "treadle", "serial", {**params, "variant": "await"}),
        Job("httpx hand loop", "httpx", "serial", params),
        Job("aiohttp+orjson floor", "aiohttp", "serial", params),
        Job("treadle (tracing on, SDK)", "treadle", "serial", {**params, "otel": "sdk"}),
    ]
    if not stream:  # what one raw socket costs: below the floor, for scale (see raw_loop.py)
        jobs.append(Job("raw-socket hand loop", "raw", "serial", params))
    if not size["variants"]:
        jobs = [jobs[0], jobs[3]]
    jobs += _baseline(size, "serial", params)  # streamed too: "nothing slower" is checked both ways
    if size["variants"]:  # the facade's cost is the gap between these two: both, before and after
        await_params = {**params, "variant": "await"}
        jobs += _baseline(size, "serial", await_params, "treadle before (await arun)")
    jobs += _peer_jobs(size, "serial", params) if not stream else []
    key, title = (
        ("s6a", "6a. Per-round overhead, streamed")
        if stream
        else ("s1", "1. Per-round overhead (0 ms latency, one pass at a time, 3 tool rounds)")
    )
    with ServerProcess("tool_loop", rounds=3) as server:
        data = h.measure(server, jobs, size["serial_reps"])
    rounds = n * COMPLETIONS_PER_PASS
    result = Result(
        key,
        title,
        [
            "CPU µs/round",
            "wall µs/round",
            "x floor (CPU)",
            "x httpx (CPU)",
            "errors",
            "server CPU %",
        ],
    )
    floor = _m(data.get("aiohttp+orjson floor", []), "cpu") / rounds
    ref = _m(data.get("httpx hand loop", []), "cpu") / rounds
    for label, samples in data.items():
        cpu = _m(samples, "cpu") / rounds
        result.rows.append(
            {
                "label": label,
                "CPU µs/round": cpu * 1e6,
                "wall µs/round": _m(samples, "wall") / rounds * 1e6,
                "x floor (CPU)": cpu / floor,
                "x httpx (CPU)": cpu / ref,
                "errors": sum(s.errors for s in samples),
                "server CPU %": _mx(samples, "server_util") * 100,
            }
        )
    result.series = {r["label"]: r["CPU µs/round"] for r in result.rows}
    mine = next((r for r in result.rows if r["label"] == "treadle (lazy facade)"), None)
    if mine is not None and not stream:
        ratio = mine["x floor (CPU)"]
        result.targets.append(
            Target("S1 CPU/round vs aiohttp floor", ratio, "<= 1.3x", ratio <= 1.3)
        )
    if mine is not None and stream:  # issue 33: streamed rounds at the floor's streamed loop
        ratio = mine["x floor (CPU)"]
        result.targets.append(
            Target("S6a streamed CPU/round vs aiohttp floor", ratio, "<= 1.0x", ratio <= 1.0)
        )
    return result


def fanout(h: Harness, size: dict[str, Any], *, stream: bool) -> Result:
    """Scenarios 2 and 6b: thousands of concurrent passes at 50 ms latency."""
    key, title = (
        ("s6b", "6b. Fan-out, streamed (50 ms latency)")
        if stream
        else ("s2", "2. Fan-out (50 ms latency, concurrent passes of 3 tool rounds)")
    )
    ideal = COMPLETIONS_PER_PASS * FANOUT_LATENCY_MS / 1000
    result = Result(
        key,
        title,
        [
            "passes",
            "wall s",
            "x ideal",
            "x floor (wall)",
            "completions/s",
            "client CPU s",
            "peak RSS MB",
            "errors",
            "server CPU %",
        ],
    )
    for n in size["fanout_ns"] if not stream else size["fanout_ns"][:1]:
        p = {"n": n, "stream": stream}
        big = n > size["fanout_ns"][0]
        jobs = [Job("treadle (lazy facade)", "treadle", "fanout", p)]
        if size["variants"] and not big:
            jobs += [
                Job("treadle (await arun)", "treadle", "fanout", {**p, "variant": "await"}),
                Job("treadle (lazy, gc.freeze)", "treadle", "fanout", {**p, "gc": "freeze"}),
            ]
            if not stream:
                jobs.append(Job("httpx hand loop", "httpx", "fanout", p, reps=1))
        jobs.append(Job("aiohttp+orjson floor", "aiohttp", "fanout", p))
        jobs += _baseline(size, "fanout", p) if not stream else []
        if not stream and not big and size.get("peer_fanout"):
            jobs += _peer_jobs(size, "fanout", p)  # about a minute per peer
        reps = size["fanout_big_reps"] if big else size["fanout_reps"]
        with ServerProcess("tool_loop", rounds=3, latency_ms=FANOUT_LATENCY_MS) as server:
            data = h.measure(server, jobs, reps)
        floor = _m(data.get("aiohttp+orjson floor", []), "wall")
        for label, samples in data.items():
            wall = _m(samples, "wall")
            result.rows.append(
                {
                    "label": f"{label}, {n:,}",
                    "passes": n,
                    "wall s": wall,
                    "x ideal": wall / ideal,
                    "x floor (wall)": wall / floor,
                    "completions/s": n * COMPLETIONS_PER_PASS / wall,
                    "client CPU s": _m(samples, "cpu"),
                    "peak RSS MB": _m(samples, "peak_rss") / 2**20,
                    "errors": sum(s.errors for s in samples),
                    "server CPU %": _mx(samples, "server_util") * 100,
                }
            )
            result.series[f"{label}, {n:,}"] = wall
        if stream:
            continue
        mine = data.get("treadle (lazy facade)", [])
        if mine:
            ratio = _m(mine, "wall") / floor
            result.targets.append(
                Target(f"S2 {n:,} passes wall vs aiohttp floor", ratio, "<= 1.5x", ratio <= 1.5)
            )
        if mine and big:
            errors = sum(s.errors for s in mine)
            floor_rss = max((s.peak_rss for s in data.get("aiohttp+orjson floor", [])), default=1)
            rss = max(s.peak_rss for s in mine) / floor_rss
            result.targets += [
                Target(f"S2 {n:,} passes: errors", errors, "0", errors == 0),
                Target(f"S2 {n:,} passes: peak RSS vs floor", rss, "<= 1.5x", rss <= 1.5),
            ]
    result.notes.append(f"ideal (latency-bound) wall: {ideal:.2f} s")
    return result


FIRST_FANOUT_PASSES = 50
FIRST_FANOUT_LATENCY_MS = 500.0


def first_fanout(h: Harness, size: dict[str, Any]) -> Result:
    """Scenario 10: the first fan-out to a new endpoint (no warm-up: limits not yet learned).

    50 passes of one tool round at 500 ms latency, each job in a fresh process: the default first
    wave (16 requests before the first reply, 64 once the endpoint stayed silent for 50 ms), a wave
    as large as the fan-out (`first_wave=64`), a lone first request (`first_wave=1`), against the
    latency-bound ideal. The endpoint is new, the process is not: the HTTP stack is imported
    before the timed section (its import time is scenario 5's).
    """
    n = FIRST_FANOUT_PASSES
    completions = 2  # one tool round, then the answer
    ideal = completions * FIRST_FANOUT_LATENCY_MS / 1000
    result = Result(
        "s10",
        "10. First fan-out to a new endpoint (50 passes, 500 ms latency, 1 tool round)",
        ["passes", "wall s", "x ideal", "errors"],
    )
    p = {"n": n, "cold": True}
    jobs = [
        Job("treadle (first wave 16)", "treadle", "fanout", p),
        Job("treadle (first wave 64)", "treadle", "fanout", {**p, "first_wave": 64}),
        Job("treadle (lone first request)", "treadle", "fanout", {**p, "first_wave": 1}),
        *_baseline(size, "fanout", p),
    ]
    with ServerProcess("tool_loop", rounds=1, latency_ms=FIRST_FANOUT_LATENCY_MS) as server:
        data = h.measure(server, jobs, size["fanout_reps"])
    for label, samples in data.items():
        wall = _m(samples, "wall")
        result.rows.append(
            {
                "label": label,
                "passes": n,
                "wall s": wall,
                "x ideal": wall / ideal,
                "errors": sum(s.errors for s in samples),
            }
        )
        result.series[label] = wall
    for label in ("treadle (first wave 16)", "treadle (first wave 64)"):
        mine = data.get(label, [])
        if mine:
            ratio = _m(mine, "wall") / ideal
            name = f"S10 first fan-out, {label[9:-1]}: wall vs ideal"
            result.targets.append(Target(name, ratio, "<= 1.1x", ratio <= 1.1))
    result.notes.append(f"ideal (latency-bound) wall: {ideal:.2f} s")
    return result


def growth(h: Harness, size: dict[str, Any]) -> Result:
    """Scenario 3: one pass of many tool rounds; late rounds against early ones."""
    rounds, window = size["growth_rounds"], size["growth_window"]
    jobs = [
        Job("treadle (lazy facade)", "treadle", "growth", {"rounds": rounds}),
        Job("aiohttp+orjson floor", "aiohttp", "growth", {"rounds": rounds}),
    ]
    if size["variants"]:
        jobs.insert(1, Job("httpx hand loop", "httpx", "growth", {"rounds": rounds}))
    with ServerProcess("tool_loop", rounds=rounds) as server:
        data = h.measure(server, jobs, size["growth_reps"])
    first, last = f"CPU µs rounds 1-{window}", f"CPU µs rounds {rounds - window + 1}-{rounds}"
    result = Result(
        "s3",
        f"3. Transcript growth (one pass of {rounds} tool rounds)",
        [first, last, "growth", "µs per extra message"],
    )
    extra_messages = 2 * (rounds - window)  # each round adds an assistant and a tool message
    for label, samples in data.items():
        early = median([sum(s.extra["round_cpu"][:window]) / window for s in samples])
        late = median([sum(s.extra["round_cpu"][-window:]) / window for s in samples])
        result.rows.append(
            {
                "label": label,
                first: early * 1e6,
                last: late * 1e6,
                "growth": late / early,
                "µs per extra message": (late - early) / extra_messages * 1e6,
            }
        )
        curves = [s.extra["round_cpu"] for s in samples]
        result.series[label] = [
            median([c[i] for c in curves]) * 1e6 for i in range(min(map(len, curves)))
        ]
    mine = next((r for r in result.rows if r["label"].startswith("treadle")), None)
    if mine is not None:
        result.targets += [
            Target(
                "S3 growth (late/early rounds)", mine["growth"], "<= 1.5x", mine["growth"] <= 1.5
            ),
            Target(
                "S3 marginal µs per transcript message",
                mine["µs per extra message"],
                "< 10 µs",
                mine["µs per extra message"] < 10,
            ),
        ]
    return result


def parallel(h: Harness, size: dict[str, Any]) -> Result:
    """Scenario 4: 8 tool calls per round, each sleeping 100 ms, sync and async tools."""
    rounds, n = size["parallel_rounds"], size["parallel_n"]
    result = Result(
        "s4",
        "4. Parallel tools (8 calls per round, 100 ms each)",
        ["ms per tool round", "x one tool time", "errors"],
    )
    jobs = []
    for kind in size.get("parallel_kinds", ("async", "sync")):
        p = {"n": n, "tool_kind": kind, "warmup": 1}
        jobs += [
            Job(f"treadle, {kind} tools", "treadle", "parallel", p),
            Job(f"aiohttp+orjson floor, {kind} tools", "aiohttp", "parallel", p),
        ]
        if size["variants"]:
            jobs.append(Job(f"httpx hand loop, {kind} tools", "httpx", "parallel", p))
    with ServerProcess("parallel", rounds=rounds, calls=8) as server:
        data = h.measure(server, jobs, size["parallel_reps"])
    for label, samples in data.items():
        per = _m(samples, "wall") / (n * rounds) * 1000
        result.rows.append(
            {
                "label": label,
                "ms per tool round": per,
                "x one tool time": per / 100,
                "errors": sum(s.errors for s in samples),
            }
        )
        result.series[label] = per
        if label.startswith("treadle"):
            kind = label.split(", ")[1]
            result.targets.append(
                Target(f"S4 {kind}: ms per round", per, "~100 (<= 125)", per <= 125)
            )
    result.notes.append(
        "the hand loops run sync tools with asyncio.to_thread (default pool: "
        "min(32, CPUs + 4) threads)"
    )
    return result


_IMPORT = "import time; t = time.perf_counter(); {stmt}; print(time.perf_counter() - t)"


def _import_seconds(stmt: str) -> float:
    proc = subprocess.Popen(
        [sys.executable, "-c", _IMPORT.format(stmt=stmt)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    pin(proc.pid, CLIENT_CPU)
    out, _ = proc.communicate(timeout=60)
    return float(out.strip())


def import_time(h: Harness, size: dict[str, Any]) -> Result:
    """Scenario 5: import time in a fresh interpreter each run (median)."""
    full = "from treadle import Session, Provider, run_session_loop, tool"
    statements = {
        "import treadle": "import treadle",
        full: full,
        "import httpx (for scale)": "import httpx",
        "import aiohttp (for scale)": "import aiohttp",
    }
    if not size["variants"]:
        statements = dict(list(statements.items())[:2])
    times: dict[str, list[float]] = {label: [] for label in statements}
    for _ in range(size["import_runs"]):
        for label, stmt in statements.items():  # interleaved, like the other scenarios
            times[label].append(_import_seconds(stmt))
    result = Result("s5", "5. Import time (fresh interpreter, median)", ["ms"])
    for label, values in times.items():
        result.rows.append({"label": label, "ms": median(values) * 1000})
        result.series[label] = median(values) * 1000
    for row in result.rows[:2]:
        result.targets.append(
            Target(f"S5 {row['label']} ms", row["ms"], "< 200", row["ms"] < IMPORT_TARGET_MS)
        )
    h.log("    import: " + ", ".join(f"{r['label']} {r['ms']:.0f} ms" for r in result.rows))
    return result


def finite(value: Any) -> bool:
    """True for a real number that is not nan or infinite."""
    return isinstance(value, int | float) and math.isfinite(value)
