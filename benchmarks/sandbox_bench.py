"""Scenario 7: per-command overhead of the `isolated` sandbox against `local`, in the same run.

Runs `true` (a command that does nothing, so only the sandbox's cost is measured) one command at
a time in an open sandbox of each kind, interleaved per repetition so a busy machine weighs on
both alike. Reports wall milliseconds per command (median over repetitions), the ratio to
`local` and the milliseconds `isolated` adds. Also a no-op `write_workspace_file`-sized file
write, which both backends do on the host (it should cost the same). Never asserts on timing.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from typing import Any

from benchmarks.harness import Harness, median
from benchmarks.scenarios import Result, Target
from treadle.sandbox import Isolated, Sandbox, SandboxHandle

#: A target for the box's cost: bubblewrap's namespaces and mounts are ~10 ms of kernel work.
ISOLATED_ADDED_MS_GOAL = 25.0

_PLACEMENTS: dict[str, str | Isolated] = {
    "local": "local",
    "isolated": "isolated",
    "isolated, network on": Isolated(network=True),
}


async def _per_command_ms(sandbox: Sandbox, n: int) -> tuple[float, float]:
    """Wall ms per `true` command and per 1 KiB file write, over `n` of each."""
    await sandbox.run_command("true")  # warm: first exec of each binary, page cache
    started = time.perf_counter()
    for _ in range(n):
        result = await sandbox.run_command("true")
        if result.exit_code != 0:
            raise RuntimeError(f"`true` failed in {sandbox}: {result.stderr}")
    command_ms = (time.perf_counter() - started) * 1000 / n
    started = time.perf_counter()
    for i in range(n):
        await sandbox.write_file(f"f{i % 8}.txt", b"x" * 1024)
    return command_ms, (time.perf_counter() - started) * 1000 / n


async def _measure(labels: list[str], n: int, reps: int) -> dict[str, list[tuple[float, float]]]:
    handles = {label: SandboxHandle(_PLACEMENTS[label]) for label in labels}
    samples: dict[str, list[tuple[float, float]]] = {label: [] for label in labels}
    try:
        sandboxes = {label: handle.open() for label, handle in handles.items()}
        for rep in range(reps):
            order = labels if rep % 2 == 0 else labels[::-1]  # interleaved, alternating order
            for label in order:
                samples[label].append(await _per_command_ms(sandboxes[label], n))
    finally:
        for handle in handles.values():
            await handle.arelease()
    return samples


def sandbox_overhead(h: Harness, size: dict[str, Any]) -> Result:
    """Scenario 8: ms per command in `local` and `isolated` sandboxes, and the ratio."""
    n, reps = size["sandbox_commands"], size["sandbox_reps"]
    result = Result(
        "s8",
        f"8. Sandbox per-command overhead ({n} x `true`, one at a time)",
        ["ms per command", "x local", "added ms", "ms per file write"],
    )
    labels = list(_PLACEMENTS)
    if shutil.which("bwrap") is None:
        labels = ["local"]
        result.notes.append("bwrap is not installed (package bubblewrap): isolated not measured")
    samples = asyncio.run(_measure(labels, n, reps))
    base = median([c for c, _ in samples["local"]])
    for label in labels:
        command_ms = median([c for c, _ in samples[label]])
        write_ms = median([w for _, w in samples[label]])
        result.rows.append(
            {
                "label": label,
                "ms per command": command_ms,
                "x local": command_ms / base,
                "added ms": command_ms - base,
                "ms per file write": write_ms,
            }
        )
        result.series[label] = command_ms
    if "isolated" in samples:
        added = result.rows[1]["added ms"]
        goal = f"< {ISOLATED_ADDED_MS_GOAL:.0f}"
        passed = added < ISOLATED_ADDED_MS_GOAL
        result.targets.append(Target("S8 isolated added ms per command", added, goal, passed))
    h.log(
        "    sandbox: "
        + ", ".join(f"{r['label']} {r['ms per command']:.2f} ms" for r in result.rows)
    )
    return result
