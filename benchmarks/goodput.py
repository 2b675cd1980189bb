"""Scenario 7, rate-limited goodput: thousands of one-completion passes against a limited endpoint.

The fake server enforces requests and tokens per window as token buckets and sends the
`x-ratelimit-*` headers and 429 + `Retry-After` providers send. The full size is 3,000 passes
against 1,200 RPM and 200,000 TPM; a real minute would make it 2.5 minutes per contestant, so the
window is time-scaled: by default the limits hold per 6 s (the same numbers, ten times faster; the
reset headers shrink with it). `goodput_window` = 60 runs it in real minutes.

Each contestant gets a fresh server (a full bucket, like a fresh key), and is measured against the
limit-bound ideal: the least time the server's buckets allow for the work, burst included
(`max((requests - RPM) / rate, (tokens - TPM) / token rate)` plus one latency). The 429s the
server sent are read from its `/stats`.

The process rows run one map on 2 worker processes with the load spread unevenly (the first
worker's slots get the passes of many rounds, the other's one-completion passes, which end
early), against a requests limit: split (each worker paces at half of what it learned, the
behaviour before the shared broker) and shared (the workers lease the learned limits from the
driver), in the same run. Worker start-up is not timed.
"""

from __future__ import annotations

from typing import Any

from benchmarks.harness import PEERS, Harness, Job, Sample
from benchmarks.scenarios import FANOUT_LATENCY_MS, Result, Target
from benchmarks.server import ServerProcess

GOAL_X_IDEAL = 1.1
GOAL_429_SHARE = 0.01


def _jobs(size: dict[str, Any], n: int, rpm: int, tpm: int, window: float) -> list[Job]:
    p: dict[str, Any] = {"n": n}
    per_minute = 60.0 / window  # what the time-scaled limits are per real minute
    given = {"requests_per_minute": round(rpm * per_minute),
             "tokens_per_minute": round(tpm * per_minute)}  # fmt: skip
    jobs = [
        Job("treadle (no configuration)", "treadle", "fanout", p),
        Job("treadle (limits given)", "treadle", "fanout", {**p, **given}),
        Job(
            "treadle before (learning off, 10 retries)",
            "treadle",
            "fanout",
            {**p, "learn_rate_limits": False, "max_retries": 10},
        ),
        Job("aiohttp+orjson floor (10 retries)", "aiohttp", "fanout", p),
    ]
    if size["variants"]:
        jobs.append(Job("httpx hand loop (10 retries)", "httpx", "fanout", p))
    if size["peers"]:
        jobs += [Job(f"{peer} (peer)", peer, "fanout", p) for peer in PEERS]
    return jobs


def goodput(h: Harness, size: dict[str, Any]) -> Result:
    """Scenario 7: completion time against the limit-bound ideal, and the 429s sent."""
    n, rpm, tpm = size["goodput_n"], size["goodput_rpm"], size["goodput_tpm"]
    window = size["goodput_window"]
    latency = FANOUT_LATENCY_MS / 1000
    result = Result(
        "s7",
        f"7. Rate-limited goodput ({n:,} one-completion passes, {rpm:,} requests and "
        f"{tpm:,} tokens per {window:g} s)",
        ["wall s", "ideal s", "x ideal", "429s", "429 % of requests", "errors", "client CPU s"],
    )
    for job in _jobs(size, n, rpm, tpm, window):
        limits = (rpm, tpm, window)
        with ServerProcess("tool_loop", rounds=0, latency_ms=FANOUT_LATENCY_MS,
                           rate_limits=limits) as server:  # fmt: skip
            data = h.measure(server, [job], 1)
            stats = server.stats()
        samples = data.get(job.label)
        if not samples:
            continue
        sample = samples[0]
        admitted = max(int(stats["admitted"]), 1)
        tokens_per_request = stats["admitted_tokens"] / admitted
        # The timed passes only (the warm-up pass came first, its bucket use is negligible).
        spare_requests = n - rpm
        spare_tokens = n * tokens_per_request - tpm
        ideal = max(spare_requests / (rpm / window), spare_tokens / (tpm / window), 0.0) + latency
        _add_row(result, job.label, sample, stats, ideal)
    _worker_rows(h, size, result)
    mine = next((r for r in result.rows if r["label"] == "treadle (no configuration)"), None)
    if mine is not None:
        share = mine["429 % of requests"] / 100
        result.targets += [
            Target(
                "S7 goodput, no configuration: x ideal",
                mine["x ideal"],
                f"<= {GOAL_X_IDEAL}x",
                mine["x ideal"] <= GOAL_X_IDEAL,
            ),
            Target(
                "S7 goodput, no configuration: % answered 429",
                share * 100,
                "< 1 %",
                share < GOAL_429_SHARE and mine["errors"] == 0,
            ),
        ]
    result.notes += [
        f"time-scaled: the limits hold per {window:g} s instead of per minute "
        f"({60 / window:g}x faster); the server is a continuously refilling token bucket",
        "ideal = least time the buckets allow (starting full) plus one 50 ms latency",
    ]
    return result


PROCESS_WORKERS = 2
WORKER_ROWS = (
    ("treadle process, 2 workers uneven: split (before)", False),
    ("treadle process, 2 workers uneven: shared", True),
)


def _worker_rows(h: Harness, size: dict[str, Any], result: Result) -> None:
    """The process backend rows: split vs shared learned limits, the same uneven map."""
    long, rounds, short, rpm = size["goodput_workers"]
    window = size["goodput_window"]
    latency = FANOUT_LATENCY_MS / 1000
    requests = long * (rounds + 1) + short
    # The limit-bound time, or the long passes' own rounds one after another if longer.
    ideal = max(max(requests - rpm, 0) / (rpm / window) + latency, (rounds + 1) * latency)
    leases: dict[str, float] = {}
    for label, shared in WORKER_ROWS:
        params = {"n": short, "long": long, "workers": PROCESS_WORKERS, "concurrency": long,
                  "shared": shared}  # fmt: skip
        job = Job(label, "treadle", "fanout_process", params)
        with ServerProcess("uneven", rounds=rounds, latency_ms=FANOUT_LATENCY_MS,
                           rate_limits=(rpm, 10**9, window)) as server:  # fmt: skip
            data = h.measure(server, [job], 1)
            stats = server.stats()
        samples = data.get(label)
        if not samples:
            continue
        sample = samples[0]
        leases[label] = sample.extra.get("leases", 0) / max(stats["requests"], 1)
        _add_row(result, label, sample, stats, ideal)
    if leases:
        result.notes.append(
            f"process rows: {long} passes of {rounds + 1} requests and {short} of one, "
            f"{rpm:,} requests per {window:g} s; client CPU is the driver's only; round trips "
            "to the driver per request (leases): "
            + ", ".join(f"{label.rsplit(': ', 1)[1]} {v:.3f}" for label, v in leases.items())
        )


def _add_row(
    result: Result, label: str, sample: Sample, stats: dict[str, Any], ideal: float
) -> None:
    """One contestant's row: time against the ideal and the 429s the server sent it."""
    sent, refused = stats["requests"], stats["rate_limited"]
    result.rows.append(
        {
            "label": label,
            "wall s": sample.wall,
            "ideal s": ideal,
            "x ideal": sample.wall / ideal,
            "429s": refused,
            "429 % of requests": refused / max(sent, 1) * 100,
            "errors": sample.errors,
            "client CPU s": sample.cpu,
        }
    )
    result.series[label] = sample.wall / ideal
