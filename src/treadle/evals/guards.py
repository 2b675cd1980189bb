"""Checks `run_eval` makes around a run: a resumed log's lines against the dataset, and the one
exception to re-raise from a task group. This module must never spend a request.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from treadle.errors import EvalLogDamagedError
from treadle.evals.log import LogWriter

__all__ = ["first_leaf", "refuse_strangers"]


def first_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The first exception in `group` (nested groups opened) that is not a cancellation."""
    leaves: list[BaseException] = []
    stack: list[BaseException] = [group]
    while stack:
        error = stack.pop(0)
        if isinstance(error, BaseExceptionGroup):
            stack[:0] = list(error.exceptions)
        else:
            leaves.append(error)
    real = [e for e in leaves if not isinstance(e, asyncio.CancelledError)]
    return (real or leaves or [group])[0]


def refuse_strangers(log: Path, writer: LogWriter, ids: set[str], samples: int) -> None:
    """`EvalLogDamagedError` naming file and line for a resumed sample of an item not in the
    dataset or numbered past `samples` (checked before any request)."""
    for (item_id, sample), line in sorted(writer.done_lines.items(), key=lambda kv: kv[1]):
        if item_id not in ids:
            why = f"item {item_id!r} is not in the dataset"
        elif not 0 <= sample < samples:
            why = f"sample {sample} of item {item_id!r} is past samples={samples}"
        else:
            continue
        raise EvalLogDamagedError(
            f"{log}:{line}: {why}; resume with the dataset and samples it was written with, "
            "or start a new log.",
            path=str(log),
            line=line,
        )
