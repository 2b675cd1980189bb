"""`treadle eval`: run an agent over a dataset with a live progress bar, then print the summary;
`treadle eval report LOG` writes the HTML report; `treadle eval compare A B` diffs two logs.

The agent (and a custom scorer) are named as `module:attribute`, imported with the current
directory on the path, as `python -m` would. This module only parses, prints and delegates to
`treadle.evals`; it never scores or writes a log itself.
"""

from __future__ import annotations

import inspect
import json
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from treadle.cli.console import Console
from treadle.cli.describe import counted, producer_line
from treadle.cli.eval_outcome import all_failed, fresh_log, scorer_warning
from treadle.cli.failures import EXIT_CODES, CliFailure
from treadle.cli.terminal_text import visible
from treadle.cli.user_code import call_user_code, load_object
from treadle.errors import EvalConfigMismatch
from treadle.evals import (
    EvalProgress,
    SampleRecord,
    Summary,
    compare,
    read_log,
    run_eval,
    summarize,
    write_report,
)
from treadle.evals.log import config_changes

__all__ = ["EvalOptions", "compare_command", "eval_command", "load_object", "report_command"]

#: Where `treadle eval` writes its log when `--log` is not given (one file per dataset name).
DEFAULT_LOG_DIR = Path(".treadle") / "evals"
#: Failing samples listed under the summary (the report lists them all).
SHOWN_FAILURES = 10
_CELL_CHARS = 60


@dataclass(frozen=True, slots=True)
class EvalOptions:
    """The flags of `treadle eval DATASET`."""

    dataset: Path
    agent: str
    scorer: str = "exact"
    samples: int = 1
    concurrency: int = 64
    backend: str = "local"
    log: Path | None = None
    sandbox: bool = False
    retries: int = 3
    timeout: float | None = None
    workers: int | None = None


def _agent(spec: str) -> Any:
    obj = load_object(spec, "agent")
    if hasattr(obj, "instructions") and hasattr(obj, "run"):
        return obj
    if callable(obj):
        try:
            params = inspect.signature(obj).parameters.values()
        except (TypeError, ValueError):
            return obj
        if not any(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                   for p in params):  # fmt: skip
            return call_user_code(obj, f"agent factory {spec!r}")  # build the agent
        return obj
    raise CliFailure(
        f"agent {spec!r} is a {type(obj).__name__}, not an Agent",
        "point --agent at a treadle Agent, or a function that returns one.",
        EXIT_CODES["usage"],
    )


def _scorer(spec: str) -> Any:
    if spec in ("exact", "contains"):
        return spec
    return load_object(spec, "scorer")


def summary_rows(summary: Summary) -> list[list[str]]:
    """The summary as `[metric, value]` rows."""
    s = summary.score
    method = "Wilson over items" if s.method == "wilson" else "t over item means"
    rows = [
        ["samples", f"{summary.samples} ({summary.items} items)"],
        ["score", f"{s.estimate:.4f}  {s.level:.0%} CI [{s.low:.4f}, {s.high:.4f}] ({method})"],
        ["pass rate", f"{summary.pass_rate:.2%}"],
    ]
    rows += [[f"pass@{k}", f"{v:.4f}"] for k, v in summary.pass_at_k.items()]
    lat = summary.latency
    rows.append(
        ["latency", f"p50 {lat['p50']:.3f} s  p95 {lat['p95']:.3f} s  p99 {lat['p99']:.3f} s"]
    )
    tokens = summary.tokens
    rows.append(
        [
            "tokens",
            f"{tokens['total_tokens']:,} ({tokens['prompt_tokens']:,} prompt, "
            f"{tokens['completion_tokens']:,} completion, "
            f"{counted(tokens['requests'], 'request', grouped=True)})",
        ]
    )
    errors = ", ".join(f"{k} {v}" for k, v in summary.errors.items()) or "none"
    rows.append(["errors", f"{errors}; {counted(summary.retries, 'retry')}"])
    return rows


def _cell(value: Any, styled: bool) -> str:
    """Log text made safe for a terminal: control and format characters (escapes, bidi
    overrides) shown visibly as `show` shows them (never dropped: what the model sent is what
    the reader sees), whitespace runs collapsed, cut short, rich markup escaped."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    text = " ".join(visible(text).split())  # after `visible`: only real whitespace is left
    text = text if len(text) <= _CELL_CHARS else text[: _CELL_CHARS - 1] + "…"
    if styled:
        from rich.markup import escape

        text = escape(text)
    return text


def failure_rows(records: Sequence[SampleRecord], styled: bool = False) -> list[list[str]]:
    """The first failing samples as `[item, answer, expected, why]` rows (terminal-safe)."""
    failed = sorted((r for r in records if not r.passed), key=lambda r: (r.item_id, r.sample))
    return [
        [
            _cell(f"{r.item_id}#{r.sample}", styled),
            _cell(r.answer or "", styled),
            _cell("" if r.expected is None else r.expected, styled),
            _cell(r.explanation or r.error or r.error_kind or "", styled),
        ]
        for r in failed[:SHOWN_FAILURES]
    ]


def eval_command(opts: EvalOptions, console: Console) -> int:
    """Run the evaluation, showing progress; print the summary table."""
    if not opts.dataset.is_file():
        raise CliFailure(
            f"no dataset file at {opts.dataset}",
            "pass a JSONL file with one {id, input, expected} object per line.",
            EXIT_CODES["usage"],
        )
    agent = _agent(opts.agent)
    scorer = _scorer(opts.scorer)
    log = opts.log or DEFAULT_LOG_DIR / f"{opts.dataset.stem}.jsonl"
    backend_options: dict[str, Any] = {}
    if opts.workers is not None:
        backend_options["workers"] = opts.workers
    bar: Any = None
    shown = 0

    def progress(state: EvalProgress) -> None:
        nonlocal bar, shown
        if bar is None:
            if state.resumed:
                console.line(
                    f"resuming {log}: {state.resumed} of {state.total} samples done", "dim"
                )
            bar = console.progress(state.total, "eval").__enter__()
        ran = state.done - state.resumed
        if ran:
            label = f"eval  pass {state.passed / ran:.0%}"
            bar.describe(label + (f"  errors {state.errors}" if state.errors else ""))
        bar.advance(state.done - shown)
        shown = state.done

    try:
        result = _run_eval(
            opts,
            agent,
            opts.dataset,
            scorer,
            log=log,
            samples=opts.samples,
            concurrency=opts.concurrency,
            backend=opts.backend,
            sandbox=opts.sandbox,
            max_retries=opts.retries,
            sample_timeout=opts.timeout,
            progress=progress,
            **backend_options,
        )
    finally:
        if bar is not None:
            bar.__exit__(None, None, None)
    console.table(["metric", "value"], summary_rows(result.summary))
    failures = failure_rows(result.records, console.styled)
    if failures:
        failed = sum(not r.passed for r in result.records)
        console.line(f"failed samples ({min(failed, SHOWN_FAILURES)} of {failed}):", "summary")
        console.table(["sample", "answer", "expected", "why"], failures)
    console.line(f"log: {result.log}  (treadle eval report {result.log})", "dim")
    warning = scorer_warning(result.records, opts.scorer)
    if warning:
        console.line(warning, "warn")
    unscored = all_failed(result.records, _words(opts), result.log, opts.agent, opts.scorer)
    if unscored is not None:
        raise unscored  # no sample was scored: a script must not read this run as a result
    return EXIT_CODES["ok"]


def _run_eval(opts: EvalOptions, *args: Any, log: Path, **kwargs: Any) -> Any:
    """`run_eval`, with a refused resume explained as the command lines that fix it."""
    try:
        return run_eval(*args, log=log, **kwargs)
    except EvalConfigMismatch as err:
        raise CliFailure(str(err), _mismatch_fix(opts, log, err), EXIT_CODES["usage"]) from None


def _words(opts: EvalOptions) -> list[str]:
    """The command line of this run, without `--log` (for a fix line's rerun)."""
    words = ["treadle", "eval", str(opts.dataset), "--agent", opts.agent]
    if opts.scorer != "exact":
        words += ["--scorer", opts.scorer]
    if opts.samples != 1:
        words += ["--samples", str(opts.samples)]
    return words


def _mismatch_fix(opts: EvalOptions, log: Path, err: EvalConfigMismatch) -> str:
    """Two ways out: this configuration into a new log, or the log's own configuration back."""
    fix = f"write a new log: {shlex.join([*_words(opts), '--log', str(fresh_log(log))])}"
    for what, before, _ in err.changes:
        if what in ("scorer", "scorer.callable") and isinstance(before, str):
            old = before if what == "scorer.callable" or before in ("exact", "contains") else None
            if old is not None:
                fix += f"; or resume {log} with the scorer it was written with: --scorer {old}"
                break
    else:
        what = ", ".join(w for w, _, _ in err.changes[:3]) or "the configuration"
        fix += f"; or resume {log} with the {what} it was written with"
    return fix + "."


def report_command(log: Path, out: Path | None, console: Console) -> int:
    """Write the HTML report of a log."""
    path = write_report(log, out)
    console.line(f"report: {path}", "ok")
    return EXIT_CODES["ok"]


def compare_command(before: Path, after: Path, console: Console) -> int:
    """Print the per-item differences between two logs."""
    a, b = read_log(before), read_log(after)
    diff = compare(a, b)
    if not diff.same_dataset:
        console.line("warning: the two logs ran different datasets", "warn")
    for label, log in (("before", a), ("after", b)):
        produced = producer_line(log.header.producer)
        console.line(f"{label}: {produced or 'no model recorded (an older log)'}", "dim")
    # A changed scorer (or sample count, ...) can explain a score change by itself: say so.
    for what, old, new in config_changes(a.header.config, b.header.config):
        console.line(f"configuration changed: {what}: {_cell(old, console.styled)} -> "
                     f"{_cell(new, console.styled)}", "warn")  # fmt: skip
    console.line(
        f"score {diff.before_score:.4f} -> {diff.after_score:.4f}; {len(diff.improved)} items "
        f"improved, {len(diff.regressed)} regressed, {diff.unchanged} unchanged",
        "summary",
    )
    rows = [
        [d.item_id, f"{d.before:.3f}", f"{d.after:.3f}", f"{d.delta:+.3f}"]
        for d in [*diff.regressed, *diff.improved]
        if d.before is not None and d.after is not None and d.delta is not None
    ]
    if rows:
        console.table(["item", "before", "after", "change"], rows)
    for label, ids in (("only in before", diff.only_before), ("only in after", diff.only_after)):
        if ids:
            console.line(f"{label}: {', '.join(ids[:20])}" + (" ..." if len(ids) > 20 else ""))
    console.table(["metric", "before", "after"], _side_by_side(summarize(a), summarize(b)))
    return EXIT_CODES["ok"]


def _side_by_side(a: Summary, b: Summary) -> list[list[str]]:
    left, right = dict(summary_rows(a)), dict(summary_rows(b))
    return [[k, left.get(k, ""), right.get(k, "")] for k in dict.fromkeys([*left, *right])]
