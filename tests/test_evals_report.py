"""The HTML report: self-contained, escaped, and opened in headless Chromium without errors.

Chromium (Debian's `chromium`, installed by `.ci/run`) loads the page from a file, takes a
screenshot and logs every console message to stderr (`--enable-logging=stderr`), which is how
errors are found; a deliberately broken page checks that the detector does see them.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from treadle.evals import LogHeader, SampleRecord, read_log, render_report, write_report
from treadle.evals.log import LogWriter

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
HOSTILE = '<script>alert("x")</script><img src=x onerror=alert(1)>'


def _log(path: Path) -> Path:
    header = LogHeader(
        "f" * 64, {"agent": {"name": "solver", "provider": {"model": "m"}}}, "demo", 30, 2
    )
    writer = LogWriter(path, header)
    for i in range(30):
        for j in range(2):
            passed = (i + j) % 3 != 0
            writer.write(
                SampleRecord(
                    item_id=f"item-{i}",
                    sample=j,
                    score=1.0 if passed else 0.0,
                    passed=passed,
                    answer=HOSTILE if i == 0 else f"answer {i}",
                    usage={
                        "prompt_tokens": 10,
                        "completion_tokens": 2,
                        "total_tokens": 12,
                        "requests": 1,
                    },
                    latency_s=0.01 * (i % 7 + 1),
                    error_kind="rate_limit" if i == 5 and j == 0 else None,
                    retries=3 if i == 5 else 0,
                    tags=(["geo", "easy"] if i % 2 else ["math"]) + ([HOSTILE] if i == 1 else []),
                )
            )
    writer.close()
    return path


def test_report_is_self_contained_and_escaped(tmp_path: Path) -> None:
    page = render_report(read_log(_log(tmp_path / "log.jsonl")))
    assert page.count("<svg") == 2
    assert "<script" not in page and "<img" not in page  # model output stays text
    assert "&lt;img src=x onerror=alert(1)&gt;" in page
    assert "&lt;script&gt;" in page
    for needle in ("http://", "https://", "<link", ' src="', "url("):
        leftovers = page.replace('xmlns="http://www.w3.org/2000/svg"', "")
        assert needle not in leftovers, needle
    for text in ("pass@1", "pass@2", "Wilson", "rate_limit", "geo"):
        assert text in page


def test_a_hostile_logs_links_are_dropped_and_failures_show_why(tmp_path: Path) -> None:
    log = tmp_path / "run.jsonl"
    writer = LogWriter(log, LogHeader("f" * 64, {}, "demo", 6, 1))
    links = {
        "good": "run.jsonl.transcripts/good-1234.s0.jsonl",
        "script": "javascript:alert(document.cookie)",
        "outside": "https://example.com/x.jsonl",
        "climb": "run.jsonl.transcripts/../../etc/passwd",
        "absolute": "/etc/passwd",
        "other": "other.jsonl.transcripts/x.jsonl",
    }
    for name, link in links.items():
        writer.write(
            SampleRecord(
                name,
                0,
                0.0,
                False,
                explanation=f"why {name} failed",
                answer="Lyon",
                expected={"city": "Paris"},
                transcript=link,
            )
        )
    writer.close()
    page = render_report(read_log(log))
    assert page.count("<a href=") == 1
    assert '<a href="run.jsonl.transcripts/good-1234.s0.jsonl">' in page
    for dropped in ("javascript:", "example.com", "passwd", "other.jsonl"):
        assert dropped not in page
    assert "why script failed" in page and "&quot;city&quot;: &quot;Paris&quot;" in page


def _chromium(url: str, tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    command = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--no-first-run",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--enable-logging=stderr",
        "--v=0",
        *flags,
        url,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path)


def _console_messages(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if ":CONSOLE" in line]


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (.ci/run installs it)")
def test_report_opens_in_headless_chromium(tmp_path: Path) -> None:
    report = write_report(_log(tmp_path / "log.jsonl"))
    assert report == tmp_path / "log.html"
    shot = tmp_path / "report.png"
    proc = _chromium(report.as_uri(), tmp_path, f"--screenshot={shot}", "--window-size=1200,1600")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _console_messages(proc.stderr) == []
    data = shot.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 20_000  # a drawn page, not blank
    dom = _chromium(report.as_uri(), tmp_path, "--dump-dom")
    assert dom.returncode == 0 and _console_messages(dom.stderr) == []
    assert dom.stdout.count("<svg") == 2 and 'class="bar"' in dom.stdout
    assert "&lt;script&gt;" in dom.stdout


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (.ci/run installs it)")
def test_console_error_detector_sees_errors(tmp_path: Path) -> None:
    broken = tmp_path / "broken.html"
    broken.write_text("<!DOCTYPE html><p>x</p><script>throw new Error('report-broke')</script>")
    proc = _chromium(broken.as_uri(), tmp_path, "--dump-dom")
    assert any("report-broke" in line for line in _console_messages(proc.stderr))
