"""`Summary` of a log: score with its confidence interval, pass@k, latency, tokens, errors, tags.

The interval is Wilson's when scores are binary (0 or 1), and a t-interval clipped to [0, 1]
otherwise; either way over per-item mean scores (samples of one item are not independent draws,
so the item is the unit), so it never leaves [0, 1]. A sample that ended in an error counts as
score 0 and not passed: dropping it would flatter the agent. Every sum is `math.fsum` over sorted
values, so the summary does not depend on the order samples finished in (a resumed log and an
uninterrupted one summarise equal). This module must never read files: it takes an `EvalLog` or
records.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from treadle.evals.log import EvalLog, SampleRecord
from treadle.evals.stats import Interval, pass_at_k, percentile, t_interval, wilson_interval

__all__ = ["Summary", "TagSummary", "pass_at_k_values", "summarize"]


@dataclass(frozen=True, slots=True)
class TagSummary:
    """Score of the items carrying one tag."""

    samples: int
    mean_score: float
    pass_rate: float


@dataclass(frozen=True, slots=True)
class Summary:
    """What a run scored and what it cost."""

    samples: int
    items: int
    samples_per_item: int
    """The fewest samples any item has (pass@k is given up to this k)."""
    score: Interval
    pass_rate: float
    pass_at_k: Mapping[int, float]
    latency: Mapping[str, float]
    """Seconds: p50, p95, p99, mean, max."""
    tokens: Mapping[str, int]
    """Sums over samples: prompt_tokens, completion_tokens, total_tokens, requests."""
    errors: Mapping[str, int]
    """Samples per error kind."""
    retries: int
    by_tag: Mapping[str, TagSummary] = field(default_factory=dict)
    config_hash: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The summary as a JSON-able dict (pass@k keys as strings)."""
        data = asdict(self)
        data["pass_at_k"] = {str(k): v for k, v in self.pass_at_k.items()}
        return data

    def outcome(self) -> dict[str, Any]:
        """The summary without latency, which is the only part that varies between two runs
        of the same configuration against a deterministic model."""
        data = self.to_json()
        del data["latency"]
        return data


def pass_at_k_values(per_item: Sequence[tuple[int, int]], ks: Sequence[int]) -> dict[int, float]:
    """Mean unbiased pass@k over items given `(samples, passed)` per item, for each k."""
    return {
        k: math.fsum(sorted(pass_at_k(n, c, k) for n, c in per_item)) / len(per_item) for k in ks
    }


def _ks(n: int) -> list[int]:
    ks = [1]
    while ks[-1] * 2 <= n:
        ks.append(ks[-1] * 2)
    if ks[-1] != n:
        ks.append(n)
    return ks


def summarize(log: EvalLog | Sequence[SampleRecord]) -> Summary:
    """The summary of a log (or of records), at a 95% confidence level."""
    records = log.records if isinstance(log, EvalLog) else list(log)
    config = log.header.config_hash if isinstance(log, EvalLog) else None
    if not records:
        raise ValueError("the log holds no samples yet; nothing to summarise.")
    by_item: dict[str, list[SampleRecord]] = defaultdict(list)
    for record in records:
        by_item[record.item_id].append(record)
    per_item = [(len(rs), sum(r.passed for r in rs)) for rs in by_item.values()]
    k_max = min(n for n, _ in per_item)
    values = [r.score for r in records]
    means = sorted(math.fsum(sorted(r.score for r in rs)) / len(rs) for rs in by_item.values())
    if all(v in (0.0, 1.0) for v in values):
        interval = wilson_interval(math.fsum(means), len(means))
    else:
        interval = t_interval(means, bounds=(0.0, 1.0))
    latencies = [r.latency_s for r in records]
    tokens: Counter[str] = Counter()
    for record in records:
        tokens.update({k: int(v) for k, v in record.usage.items()})
    return Summary(
        samples=len(records),
        items=len(by_item),
        samples_per_item=k_max,
        score=interval,
        pass_rate=sum(r.passed for r in records) / len(records),
        pass_at_k=pass_at_k_values(per_item, _ks(k_max)),
        latency={
            "p50": percentile(latencies, 50),
            "p95": percentile(latencies, 95),
            "p99": percentile(latencies, 99),
            "mean": math.fsum(sorted(latencies)) / len(latencies),
            "max": max(latencies),
        },
        tokens={
            k: tokens[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens", "requests")
        },
        errors=dict(sorted(Counter(r.error_kind for r in records if r.error_kind).items())),
        retries=sum(r.retries for r in records),
        by_tag=_by_tag(records),
        config_hash=config,
    )


def _by_tag(records: Sequence[SampleRecord]) -> dict[str, TagSummary]:
    groups: dict[str, list[SampleRecord]] = defaultdict(list)
    for record in records:
        for tag in record.tags or ("(untagged)",):
            groups[tag].append(record)
    return {
        tag: TagSummary(
            len(rs),
            math.fsum(sorted(r.score for r in rs)) / len(rs),
            sum(r.passed for r in rs) / len(rs),
        )
        for tag, rs in sorted(groups.items())
    }
