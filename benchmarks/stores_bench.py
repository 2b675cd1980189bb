"""Scenario 9: what a conversation store adds to a chat workload, in the same run.

`conversations` conversations of `turns` turns each run at once against the fake server (the
`echo` script, no latency: the store's cost is not hidden behind the model's). Each turn is one
pass; without a store the application keeps each conversation's session in memory and extends
it, with a store (`sqlite`, and `postgres` on a throwaway local cluster when PostgreSQL is
installed) each turn reads the conversation from the store and commits its rows. Reports wall
seconds (median over interleaved repetitions, each in a fresh worker pinned to the client CPU)
and the ratio to no store, with the worker's CPU seconds and the PostgreSQL server's (its
processes' CPU over the run: on a loaded machine the CPU figures move less than the wall).
With `--baseline-src`, each store also runs with that checkout's treadle ("before"), in the same
run. Never asserts on timing.

`python -m benchmarks.stores_bench '<job JSON>'` is the worker: it prints one JSON line.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import ROOT, Harness, median
from benchmarks.scenarios import Result, Target
from benchmarks.server import _TICKS, CLIENT_CPU, ServerProcess, pin, proc_cpu_seconds

#: The goal: a store adds under 10% to the wall time of the same run without one.
STORE_OVERHEAD_GOAL = 1.10


async def _workload(
    url: str, store_url: str | None, conversations: int, turns: int
) -> tuple[float, float]:
    from treadle import Provider, Session, arun_session_loop
    from treadle.session import ChunkRow
    from treadle.stores import Store

    provider = Provider(model="fake-model", base_url=url, api_key="k")
    agent = Session.from_agent_prompt("Answer briefly.")
    store = Store.open(store_url) if store_url else None

    async def conversation(i: int) -> None:
        # Both runs take the same path: each turn passes only the new user message, and the
        # pass reads the conversation before it and keeps its new rows after. Without a store
        # the application keeps those rows in memory (`history`) and hands them over as the
        # session's first rows: the same rows reach the engine, the model and the output, and
        # the store run differs only by the store's read, journal and commit.
        history: list[ChunkRow] = []
        for turn in range(turns):
            user = Session.from_user_message(f"conversation {i} turn {turn}")
            if store is not None:
                await arun_session_loop(
                    user, agent, provider=provider, store=store, conversation=f"c{i}"
                )
            else:
                out = await arun_session_loop(
                    Session([*history, *user.rows]), agent, provider=provider
                )
                history = list(out.rows)

    await conversation(-1)  # warm: imports, the HTTP pool, the store's schema
    started, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(conversation(i) for i in range(conversations)))
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    if store is not None:
        await store.aclose()
    return wall, cpu


def _tree_cpu(pid: int) -> float:
    """CPU seconds of `pid`, its children that ended, and its live children (the PostgreSQL
    server: its connections are child processes)."""
    total = 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += sum(int(x) for x in fields[11:15]) / _TICKS
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(c) for c in f.read().split()]
    except OSError:
        return total
    return total + sum(proc_cpu_seconds(c) for c in children)


def _server_pid(cluster: Any) -> int | None:
    """The PostgreSQL server's pid (first line of postmaster.pid), or None."""
    if cluster is None:
        return None
    try:
        return int((Path(cluster.data) / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _run_job(job: dict[str, Any], server_url: str, src: str | None = None) -> tuple[float, float]:
    """Run one job in a fresh pinned worker: `(wall seconds, the worker's CPU seconds)`."""
    code = src or str(ROOT / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([code, str(ROOT)])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.stores_bench", json.dumps({**job, "url": server_url})],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pin(proc.pid, CLIENT_CPU)
    out, err = proc.communicate(timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"store benchmark worker failed: {err.strip()[-500:]}")
    found = json.loads(out.strip().splitlines()[-1])
    return float(found["wall"]), float(found["cpu"])


def store_overhead(h: Harness, size: dict[str, Any]) -> Result:
    """Scenario 9: wall time of conversations x turns with no store, SQLite and PostgreSQL."""
    n, turns, reps = size["store_conversations"], size["store_turns"], size["store_reps"]
    result = Result(
        "s9",
        f"9. Conversation store overhead ({n} conversations x {turns} turns, at once)",
        ["wall s", "x no store", "ms per turn", "client cpu s", "db cpu s"],
    )
    from treadle.testing.postgres import PostgresCluster, postgres_bin

    with (
        tempfile.TemporaryDirectory(prefix="treadle-bench-") as tmp,
        ServerProcess(script="echo") as server,
    ):
        cluster = PostgresCluster() if postgres_bin() is not None else None
        try:
            stores: dict[str, str | None] = {"no store": None}
            stores["sqlite"] = f"sqlite:///{Path(tmp) / 'bench.db'}"
            if cluster is not None:
                stores["postgres"] = cluster.new_database()
            else:
                result.notes.append("PostgreSQL is not installed: postgres not measured")
            # --baseline-src: the same store runs with another checkout's treadle, in this run
            before = size.get("baseline_src")
            srcs: dict[str, str | None] = {label: None for label in stores}
            if before:
                for label in [k for k in stores if stores[k] is not None]:
                    stores[f"{label} before"] = stores[label]
                    srcs[f"{label} before"] = str(before)
            samples: dict[str, list[float]] = {label: [] for label in stores}
            cpus: dict[str, list[float]] = {label: [] for label in stores}
            db_cpus: dict[str, list[float]] = {label: [] for label in stores}
            db_pid = _server_pid(cluster)
            labels = list(stores)
            for rep in range(reps):
                for label in labels[rep % len(labels) :] + labels[: rep % len(labels)]:
                    job = {"store": stores[label], "conversations": n, "turns": turns}
                    if stores[label] is not None:  # a fresh database file / keys per rep
                        job["store"] = _fresh(stores[label], rep, tmp, cluster)
                    db_before = _tree_cpu(db_pid) if db_pid else 0.0
                    wall, cpu = _run_job(job, server.url, srcs[label])
                    db = (_tree_cpu(db_pid) - db_before) if db_pid else 0.0
                    samples[label].append(wall)
                    cpus[label].append(cpu)
                    db_cpus[label].append(db)
                    h.log(f"    {label:<15} wall {wall:8.3f} s  cpu {cpu:7.3f} s  db {db:7.3f} s")
        finally:
            if cluster is not None:
                cluster.remove()
    base = median(samples["no store"])
    for label in labels:
        wall = median(samples[label])
        result.rows.append(
            {
                "label": label,
                "wall s": wall,
                "x no store": wall / base,
                "ms per turn": wall * 1000 / (n * turns),
                "client cpu s": median(cpus[label]),
                "db cpu s": median(db_cpus[label]),
            }
        )
        result.series[label] = wall
        if label != "no store" and not label.endswith(" before"):
            ratio = wall / base
            result.targets.append(
                Target(f"S9 {label} store: x no store", ratio, f"< {STORE_OVERHEAD_GOAL}",
                       ratio < STORE_OVERHEAD_GOAL)
            )  # fmt: skip
    return result


def _fresh(url: str | None, rep: int, tmp: str, cluster: Any) -> str | None:
    """An empty store for one repetition (a new SQLite file, or a new PostgreSQL database)."""
    if url is None:
        return None
    if url.startswith("sqlite"):
        return f"sqlite:///{Path(tmp) / f'bench-{rep}.db'}"
    fresh: str = cluster.new_database()
    return fresh


def main() -> None:
    """The worker: run one job, print `{"wall": seconds}`."""
    job = json.loads(sys.argv[1])
    wall, cpu = asyncio.run(_workload(job["url"], job["store"], job["conversations"], job["turns"]))
    print(json.dumps({"wall": wall, "cpu": cpu}), flush=True)


if __name__ == "__main__":
    main()
