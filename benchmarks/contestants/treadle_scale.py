"""Treadle at scale (scenario 11): a hundred thousand lazy passes, and what a pass costs in memory.

`scale` submits `n` passes at once through the lazy facade, times the submission on its own (the
caller gets every facade back before any is read), then reads them all. `memory` weighs passes:
against a slow server (every reply takes seconds) it submits `running` passes (each holds a
connection, its request in flight), then `pending` more (they wait for a connection), and reads
the resident set after each step settles.
"""

from __future__ import annotations

import time
from typing import Any

from benchmarks.contestants.treadle_loop import _ok, _provider, noop
from benchmarks.worker import Meter
from benchmarks.workload import SYSTEM_PROMPT, USER_PROMPT
from treadle import Session, run_session_loop


def rss_bytes() -> int:
    """This process's resident set now (bytes), from /proc (0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except OSError:
        return 0
    import resource

    return pages * resource.getpagesize()


def scale(job: dict[str, Any], meter: Meter) -> dict[str, Any]:
    """`n` concurrent passes: submission timed on its own, then every pass read."""
    provider, agent, n = _provider(job), Session.from_agent_prompt(SYSTEM_PROMPT), job["n"]
    user = Session.from_user_message(USER_PROMPT)
    _ok(run_session_loop(user, agent, agent_provider=provider, tools=[noop]))  # warm the pool
    rss0 = rss_bytes()
    meter.start()
    outs = [run_session_loop(user, agent, agent_provider=provider, tools=[noop]) for _ in range(n)]
    submitted = time.perf_counter() - meter._wall0
    rss_submitted = rss_bytes()
    errors = sum(not _ok(out) for out in outs)
    meter.stop()
    return {"errors": errors, "submit": submitted, "rss0": rss0, "rss_submitted": rss_submitted}


def _settle(seconds: float) -> int:
    # The runtime thread starts what was submitted; the resident set is read once it stops
    # growing (or after `seconds`).
    last, deadline = rss_bytes(), time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.25)
        now = rss_bytes()
        if now == last:
            break
        last = now
    return last


def memory(job: dict[str, Any], meter: Meter) -> dict[str, Any]:
    """Resident bytes per running and per pending pass (replies held back by the server)."""
    from treadle.runtime.background import stats

    provider, agent = _provider(job), Session.from_agent_prompt(SYSTEM_PROMPT)
    user = Session.from_user_message(USER_PROMPT)
    # One pass first: the runtime thread, its imports and the connection pool are not weighed.
    outs = [run_session_loop(user, agent, agent_provider=provider, tools=[noop])]
    meter.start()
    base = _settle(1.0)
    outs += [
        run_session_loop(user, agent, agent_provider=provider, tools=[noop])
        for _ in range(job["running"])
    ]
    running = _settle(job["settle"])
    outs += [
        run_session_loop(user, agent, agent_provider=provider, tools=[noop])
        for _ in range(job["pending"])
    ]
    pending = _settle(job["settle"])
    in_flight = stats()["pending"]
    meter.stop()
    for out in outs:
        out.cancel()
    return {
        "errors": 0,
        "per_running": (running - base) / job["running"],
        "per_pending": (pending - running) / job["pending"],
        "in_flight": in_flight,
    }
