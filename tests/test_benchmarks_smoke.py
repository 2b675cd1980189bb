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


def test_the_streamed_round_scenario_runs_the_baselines_lazy_and_await_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The lazy facade's cost is the gap between the two rows: with `--baseline-src` both get a
    # "before" row in the same run (only the lazy one had one).
    from benchmarks import harness, scenarios

    ran: list[tuple[str, object, object]] = []

    def record(job: harness.Job, url: str, timeout: float = 0.0) -> dict[str, object]:
        ran.append((job.label, job.params.get("variant"), job.src))
        return {"wall": 1.0, "cpu": 1.0, "peak_rss": 0}

    monkeypatch.setattr(harness, "run_worker", record)
    size = {"serial_n": 1, "serial_reps": 1, "variants": True, "peers": False,
            "baseline_src": "/elsewhere/src"}  # fmt: skip
    result = scenarios.per_round(harness.Harness(log=lambda *_: None), size, stream=True)
    before = {(label, variant) for label, variant, src in ran if src == "/elsewhere/src"}
    assert before == {("treadle before (baseline)", None), ("treadle before (await arun)", "await")}
    assert {"treadle before (baseline)", "treadle before (await arun)"} <= set(result.series)


def test_the_store_scenario_compares_each_store_run_with_its_own_no_store_run() -> None:
    # A slow stretch of the machine moves neighbouring runs together: ratios taken pair by
    # pair cancel it, a ratio of two medians from different minutes does not. Here the store
    # costs 1.2x in every pair while the machine halves its speed twice.
    from benchmarks import stores_bench
    from benchmarks.scenarios import Result

    assert stores_bench.paired_ratios([1.2, 2.4, 4.8], [1.0, 2.0, 4.0]) == pytest.approx([1.2] * 3)

    def job(cpu: float) -> dict[str, float]:
        return {"wall": cpu * 1.5, "cpu": cpu, "loop_cpu": cpu, "other_cpu": 0.0}

    base = [job(v) for v in (1.0, 2.0, 4.0)]
    found = {"no store": base, "sqlite": [job(v) for v in (1.2, 2.0, 6.0)]}
    result = Result("s9", "t", [])
    stores_bench._fill(result, found, {"no store": base, "sqlite": base}, 100)
    sqlite = next(row for row in result.rows if row["label"] == "sqlite")
    assert sqlite["cpu x no store"] == pytest.approx(1.2)  # median of 1.2, 1.0, 1.5
    assert (sqlite["cpu x min"], sqlite["cpu x max"]) == pytest.approx((1.0, 1.5))
    assert [(t.name, t.value) for t in result.targets] == [
        ("S9 sqlite store: x no store (wall, paired)", pytest.approx(1.2)),
        ("S9 sqlite store: x no store (client CPU, paired)", pytest.approx(1.2)),
    ]
    assert "1.50x their CPU" in result.notes[-1]


def test_each_store_job_of_a_repetition_gets_its_own_database_file(tmp_path: Path) -> None:
    # With --baseline-src, "sqlite" and "sqlite before" ran on the same file in a repetition:
    # the second continued the first's 1,000 conversations (twice the rows to read and index).
    from benchmarks import stores_bench

    url = f"sqlite:///{tmp_path / 'bench.db'}"
    files = {
        stores_bench._fresh(url, label, 0, str(tmp_path), None)
        for label in ("sqlite", "sqlite before")
    }
    assert len(files) == 2
