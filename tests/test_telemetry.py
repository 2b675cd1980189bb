"""OpenTelemetry spans and metrics of passes; each scenario runs in its own interpreter (the
global tracer provider can be set once per process, and tracing stays off for the other tests)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("opentelemetry.sdk", reason="the otel test needs opentelemetry-sdk (dev)")

from otel_export_scenarios import EXPORT_SCENARIOS
from otel_scenarios import SCENARIOS

HERE = Path(__file__).resolve().parent


@pytest.mark.parametrize("name", sorted({**SCENARIOS, **EXPORT_SCENARIOS}))
def test_scenario(name: str) -> None:
    result = subprocess.run(
        [sys.executable, str(HERE / "otel_scenarios.py"), name],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=HERE,
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), (
        result.stdout[-3000:] + result.stderr[-5000:]
    )
