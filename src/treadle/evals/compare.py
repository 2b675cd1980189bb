"""`compare`: two logs item by item (which items got better, worse, or appear in one only).

An item's result is its mean score over its samples; the comparison lists every item whose mean
changed, with both values. Works on any two logs (a warning says when their configurations'
datasets differ, since the items then may not mean the same). This module never reads files.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from treadle.evals.log import EvalLog, SampleRecord

__all__ = ["Comparison", "ItemDiff", "compare"]


@dataclass(frozen=True, slots=True)
class ItemDiff:
    """One item's mean score in each log (None when the log does not hold the item)."""

    item_id: str
    before: float | None
    after: float | None

    @property
    def delta(self) -> float | None:
        """`after - before`, or None when one side is missing."""
        if self.before is None or self.after is None:
            return None
        return self.after - self.before


@dataclass(frozen=True, slots=True)
class Comparison:
    """Per-item differences between a `before` log and an `after` log."""

    before_score: float
    after_score: float
    improved: list[ItemDiff]
    regressed: list[ItemDiff]
    unchanged: int
    only_before: list[str]
    only_after: list[str]
    same_dataset: bool


def _means(records: list[SampleRecord]) -> dict[str, float]:
    groups: dict[str, list[float]] = defaultdict(list)
    for record in records:
        groups[record.item_id].append(record.score)
    return {k: math.fsum(sorted(v)) / len(v) for k, v in groups.items()}


def compare(before: EvalLog, after: EvalLog) -> Comparison:
    """Item-by-item differences from `before` to `after` (sorted by the size of the change)."""
    a, b = _means(before.records), _means(after.records)
    shared = sorted(a.keys() & b.keys())
    diffs = [ItemDiff(i, a[i], b[i]) for i in shared if not math.isclose(a[i], b[i])]
    improved = sorted(
        (d for d in diffs if (d.delta or 0) > 0), key=lambda d: (-(d.delta or 0), d.item_id)
    )
    regressed = sorted(
        (d for d in diffs if (d.delta or 0) < 0), key=lambda d: (d.delta or 0, d.item_id)
    )

    def mean(values: dict[str, float]) -> float:
        return math.fsum(sorted(values.values())) / len(values) if values else 0.0

    data_a = before.header.config.get("dataset", {})
    data_b = after.header.config.get("dataset", {})
    return Comparison(
        before_score=mean(a),
        after_score=mean(b),
        improved=improved,
        regressed=regressed,
        unchanged=len(shared) - len(diffs),
        only_before=sorted(a.keys() - b.keys()),
        only_after=sorted(b.keys() - a.keys()),
        same_dataset=data_a.get("hash") == data_b.get("hash"),
    )
