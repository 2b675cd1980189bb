"""Scenario 14: import targets, each in fresh interpreters with a bytecode cache (median).

The README's first import (`from treadle import Provider, Session, run_session_loop`, at most
0.2 s) and `import treadle.mcp` (under 0.5 s), plus `from treadle.mcp import MCPServer` (the SDK
loading, for scale). Each statement runs once untimed first, so the `.pyc` files exist. Every run
prints the import's CPU and wall seconds: the targets use CPU time, which other processes on a
loaded machine do not inflate (the wall column says what a user waits on an idle one only when
the machine is idle). Never asserts on timing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

from benchmarks.harness import ROOT, Harness, median
from benchmarks.scenarios import Result, Target
from benchmarks.server import CLIENT_CPU, pin

README = "from treadle import Provider, Session, run_session_loop"
MCP = "import treadle.mcp"
GOALS = {README: 0.2, MCP: 0.5}
"""Statement -> seconds it must stay under (median over fresh interpreters)."""
STATEMENTS = (README, MCP, "from treadle.mcp import MCPServer  (loads the SDK)")
_TIMED = (
    "import time; c = time.process_time(); w = time.perf_counter(); {stmt}; "
    "print(time.process_time() - c, time.perf_counter() - w)"
)


def _one(stmt: str) -> tuple[float, float]:
    """`(cpu, wall)` seconds of `stmt` in a fresh interpreter pinned to the client CPU."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    code = _TIMED.format(stmt=stmt.split("  (")[0])
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True
    )
    pin(proc.pid, CLIENT_CPU)
    out, _ = proc.communicate(timeout=120)
    cpu, wall = out.split()
    return float(cpu), float(wall)


def imports(h: Harness, size: dict[str, Any]) -> Result:
    """Run scenario 14: 11 fresh interpreters per statement in `make bench` (interleaved)."""
    runs = 11 if size["peers"] else size["import_runs"]
    for stmt in STATEMENTS:
        _one(stmt)  # writes the bytecode cache; not counted
    times: dict[str, list[tuple[float, float]]] = {stmt: [] for stmt in STATEMENTS}
    for _ in range(runs):
        for stmt in STATEMENTS:
            times[stmt].append(_one(stmt))
    result = Result(
        "s14",
        f"14. Import targets (fresh interpreters, bytecode cached, median of {runs})",
        ["CPU ms", "wall ms"],
    )
    for stmt, values in times.items():
        cpu = median([c for c, _ in values])
        wall = median([w for _, w in values])
        result.rows.append({"label": stmt, "CPU ms": cpu * 1000, "wall ms": wall * 1000})
        result.series[stmt] = cpu * 1000
        goal = GOALS.get(stmt)
        if goal is not None:
            result.targets.append(Target(f"S14 {stmt}: CPU s", cpu, f"< {goal}", cpu < goal))
    h.log("    " + ", ".join(f"{r['label']}: {r['CPU ms']:.0f} ms CPU" for r in result.rows))
    return result
