"""Scenario 13: many cores. One CPU-bound fan-out (0 ms latency, passes of 3 tool rounds) in a
single process (`treadle.map`, local backend) and on 1 and 2 worker processes (what
`backend="process"` runs), reporting completions per second and the client CPU each completion
costs, every process that did the work counted. The target: the workers add no CPU of their own
(per-completion CPU within 1.1x of the single process's). Never asserts on timing.

What the target measures: a warm pool, started and warmed before the timed section, i.e. the
steady-state cost per completion of a pool that serves many passes. `treadle.map(...,
backend="process")` starts a new pool per call and closes it at the end, so a one-off call also
pays each worker's start-up. The rows marked "fresh treadle.map call" (informational, no target)
time whole calls, start-up and close included, at the same size: their excess CPU over the warm
rows, times the completions, is what one call's start-up costs.
"""

from __future__ import annotations

from typing import Any

from benchmarks.harness import Harness, Job, median
from benchmarks.scenarios import COMPLETIONS_PER_PASS, Result, Target
from benchmarks.server import ServerProcess

CPU_GOAL = 1.1
"""Per-completion client CPU on workers at most this times the single process's."""
SINGLE = "single process (treadle.map)"
FRESH = "fresh treadle.map call"
"""Rows of whole `treadle.map(..., backend="process")` calls, pool start-up included: no target."""


def many_cores(h: Harness, size: dict[str, Any]) -> Result:
    """Run scenario 13: five times the serial scenario's passes (1,000 in `make bench`)."""
    n = size["serial_n"] * 5
    module = {"n": n, "module": "benchmarks.workers_loops"}
    jobs = [Job(SINGLE, "treadle", "single", module)]
    jobs += [
        Job(
            f"{w} worker process{'es' if w > 1 else ''}",
            "treadle",
            "process",
            {**module, "workers": w},
        )
        for w in (1, 2)
    ]
    jobs += [  # informational: a user's one-off call, pool start-up included (no target)
        Job(
            f"{w} worker{'s' if w > 1 else ''}, {FRESH}",
            "treadle",
            "fresh_map",
            {**module, "workers": w},
        )
        for w in (1, 2)
    ]
    if size.get("baseline_src"):  # `--baseline-src`: the workers of another checkout, same run
        jobs += [
            Job(f"{job.label} (before)", "treadle", "process", job.params, src=size["baseline_src"])
            for job in jobs[1:3]
        ]
    # The harness rotates the order by one job a repetition: with fewer repetitions than jobs
    # the last jobs never ran first (the two "(before)" rows: 5 repetitions of 7 jobs, the same
    # code measured 1.33x apart). A repeated run has at least one repetition per job.
    reps = size["serial_reps"]
    if reps > 1:
        reps = max(reps, len(jobs))
    # The server's wake-ups must not preempt the worker that shares its CPU (`yield_to_clients`).
    with ServerProcess("tool_loop", rounds=3, batch=True) as server:
        data = h.measure(server, jobs, reps)
    completions = n * COMPLETIONS_PER_PASS
    result = Result(
        "s13",
        f"13. Many cores: {n:,} CPU-bound passes (0 ms latency) on 1 process or worker processes",
        [
            "completions/s",
            "client CPU µs/completion",
            "x single (CPU)",
            "driver µs/completion",
            "workers µs/completion",
            "errors",
        ],
    )
    cpu: dict[str, float] = {}
    for label, samples in data.items():
        cpu[label] = median([s.cpu + float(s.extra["worker_cpu"]) for s in samples]) / completions
        wall = median([s.wall for s in samples])
        result.rows.append(
            {
                "label": label,
                "completions/s": completions / wall,
                "client CPU µs/completion": cpu[label] * 1e6,
                # Each process's share apart: the driver's (this process: scheduling, the
                # pipe, rebuilding outputs) and the workers' own (the passes themselves).
                "driver µs/completion": median([s.cpu for s in samples]) / completions * 1e6,
                "workers µs/completion": median([float(s.extra["worker_cpu"]) for s in samples])
                / completions
                * 1e6,
                "errors": sum(s.errors for s in samples),
            }
        )
        result.series[label] = completions / wall
    single = cpu.get(SINGLE, float("nan"))
    # The ratio: the median over repetitions of each repetition's own ratio, the row's CPU
    # against the single process's run in the same repetition (paired: the jobs of one
    # repetition run within a few jobs of each other, under about the same load from other
    # work; the harness rotates their order). The ratio of
    # the two medians paired nothing: the single process's CPU moved by a third between
    # repetitions of one run, and every row's ratio with it (docs/performance.md, ninth round).
    paired = _paired_ratios(data)
    for row in result.rows:
        ratios = paired.get(row["label"])
        row["x single (CPU)"] = median(ratios) if ratios else cpu[row["label"]] / single
        if not ratios and row["label"] != SINGLE:  # say so: its target reads another statistic
            result.notes.append(
                f"{row['label']}: its repetitions do not pair with the single process's (a job"
                " skipped): x single is the ratio of the medians, not paired"
            )
        if ratios and row["label"] != SINGLE:
            result.notes.append(
                f"{row['label']}: x single per repetition {min(ratios):.2f}-{max(ratios):.2f}"
                f" (median {median(ratios):.3f}; ratio of the medians"
                f" {cpu[row['label']] / single:.3f})"
            )
        label = row["label"]
        if label != SINGLE and not label.endswith("(before)") and FRESH not in label:
            ratio = row["x single (CPU)"]
            result.targets.append(
                Target(
                    f"S13 {row['label']}: CPU per completion vs single process",
                    ratio,
                    f"<= {CPU_GOAL}x",
                    ratio <= CPU_GOAL,
                )
            )
    for w in (1, 2):  # what one call's start-up and close add, per worker, from the same run
        warm, fresh = (
            f"{w} worker process{'es' if w > 1 else ''}",
            f"{w} worker{'s' if w > 1 else ''}, {FRESH}",
        )
        if warm in cpu and fresh in cpu:
            extra_ms = (cpu[fresh] - cpu[warm]) * completions / w * 1e3
            result.notes.append(
                f"{fresh}: {extra_ms:.0f} ms of CPU per worker over the warm pool's"
                " (start-up, its first passes, close)"
            )
    result.notes.append("the single process's row has all its CPU in the driver column")
    result.notes.append(
        f"targets: a warm pool (steady state); the '{FRESH}' rows time whole calls, each worker's"
        " start-up and close included, and have no target"
    )
    result.notes.append(
        "the driver runs on the client CPU, the fake server on its own, worker i of a warm pool"
        " on CPU i (on a 2-CPU machine worker 0 shares the driver's CPU and worker 1 the"
        " server's, which runs as SCHED_BATCH so that its wake-ups do not preempt that worker);"
        " the 'fresh' rows' workers are free to use any CPU, as a user's are"
    )
    return result


def _paired_ratios(data: dict[str, list[Any]]) -> dict[str, list[float]]:
    """Each row's CPU per repetition over the single process's in the same repetition (none
    when a row's samples and the single process's do not pair up, e.g. a skipped job)."""
    single = [s.cpu + float(s.extra["worker_cpu"]) for s in data.get(SINGLE, [])]
    out: dict[str, list[float]] = {}
    for label, samples in data.items():
        if len(samples) == len(single) and all(single):
            cpus = [s.cpu + float(s.extra["worker_cpu"]) for s in samples]
            out[label] = [c / base for c, base in zip(cpus, single, strict=True)]
    return out
