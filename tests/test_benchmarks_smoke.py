"""The benchmark harness runs end to end on a tiny size and reports a number for every scenario.

No timing assertions: timing lives in the benchmark results, not in tests.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # a whole benchmark run, 30-45 s: `make test-slow`
def test_tiny_benchmark_run_writes_results(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--size", "tiny", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads((tmp_path / "results.json").read_text())
    assert (tmp_path / "results.md").read_text().count("### ") >= 9
    keys = [s["key"] for s in data["scenarios"]]
    assert keys == [
        "s1", "s2", "s3", "s4", "s5", "s6a", "s6b", "s7", "s8", "s9", "s10", "s11", "s12", "s13",
        "s14",
    ]  # fmt: skip
    goodput = next(s for s in data["scenarios"] if s["key"] == "s7")
    assert {t["name"] for t in goodput["targets"]} == {
        "S7 goodput, no configuration: x ideal",
        "S7 goodput, no configuration: % answered 429",
    }
    targets = {t["name"] for s in data["scenarios"] for t in s["targets"]}
    assert "S6a streamed CPU/round vs aiohttp floor" in targets
    assert "S14 import treadle.mcp: CPU s" in targets
    assert any(name.startswith("S12 time to first token") for name in targets)
    assert sum(name.startswith("S13 ") for name in targets) == 2
    for scenario in data["scenarios"]:
        assert scenario["rows"], scenario["key"]
        for row in scenario["rows"]:
            numbers = [v for k, v in row.items() if k != "label"]
            assert numbers and all(math.isfinite(float(v)) for v in numbers), row
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (tmp_path / "results.png").stat().st_size > 0


def test_the_many_cores_scenario_runs_every_job_first_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # The harness rotates the job order by one a repetition; with `--baseline-src` S13 has 7
    # jobs, and 5 repetitions left the two "(before)" rows never first (measured 1.33x apart).
    # The worker subprocess is replaced by a recorder: the order is what is checked here.
    from benchmarks import harness, workers_bench

    ran: list[str] = []

    def record(job: harness.Job, url: str, timeout: float = 0.0) -> dict[str, object]:
        ran.append(job.label)
        return {"wall": 1.0, "cpu": 1.0, "peak_rss": 0, "worker_cpu": 1.0}

    monkeypatch.setattr(harness, "run_worker", record)
    size = {"serial_n": 1, "serial_reps": 5, "baseline_src": "/elsewhere/src"}
    workers_bench.many_cores(harness.Harness(log=lambda *_: None), size)
    labels = set(ran)
    assert len(labels) == 7 and sum(label.endswith("(before)") for label in labels) == 2
    firsts = {ran[start] for start in range(0, len(ran), len(labels))}
    assert firsts == labels
