"""Scorers: how one sample's answer becomes a `Score` (a value in [0, 1] and passed or not).

Built in: `exact` and `contains` match against the item's expected value, `function` wraps a
Python function, `structured` validates the answer against a pydantic model (and compares it with
the expected value), and `judge` asks an `Agent` to grade. A scorer that raises fails the sample
with error kind `scorer_error`, except provider errors (a judge's endpoint failing), which are
infrastructure failures and retried like the agent's. A sync scoring function runs on a worker
thread of the scorers' own (the shared loop never waits on it; one that outlives its run's
`score_timeout` is abandoned there and counted in `treadle.runtime.thread_stats()`); the
built-in sync scorers, a few string comparisons each, run inline. This module must never change
a sample.
"""

from __future__ import annotations

import inspect
import json
import math
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pydantic

from treadle.errors import ConfigurationError, TreadleError
from treadle.evals.config import callable_fingerprint, fingerprint_agent
from treadle.evals.dataset import Item
from treadle.runtime.threads import LoopThreadLimiter
from treadle.session import Session

__all__ = [
    "SCORER_THREADS",
    "Score",
    "ScoreInput",
    "Scorer",
    "ScorerError",
    "as_scorer",
    "contains",
    "exact",
    "function",
    "judge",
    "structured",
]


class ScorerError(TreadleError):
    """A scorer could not score a sample (e.g. a judge's reply had no grade)."""


@dataclass(frozen=True, slots=True)
class Score:
    """The score of one sample."""

    value: float
    """In [0, 1]; 1 is fully correct."""
    passed: bool
    """Whether the sample counts as a success for pass@k and the binary interval."""
    explanation: str | None = None
    """Why, in a sentence (shown in the report)."""

    def __post_init__(self) -> None:
        # checked here, so a bad score is the scorer's error and never reaches the log
        if isinstance(self.value, bool) or not (
            isinstance(self.value, int | float) and math.isfinite(self.value)
        ):
            raise ScorerError(f"a score value must be a finite number, got {self.value!r}.")
        if not 0.0 <= self.value <= 1.0:
            raise ScorerError(f"a score value must be in [0, 1], got {self.value!r}.")
        if not isinstance(self.passed, bool):
            raise ScorerError(f"a score's passed must be True or False, got {self.passed!r}.")
        if self.explanation is not None and not isinstance(self.explanation, str):
            raise ScorerError(
                f"a score's explanation must be a string or None, got {self.explanation!r}."
            )


@dataclass(frozen=True, slots=True)
class ScoreInput:
    """What a scorer sees of one sample."""

    item: Item
    answer: str | None
    """The final assistant text (None if the pass ended without one)."""
    output: Any
    """The agent's validated structured output (agents with an `output_type`), else None."""
    session: Session | None
    """The output session (None when the pass ran on another process)."""
    workspace: Path | None
    """The sample's sandbox directory while scoring (None without `sandbox=True`)."""


ScoreFn = Callable[[ScoreInput], "Score | bool | float | Awaitable[Score | bool | float]"]

#: Sync scoring functions running at once on one event loop (more wait for a thread).
SCORER_THREADS = 64
_SCORER_THREADS = LoopThreadLimiter(SCORER_THREADS)


class Scorer:
    """Turns a `ScoreInput` into a `Score`; `fingerprint` enters the run's configuration hash."""

    def __init__(
        self,
        name: str,
        fn: ScoreFn,
        fingerprint: dict[str, Any],
        pass_threshold: float = 1.0,
        *,
        inline: bool = False,
    ) -> None:
        """`inline` runs a sync `fn` on the event loop: only for scorers known to be quick."""
        self.name = name
        self._fn = fn
        self._on_thread = not inline and not inspect.iscoroutinefunction(fn)
        self.fingerprint = {"scorer": name, **fingerprint, "pass_threshold": pass_threshold}
        self.pass_threshold = pass_threshold

    def __repr__(self) -> str:
        return f"<Scorer {self.name}>"

    async def score(self, sample: ScoreInput) -> Score:
        """The sample's score (runs the function, a sync one on a worker thread; awaits it if it
        is async)."""
        if self._on_thread:
            result: Any = await _SCORER_THREADS.run(self._fn, sample, abandon_on_cancel=True)
        else:
            result = self._fn(sample)
        if inspect.isawaitable(result):
            result = await result
        return self._coerce(result)

    def _coerce(self, result: Any) -> Score:
        if isinstance(result, Score):
            return result
        if isinstance(result, bool):
            return Score(1.0 if result else 0.0, result)
        if isinstance(result, int | float):
            value = float(result)
            return Score(value, value >= self.pass_threshold)
        raise ScorerError(
            f"scorer {self.name!r} returned {type(result).__name__}; return a Score, a bool or a "
            "number in [0, 1]."
        )


def _expected_texts(item: Item) -> list[str]:
    expected = item.expected
    if expected is None:
        raise ScorerError(f"item {item.id!r} has no expected value to compare with.")
    values = expected if isinstance(expected, list) else [expected]
    return [v if isinstance(v, str) else json.dumps(v) for v in values]


def _norm(text: str, ignore_case: bool) -> str:
    text = " ".join(text.split())
    return text.casefold() if ignore_case else text


def exact(*, ignore_case: bool = False) -> Scorer:
    """Passes when the answer equals the expected value (or one of a list of them), whitespace
    runs collapsed and ends stripped; `ignore_case` also folds case."""

    def check(sample: ScoreInput) -> Score:
        answer = _norm(sample.answer or "", ignore_case)
        ok = any(_norm(e, ignore_case) == answer for e in _expected_texts(sample.item))
        return Score(1.0 if ok else 0.0, ok, None if ok else "answer differs from expected")

    return Scorer("exact", check, {"ignore_case": ignore_case}, inline=True)


def contains(*, ignore_case: bool = False) -> Scorer:
    """Passes when the expected value (or any of a list of them) occurs in the answer."""

    def check(sample: ScoreInput) -> Score:
        answer = _norm(sample.answer or "", ignore_case)
        ok = any(_norm(e, ignore_case) in answer for e in _expected_texts(sample.item))
        return Score(1.0 if ok else 0.0, ok, None if ok else "expected text not in answer")

    return Scorer("contains", check, {"ignore_case": ignore_case}, inline=True)


def function(fn: ScoreFn, *, name: str | None = None, pass_threshold: float = 1.0) -> Scorer:
    """A scorer from `fn(sample) -> Score | bool | float` (sync or async). A float is the
    value; it passes at `pass_threshold` or above."""
    if not callable(fn):
        raise ConfigurationError(f"a scorer function must be callable, got {type(fn).__name__}.")
    if not 0.0 <= pass_threshold <= 1.0:
        raise ConfigurationError(f"pass_threshold must be in [0, 1], got {pass_threshold!r}.")
    label = name or str(getattr(fn, "__name__", "function"))
    return Scorer(label, fn, callable_fingerprint(fn), pass_threshold)


def structured(model: type[pydantic.BaseModel], *, compare_expected: bool = True) -> Scorer:
    """Passes when the answer validates as `model` (the agent's structured output, or the final
    text parsed as JSON) and, with `compare_expected` and an expected value, equals it field by
    field (`model_dump(mode="json")` against the expected JSON object)."""
    if not (isinstance(model, type) and issubclass(model, pydantic.BaseModel)):
        raise ConfigurationError("structured() takes a pydantic BaseModel subclass.")

    def check(sample: ScoreInput) -> Score:
        try:
            if isinstance(sample.output, model):
                value = sample.output
            elif sample.output is not None:
                value = model.model_validate(
                    sample.output.model_dump()
                    if isinstance(sample.output, pydantic.BaseModel)
                    else sample.output
                )
            else:
                value = model.model_validate_json(sample.answer or "")
        except pydantic.ValidationError as err:
            first = err.errors(include_url=False)[0]
            where = ".".join(str(p) for p in first["loc"]) or "(root)"
            return Score(0.0, False, f"invalid {model.__name__}: {where}: {first['msg']}")
        expected = sample.item.expected
        if compare_expected and expected is not None and value.model_dump(mode="json") != expected:
            return Score(0.0, False, f"valid {model.__name__}, but not the expected value")
        return Score(1.0, True)

    return Scorer(
        "structured",
        check,
        {
            "model": model.__qualname__,
            "schema": model.model_json_schema(),
            "compare": compare_expected,
        },
    )


JUDGE_TEMPLATE = """You are grading an answer to a task.

[Task]
{input}

[Expected answer]
{expected}

[Answer to grade]
{answer}

[Rubric]
{rubric}

Explain briefly, then end with one line: `GRADE: C` if the answer is correct, `GRADE: I` if not."""
"""The judge's prompt; `{input}`, `{expected}`, `{answer}` and `{rubric}` are filled in."""

_GRADE = re.compile(r"GRADE:\s*([CI])\b")
_DEFAULT_RUBRIC = "The answer is correct if it agrees with the expected answer."


def judge(agent: Any, *, rubric: str = _DEFAULT_RUBRIC, template: str = JUDGE_TEMPLATE) -> Scorer:
    """An LLM judge: `agent` (a treadle `Agent`) grades each answer.

    Without an `output_type`, the judge's reply must end with `GRADE: C` (correct) or `GRADE: I`;
    with one, its output's `passed` field (bool) decides, and an optional `score` (0-1) and
    `reason` are kept. A reply with neither raises `ScorerError` (error kind `scorer_error`).
    """
    run = getattr(agent, "run", None)
    if not callable(run):
        raise ConfigurationError(f"judge() takes a treadle Agent, got {type(agent).__name__}.")
    for key in ("{input}", "{answer}"):
        if key not in template:
            raise ConfigurationError(f"a judge template must contain {key}.")

    async def check(sample: ScoreInput) -> Score:
        expected = sample.item.expected
        prompt = template.format(
            input=sample.item.input,
            expected="(none given)" if expected is None else _text(expected),
            answer=sample.answer or "(no answer)",
            rubric=rubric,
        )
        out = await run(prompt)
        verdict = out.output
        if verdict is not None and hasattr(verdict, "passed"):
            passed = bool(verdict.passed)
            value = float(getattr(verdict, "score", 1.0 if passed else 0.0))
            return Score(value, passed, getattr(verdict, "reason", None))
        grades = _GRADE.findall(out.final_text or "")
        if not grades:
            raise ScorerError("the judge's reply has no `GRADE: C` or `GRADE: I` line.")
        passed = grades[-1] == "C"
        reply = (out.final_text or "").strip()
        return Score(1.0 if passed else 0.0, passed, reply[-500:])

    return Scorer(
        "judge",
        check,
        {"judge": fingerprint_agent(agent), "rubric": rubric, "template": template},
    )


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


_NAMED: dict[str, Callable[[], Scorer]] = {"exact": exact, "contains": contains}


def as_scorer(value: Scorer | str | ScoreFn) -> Scorer:
    """A scorer from a `Scorer`, a name (`"exact"`, `"contains"`) or a function."""
    if isinstance(value, Scorer):
        return value
    if isinstance(value, str):
        make = _NAMED.get(value)
        if make is None:
            raise ConfigurationError(
                f"unknown scorer {value!r}; use 'exact', 'contains' or a Scorer object."
            )
        return make()
    if callable(value):
        return function(value)
    raise ConfigurationError(f"a scorer is a Scorer, a name or a function, got {value!r}.")
