"""Scenario 13 in instructions: S13's work per pass, single process against driver + worker.

`python -m benchmarks.workers_callgrind [--small 100 --large 400]` runs, under
`valgrind --tool=callgrind`, the single-process `treadle.map` and the 1-worker pool (driver and
worker each under callgrind, the fake server not) at two sizes, and prints the instructions per
pass of each process from the difference of the two sizes' whole-process totals (start-up,
imports and warm-up cancel out). Instruction counts do not move with the machine's load, where
CPU seconds on this 2-CPU machine moved by 30% between runs of the same code. What they do not
see: kernel time (pipe and socket syscalls), cache and migration costs, and valgrind runs one
thread at a time, so a thread hand-off costs more here than natively (docs/performance.md).
About 10 minutes. Never asserts anything.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _total(path: str) -> int:
    """A callgrind file's total instructions (every thread)."""
    match = re.search(r"^totals: (\d+)", Path(path).read_text(), re.M)
    return int(match.group(1)) if match else 0


def _child(mode: str, n: int, out: str, workers: int = 1) -> None:
    """(under callgrind) One run: `single`, or `pool` of `workers` workers, each under callgrind
    too; a pool's run writes how many timed passes each worker ran (`{out}.passes`)."""
    from benchmarks.server import ServerProcess
    from benchmarks.workers_loops import CONCURRENCY, _agent
    from benchmarks.workload import API_KEY

    with ServerProcess("tool_loop", rounds=3) as server:
        agent = _agent({"url": server.url})
        inputs = [f"item {i}" for i in range(n)]
        if mode == "single":
            import treadle

            treadle.map(agent, [f"warm {i}" for i in range(CONCURRENCY)], concurrency=CONCURRENCY)
            outs = treadle.map(agent, inputs, concurrency=CONCURRENCY)
            assert all(o.stop_reason == "final_answer" for o in outs)
            return
        import treadle.distributed.process as pool_module
        from treadle.distributed import AgentSpec
        from treadle.distributed.driver import drive
        from treadle.distributed.mapping import _result

        argv = pool_module.python_child_argv
        pool_module.python_child_argv = lambda *a: [  # type: ignore[assignment]
            "valgrind",
            "--tool=callgrind",
            f"--callgrind-out-file={out}.worker.%p",
            *argv(*a),
        ]
        pool_module.WORKER_START_TIMEOUT = 900  # its imports, under valgrind
        spec = AgentSpec.from_agent(agent, api_key_env="TREADLE_BENCH_KEY")

        async def main() -> None:
            pool = pool_module.ProcessPool(spec.to_json(), size=workers, api_key=API_KEY)
            await pool.start()
            try:
                options: dict[str, Any] = {"concurrency": CONCURRENCY, "max_attempts": 1,
                                           "call_timeout": None}  # fmt: skip
                # Every worker warms its whole concurrency (all its connections open) from
                # inputs of their own: a slice of the timed inputs gave a 100-pass run of 2
                # workers 100 warm-up passes, not 128, and the short worker's missing warm-up
                # and connects were charged to the 100 -> 400 difference as work a pass.
                warm = [f"warm {i}" for i in range(CONCURRENCY * workers)]
                _ = [o async for o in drive(pool, warm, **options)]
                # Each output rebuilt as it arrives, as `treadle.map` does (`remote_map_iter`).
                sessions = []
                async for o in drive(pool, inputs, **options):
                    pid = o.worker.rsplit(":", 1)[-1]
                    passes[pid] = passes.get(pid, 0) + 1
                    sessions.append(_result(o, agent))
                assert all(getattr(s, "stop_reason", None) == "final_answer" for s in sessions)
            finally:
                await pool.close()

        passes: dict[str, int] = {}
        asyncio.run(main())
        Path(f"{out}.passes").write_text(json.dumps(passes))


def _run(mode: str, n: int, tmp: str, workers: int = 1) -> dict[str, Any]:
    out = f"{tmp}/{mode}{workers if mode == 'pool' else ''}-{n}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    command = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}.driver.%p",
               sys.executable, "-m", "benchmarks.workers_callgrind",
               "--child", mode, str(n), out, str(workers)]  # fmt: skip
    subprocess.run(command, cwd=ROOT, env=env, check=True, capture_output=True)
    totals: dict[str, Any] = {"driver": sum(_total(p) for p in glob.glob(f"{out}.driver.*"))}
    files = sorted(glob.glob(f"{out}.worker.*"), key=lambda p: int(p.rsplit(".", 1)[-1]))
    totals["worker"] = sum(_total(p) for p in files)
    if mode == "pool":  # each worker's total and timed passes, in the order they were spawned
        passes = json.loads(Path(f"{out}.passes").read_text())
        totals["each"] = [(_total(p), passes.get(p.rsplit(".", 1)[-1], 0)) for p in files]
    return totals


def main() -> None:
    """Print instructions per pass: the single process, the driver and the worker."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--small", type=int, default=100)
    parser.add_argument("--large", type=int, default=400)
    parser.add_argument("--only", choices=("single", "pool"), help="run one side only")
    parser.add_argument("--keep", help="write the callgrind files here (for callgrind_annotate)")
    parser.add_argument("--workers", type=int, default=1, help="the pool's size (default 1)")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child[0], int(args.child[1]), args.child[2], int(args.child[3]))
        return
    modes = (args.only,) if args.only else ("single", "pool")
    # Byte-compile first: a worker runs `python -I`, which ignores PYTHONDONTWRITEBYTECODE and
    # writes the .pyc files its driver and every later run then read, so without this the first
    # run compiled Treadle's sources and the later ones did not (hundreds of millions of
    # instructions, a 100-pass run costing more than a 300-pass one).
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(ROOT / "src"),
                    str(ROOT / "benchmarks")], check=False, capture_output=True)  # fmt: skip
    with contextlib.ExitStack() as stack:
        tmp = args.keep or stack.enter_context(tempfile.TemporaryDirectory())
        os.makedirs(tmp, exist_ok=True)
        per: dict[str, dict[str, float]] = {}
        each: list[str] = []
        for mode in modes:
            small = _run(mode, args.small, tmp, args.workers)
            large = _run(mode, args.large, tmp, args.workers)
            per[mode] = {
                k: (large[k] - small[k]) / (args.large - args.small) for k in ("driver", "worker")
            }
            # With 2+ workers, each worker's own instructions a pass it ran: the difference of
            # its two totals over the difference of its timed passes (the n-th spawned worker of
            # each run paired; their warm-ups are the same size).
            for i, ((ins_s, n_s), (ins_l, n_l)) in enumerate(
                zip(small.get("each", []), large.get("each", []), strict=False)
            ):
                if n_l != n_s:
                    each.append(f"worker {i + 1}: {(ins_l - ins_s) / (n_l - n_s):,.0f} a pass"
                                f" ({n_s} -> {n_l} passes)")  # fmt: skip
    print(f"instructions per pass (3 tool rounds, 4 completions), {args.small} -> {args.large}:")
    single = per["single"]["driver"] if "single" in per else float("nan")
    print(f"  single process     {single:12,.0f}   1.000x")
    if "pool" not in per:
        return
    driver, worker = per["pool"]["driver"], per["pool"]["worker"]
    w = f"{args.workers} worker{'s' if args.workers > 1 else ''}"
    print(f"  {w}: driver   {driver:12,.0f}   {driver / single:.3f}x")
    print(f"  {w}: workers  {worker:12,.0f}   {worker / single:.3f}x")
    print(f"  {w}: total    {driver + worker:12,.0f}   {(driver + worker) / single:.3f}x")
    for line in each:
        print(f"    {line}")


if __name__ == "__main__":
    main()
