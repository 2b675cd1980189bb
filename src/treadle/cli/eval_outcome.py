"""What `treadle eval` says after the summary when samples failed for a reason the score cannot
show: the scorer raised, or no sample was scored at all (the endpoint was unreachable, the key
rejected, ...).

A scorer that raises is reported with the file:line the log recorded, as the user's code. A run
in which every sample ended in an error exits with the code `treadle run` returns for that error
(3 auth, 4 connection or timeout, 5 another endpoint error, 2 the scorer or a configuration
error, 1 anything else), with a fix line: a script must not read such a run as a result.
Classification only; the caller prints.
"""

from __future__ import annotations

import shlex
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from treadle.cli.failures import EXIT_CODES, CliFailure
from treadle.evals import SampleRecord

__all__ = ["all_failed", "fresh_log", "scorer_warning"]

# The exit code of a run whose every sample failed with this error kind (as `treadle run`'s).
_CODES = {
    "auth": EXIT_CODES["auth"],
    "connection": EXIT_CODES["connection"],
    "provider_timeout": EXIT_CODES["connection"],
    "timeout": EXIT_CODES["connection"],
    "rate_limit": EXIT_CODES["endpoint"],
    "server_error": EXIT_CODES["endpoint"],
    "malformed_response": EXIT_CODES["endpoint"],
    "bad_request": EXIT_CODES["endpoint"],
    "context_length": EXIT_CODES["endpoint"],
    "scorer_error": EXIT_CODES["usage"],
}


def fresh_log(log: Path) -> Path:
    """A log path next to `log` that does not exist yet (`NAME-2.jsonl`, `NAME-3.jsonl`...)."""
    n = 2
    fresh = log.with_name(f"{log.stem}-{n}{log.suffix}")
    while fresh.exists():
        n += 1
        fresh = log.with_name(f"{log.stem}-{n}{log.suffix}")
    return fresh


def _rerun(words: Sequence[str], log: Path) -> str:
    # Logged samples are done, errors included: a rerun on the same log would skip them all.
    return shlex.join([*words, "--log", str(fresh_log(log))])


def scorer_warning(records: Sequence[SampleRecord], scorer: str) -> str | None:
    """One line naming the scorer's first exception (with file:line) when some samples had
    one and others were scored, else None."""
    raised = [r for r in records if r.error_kind == "scorer_error"]
    if not raised or len(raised) == len(records):
        return None
    return (
        f"scorer {scorer} raised in {len(raised)} of {len(records)} samples (scored 0): "
        f"{raised[0].error}"
    )


def all_failed(
    records: Sequence[SampleRecord], words: Sequence[str], log: Path, agent: str, scorer: str
) -> CliFailure | None:
    """The failure to exit with when no sample was scored (each ended in an error), else None.

    `words` is the command line that ran (without `--log`), for the rerun the fix names."""
    if not records or any(r.error_kind is None for r in records):
        return None
    kind, count = Counter(r.error_kind for r in records).most_common(1)[0]
    first = next(r for r in records if r.error_kind == kind)
    error = (first.error or kind or "").split("\n", 1)[0]
    cause = f"all {len(records)} samples failed, none was scored ({kind} {count}): {error}"
    rerun = _rerun(words, log)
    module = agent.partition(":")[0]
    where = f"the Provider(...) of --agent {agent} (in {module}.py) or OPENAI_BASE_URL"
    if kind == "scorer_error":
        fix = (
            f"this is an error in your scorer {scorer}, not in the agent or Treadle: fix it at "
            f"the file:line above, then rerun: {rerun}"
        )
    elif kind == "auth":
        fix = f"set OPENAI_API_KEY (or api_key= in {where}) to a key it accepts; rerun: {rerun}"
    elif kind == "timeout":
        fix = f"pass --timeout SECONDS (per sample) to wait longer; rerun: {rerun}"
    elif kind in ("connection", "provider_timeout"):
        fix = (
            f"check base_url in {where}, and that the server runs (curl BASE_URL/models) or "
            f"raise the Provider's timeout=; then rerun: {rerun}"
        )
    elif kind in _CODES:
        fix = f"check the model and endpoint in {where}, then rerun: {rerun}"
    elif (first.error or "").startswith("ConfigurationError"):
        return CliFailure(cause, f"fix the configuration in {where}, then rerun: {rerun}",
                          EXIT_CODES["usage"])  # fmt: skip
    else:
        fix = f"the agent raised on every sample: see the error above, then rerun: {rerun}"
    return CliFailure(cause, fix, _CODES.get(kind or "", EXIT_CODES["error"]))
