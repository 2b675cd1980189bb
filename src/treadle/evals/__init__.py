"""Evaluation runs: an agent over a dataset, k samples per item, scored, logged, resumable.

`run_eval(agent, dataset, scorer, log=...)` runs every sample through `treadle.map` (local,
process or Ray backend), scores it, appends one fsynced line per sample to the log, and resumes
a log it finds (refusing one written by another configuration). `summarize` / `compare` read
logs back; `write_report` renders one as a self-contained HTML page. A log has one writer (a
lock beside it), every line is checked on reading, and scoring is bounded and off the shared
loop. See docs/evals.md.
This package sits above `distributed`: it imports Treadle's lower layers, never the CLI.
"""

from treadle.evals.compare import Comparison, ItemDiff, compare
from treadle.evals.dataset import Dataset, Item
from treadle.evals.failures import ERROR_KINDS
from treadle.evals.log import EvalLog, LogHeader, SampleRecord, read_log
from treadle.evals.report import render_report, write_report
from treadle.evals.run import (
    DEFAULT_MAX_RETRIES,
    DEFAULT_SCORE_TIMEOUT,
    EvalProgress,
    EvalResult,
    arun_eval,
    run_eval,
)
from treadle.evals.scorers import (
    Score,
    ScoreInput,
    Scorer,
    ScorerError,
    contains,
    exact,
    function,
    judge,
    structured,
)
from treadle.evals.stats import Interval, pass_at_k, t_interval, wilson_interval
from treadle.evals.summary import Summary, TagSummary, summarize

__all__ = [
    "DEFAULT_MAX_RETRIES",
    "DEFAULT_SCORE_TIMEOUT",
    "ERROR_KINDS",
    "Comparison",
    "Dataset",
    "EvalLog",
    "EvalProgress",
    "EvalResult",
    "Interval",
    "Item",
    "ItemDiff",
    "LogHeader",
    "SampleRecord",
    "Score",
    "ScoreInput",
    "Scorer",
    "ScorerError",
    "Summary",
    "TagSummary",
    "arun_eval",
    "compare",
    "contains",
    "exact",
    "function",
    "judge",
    "pass_at_k",
    "read_log",
    "render_report",
    "run_eval",
    "structured",
    "summarize",
    "t_interval",
    "wilson_interval",
    "write_report",
]
