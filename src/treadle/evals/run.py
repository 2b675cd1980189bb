"""`run_eval` / `arun_eval`: an agent over a dataset, k samples per item, scored and logged.

Samples go through `treadle.distributed.map_iter` (local, process or Ray backend) from one
feed: first every sample the log does not hold yet, then samples put back after an
infrastructure failure (up to `max_retries` times each). Each finished pass is scored on this
process and its record written to the log; the summary is computed from the log afterwards, so a
resumed run and an uninterrupted one summarise the same lines the same way. This module must
never write a sample twice in one run, never retry a scored failure, and never leave a sample's
workspace behind. Everything that can be checked is checked before the first request: the
arguments, every item (its workspace files can be laid out), the log's lock and every line of a
log being resumed. Scoring is bounded in time (`score_timeout`, else `sample_timeout`, else
`DEFAULT_SCORE_TIMEOUT`): a scorer past it fails its sample as a `scorer_error`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import inspect
import itertools
import json
import re
import shutil
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import anyio

from treadle.agents import Agent
from treadle.distributed import map_iter
from treadle.errors import ConfigurationError
from treadle.evals.config import config_hash, fingerprint_agent
from treadle.evals.dataset import Dataset, Item
from treadle.evals.failures import classify, classify_scorer, classify_text, retryable
from treadle.evals.guards import first_leaf, refuse_strangers
from treadle.evals.log import ANSWER_CAP, LogHeader, LogWriter, SampleRecord, read_log
from treadle.evals.scorers import Score, ScoreInput, Scorer, ScorerError, as_scorer
from treadle.evals.summary import Summary, summarize
from treadle.evals.workspaces import Workspaces
from treadle.persist.format import encode_header, encode_row, encode_trailer
from treadle.persist.producer import producer_record
from treadle.runtime import get_runtime
from treadle.session import Session

__all__ = [
    "DEFAULT_MAX_RETRIES",
    "DEFAULT_SCORE_TIMEOUT",
    "EvalProgress",
    "EvalResult",
    "arun_eval",
    "run_eval",
]

#: Times a sample runs again after an infrastructure failure before it is logged as an error.
DEFAULT_MAX_RETRIES = 3
#: Seconds one sample's scoring may take when neither `score_timeout` nor `sample_timeout` is set.
DEFAULT_SCORE_TIMEOUT = 600.0
# Seconds Ctrl-C waits for a cancelled run to close its log before giving up on it.
_CANCEL_GRACE = 30.0
_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass(frozen=True, slots=True)
class EvalProgress:
    """Where a run is, given to the `progress` callback at the start and after each sample."""

    total: int
    """Samples the run covers (dataset items times samples)."""
    done: int
    """Samples in the log, including those found there when the run resumed."""
    resumed: int
    """Samples that were already in the log when the run started."""
    passed: int
    """Samples of this run that passed."""
    errors: int
    """Samples of this run that ended in an error."""
    last: SampleRecord | None = None


@dataclass(frozen=True, slots=True)
class EvalResult:
    """A finished run: the log it wrote and the summary of that whole log."""

    log: Path
    summary: Summary
    records: list[SampleRecord]
    """Every record in the log (resumed ones included), in the order written."""


@dataclass(slots=True)
class _Attempt:
    item: Item
    sample: int
    retries: int = 0
    workspace: Path | None = None
    started: float = 0.0
    session: Session | None = None


def run_eval(agent: Any, dataset: Any, scorer: Any = "exact", **options: Any) -> EvalResult:
    """Run `agent` over `dataset`, score every sample, log each as it ends; block until done.

    Same arguments as `arun_eval`; use that from async code. Ctrl-C cancels the run, waits for
    the log to be flushed and closed (and workspaces removed), then re-raises.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise ConfigurationError("run_eval blocks; inside async code use `await arun_eval(...)`.")
    lazy = get_runtime().submit(arun_eval(agent, dataset, scorer, **options))
    try:
        return lazy.result()
    except KeyboardInterrupt:
        lazy.cancel()
        with contextlib.suppress(BaseException):  # its CancelledError: we re-raise Ctrl-C
            lazy.result(timeout=_CANCEL_GRACE)
        raise


async def arun_eval(
    agent: Any,
    dataset: Dataset | str | Iterable[Any],
    scorer: Scorer | str | Callable[..., Any] = "exact",
    *,
    log: str | Path,
    samples: int = 1,
    concurrency: int = 64,
    backend: str = "local",
    sandbox: bool = False,
    max_retries: int = DEFAULT_MAX_RETRIES,
    sample_timeout: float | None = None,
    score_timeout: float | None = None,
    transcripts: bool = True,
    progress: Callable[[EvalProgress], None] | None = None,
    **backend_options: Any,
) -> EvalResult:
    """Run `agent` over `dataset` with `samples` samples per item, scored by `scorer`.

    Args:
        agent: A treadle `Agent` (any backend) or, on the local backend, any callable
            `session -> Session` that `treadle.map` accepts.
        dataset: A `Dataset`, a JSONL path, or an iterable of `Item`s / dicts.
        scorer: A `Scorer` (`exact()`, `contains()`, `function(fn)`, `structured(Model)`,
            `judge(agent)`), `"exact"`, `"contains"`, or a function of a `ScoreInput`.
        log: The results log. Resumes it when it exists (only with the same configuration).
        samples: Samples per item (k in pass@k).
        concurrency: Passes in flight (per worker on the process and Ray backends).
        backend: `"local"`, `"process"` or `"ray"` (see `treadle.map`).
        sandbox: Give each sample its own workspace directory holding the item's files.
        max_retries: Runs again of a sample after an infrastructure failure.
        sample_timeout: Seconds one pass may take; past it the attempt is a `timeout` failure.
        score_timeout: Seconds scoring one sample may take (default: `sample_timeout`, else
            `DEFAULT_SCORE_TIMEOUT`); past it the sample is a `scorer_error`.
        transcripts: Write each output session next to the log (`<log>.transcripts/`).
        progress: Called (on the runtime's thread) at the start and after each sample.
        backend_options: Passed to the distributed backend (workers, sandbox_base, ...).
    """
    data = Dataset.coerce(dataset)
    scoring = as_scorer(scorer)
    _check(data, samples, concurrency, max_retries, sandbox, backend)
    for name, value in (("sample_timeout", sample_timeout), ("score_timeout", score_timeout)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int | float) or value <= 0
        ):
            raise ConfigurationError(f"{name} must be a positive number of seconds or None.")
    config = {
        "agent": fingerprint_agent(agent),
        "dataset": {"hash": data.hash, "items": len(data)},
        "scorer": scoring.fingerprint,
    }
    producer = producer_record(agent.provider if isinstance(agent, Agent) else None)
    header = LogHeader(
        config_hash(config), config, data.name, len(data), samples, producer=producer
    )
    log_path = Path(log)
    writer = await asyncio.to_thread(LogWriter, log_path, header)
    run = _Run(agent, scoring, writer, log_path, samples * len(data), progress)
    run.score_timeout = score_timeout or sample_timeout or DEFAULT_SCORE_TIMEOUT
    try:
        refuse_strangers(log_path, writer, {item.id for item in data}, samples)
        pending = [
            _Attempt(item, j)
            for item in data
            for j in range(samples)
            if (item.id, j) not in writer.done
        ]
        run.resumed = sum(1 for item in data for j in range(samples) if (item.id, j) in writer.done)
        run.report(None)
        if pending:
            await run.drive(
                pending,
                concurrency=concurrency,
                backend=backend,
                sandbox=sandbox,
                max_retries=max_retries,
                sample_timeout=sample_timeout,
                transcripts=transcripts,
                backend_options=backend_options,
            )
    finally:
        await asyncio.to_thread(writer.close)
    if run.progress_error is not None:
        run.progress_error.add_note(
            f"the progress callback failed; the run went on to the end: {log}"
        )
        raise run.progress_error
    read = await asyncio.to_thread(read_log, log_path)
    # a big (or crafted) log takes long to summarise: off the shared loop
    summary = await asyncio.to_thread(summarize, read)
    return EvalResult(log_path, summary, read.records)


def _check(
    data: Dataset, samples: int, concurrency: int, max_retries: int, sandbox: bool, backend: str
) -> None:
    for name, value, least in (
        ("samples", samples, 1),
        ("concurrency", concurrency, 1),
        ("max_retries", max_retries, 0),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ConfigurationError(f"{name} must be an int >= {least}, got {value!r}.")
    if not sandbox:
        with_files = next((item.id for item in data if item.files), None)
        if with_files is not None:
            raise ConfigurationError(
                f"item {with_files!r} has workspace files; pass sandbox=True (--sandbox) to give "
                "each sample a workspace."
            )
    if backend == "ray" and sandbox:
        # Workspaces are made on this machine; a Ray worker elsewhere would not see them.
        raise ConfigurationError("sandbox=True runs on the local and process backends only.")


class _Run:
    """The state of one run: counters, the retry feed and the scoring of finished passes."""

    def __init__(
        self,
        agent: Any,
        scorer: Scorer,
        writer: LogWriter,
        log_path: Path,
        total: int,
        progress: Callable[[EvalProgress], None] | None,
    ) -> None:
        self.agent = agent
        self.scorer = scorer
        self.writer = writer
        self.log_dir = log_path.parent
        self.transcript_dir = f"{log_path.name}.transcripts"
        self.total = total
        self.progress = progress
        self.resumed = 0
        self.finished = 0
        self.passed = 0
        self.errors = 0
        self.progress_error: Exception | None = None
        self.score_timeout = DEFAULT_SCORE_TIMEOUT
        self.agent_rows = getattr(getattr(agent, "agent_session", None), "rows", ())

    def report(self, last: SampleRecord | None) -> None:
        if self.progress is None:
            return
        state = EvalProgress(
            self.total, self.resumed + self.finished, self.resumed, self.passed, self.errors, last
        )
        try:
            self.progress(state)
        except Exception as err:  # a display must not stop the run: raised once it has ended
            self.progress_error = err
            self.progress = None

    async def drive(
        self,
        pending: list[_Attempt],
        *,
        concurrency: int,
        backend: str,
        sandbox: bool,
        max_retries: int,
        sample_timeout: float | None,
        transcripts: bool,
        backend_options: dict[str, Any],
    ) -> None:
        remaining = len(pending)
        again: asyncio.Queue[_Attempt | None] = asyncio.Queue()
        dispatched: dict[int, _Attempt] = {}
        counter = itertools.count()
        scoring = asyncio.Semaphore(concurrency)
        workspaces = Workspaces() if sandbox else None

        async def feed() -> AsyncIterator[Any]:
            queue = iter(pending)
            while True:
                attempt = next(queue, None)
                if attempt is None and (attempt := await again.get()) is None:
                    return
                session = Session.from_user_message(attempt.item.input)
                if workspaces is not None:
                    name = f"{_safe_name(attempt.item.id)}.s{attempt.sample}.r{attempt.retries}"
                    attempt.workspace = await asyncio.to_thread(
                        workspaces.make, name, attempt.item.files
                    )
                    session = session.to(str(attempt.workspace))
                attempt.session = session
                attempt.started = time.perf_counter()
                dispatched[next(counter)] = attempt  # map numbers inputs in pull order
                yield session if backend != "local" else attempt

        async def finish(attempt: _Attempt, result: Any) -> None:
            nonlocal remaining
            latency = time.perf_counter() - attempt.started
            try:
                async with scoring:  # judges are passes too: at most `concurrency` at once
                    record, body = await self._score(attempt, result, latency, transcripts)
            finally:
                await self._release(attempt, result)
            if retryable(record.error_kind) and attempt.retries < max_retries:
                again.put_nowait(replace(attempt, retries=attempt.retries + 1))
                return
            path = self.log_dir / record.transcript if body and record.transcript else None
            self.writer.write(record, path, body)
            self.finished += 1
            self.passed += record.passed
            self.errors += record.error_kind is not None
            self.report(record)
            remaining -= 1
            if remaining == 0:
                again.put_nowait(None)

        runner: Any = self.agent if backend != "local" else self._local_runner(sample_timeout)
        if backend != "local" and sample_timeout is not None:
            backend_options = {"pass_timeout": sample_timeout, **backend_options}
        try:
            async with anyio.create_task_group() as tg:
                # an async generator (typed as an iterator): closed here, so no pass outlives us
                stream: Any = map_iter(
                    runner, feed(), concurrency=concurrency, backend=backend, **backend_options
                )
                try:
                    async for index, result in stream:
                        tg.start_soon(finish, dispatched.pop(index), result)
                finally:
                    await stream.aclose()
        except BaseExceptionGroup as group:
            # a scorer's own exception (a BaseException it raised, say), not the task group's
            raise first_leaf(group) from None
        finally:
            if workspaces is not None:
                # shielded: a second cancel must not leave the root behind half-removed
                await asyncio.shield(asyncio.to_thread(workspaces.close))

    def _local_runner(self, timeout: float | None) -> Callable[[_Attempt], Any]:
        agent = self.agent
        run = getattr(agent, "run", None)
        call = run if run is not None and inspect.iscoroutinefunction(run) else None

        async def one(attempt: _Attempt) -> Session:
            assert attempt.session is not None
            async with asyncio.timeout(timeout):
                if call is not None:
                    out = await call(attempt.session)
                else:
                    out = agent(attempt.session)
                    if inspect.isawaitable(out):
                        out = await out
                if not isinstance(out, Session):
                    raise ConfigurationError(
                        f"the agent returned {type(out).__name__}; an eval needs a Session."
                    )
                await out.wait_ready()
            return out

        return one

    async def _score(
        self, attempt: _Attempt, result: Any, latency: float, transcripts: bool
    ) -> tuple[SampleRecord, bytes]:
        item = attempt.item
        base = SampleRecord(
            item_id=item.id,
            sample=attempt.sample,
            score=0.0,
            passed=False,
            latency_s=round(latency, 6),
            retries=attempt.retries,
            tags=item.tags,
            expected=_capped(item.expected),
        )
        if isinstance(result, BaseException):
            outcome = getattr(result, "outcome", None)
            if outcome is not None:  # a remote PassFailed
                kind = classify_text(outcome.status, outcome.error)
                text = outcome.error or outcome.status
            else:
                kind = classify(result)
                text = f"{type(result).__name__}: {result}"
            return replace(base, error_kind=kind, error=text[:2000]), b""
        out: Session = result
        answer = out.final_text
        usage = out.usage.to_dict()
        base = replace(
            base,
            answer=None if answer is None else answer[:ANSWER_CAP],
            usage=usage,
            stop_reason=out.stop_reason,
        )
        body = b""
        if transcripts:
            name = f"{_safe_name(item.id)}.s{attempt.sample}.jsonl"
            base = replace(base, transcript=f"{self.transcript_dir}/{name}")
            body = self._transcript(out, attempt)
        try:
            timer = asyncio.timeout(self.score_timeout)
            try:
                async with timer:
                    score: Score = await self.scorer.score(
                        ScoreInput(item, answer, out.output, out, attempt.workspace)
                    )
            except TimeoutError:
                if not timer.expired():
                    raise  # the scorer's own: classified as it always was
                # Not retried, unlike a pass's timeout: a scorer that hung once likely hangs again.
                raise ScorerError(
                    f"scorer {self.scorer.name!r} did not finish within {self.score_timeout:g} s"
                    " (score_timeout); make it faster or raise score_timeout."
                ) from None
        except Exception as err:
            kind, text = classify_scorer(err)  # the scorer's, not the agent's
            return replace(base, error_kind=kind, error=text), body
        return replace(
            base, score=score.value, passed=score.passed, explanation=score.explanation
        ), body

    def _transcript(self, out: Session, attempt: _Attempt) -> bytes:
        rows = out.rows
        parts = [
            encode_header(
                session_id=out.id,
                parent_ids=[],
                operator="eval",
                placement=None,
                agent_rows=self.agent_rows,
                producer=self.writer.header.producer,
            ),
            *(encode_row(row) for row in rows),
            encode_trailer(
                rows=len(rows),
                usage=out.usage,
                stop_reason=out.stop_reason,
                metadata={"eval": {"item_id": attempt.item.id, "sample": attempt.sample}},
            ),
        ]
        return b"".join(parts)

    async def _release(self, attempt: _Attempt, result: Any) -> None:
        if isinstance(result, Session):
            result.close_sandbox()
        if attempt.session is not None:
            attempt.session.close_sandbox()
            attempt.session = None
        if attempt.workspace is not None:
            workspace, attempt.workspace = attempt.workspace, None
            await asyncio.to_thread(shutil.rmtree, workspace, True)


def _capped(value: Any) -> Any:
    """The expected value for the log: as it is, or its JSON cut to `ANSWER_CAP` characters."""
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, str):
        return value if len(value) <= ANSWER_CAP else value[:ANSWER_CAP] + "…"
    text = json.dumps(value, ensure_ascii=False, default=repr)
    return value if len(text) <= ANSWER_CAP else text[:ANSWER_CAP] + "…"


def _safe_name(item_id: str) -> str:
    digest = hashlib.sha256(item_id.encode()).hexdigest()[:8]
    return f"{_SAFE.sub('_', item_id)[:60]}-{digest}"
