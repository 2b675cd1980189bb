"""What the README's first import loads: the HTTP stack and the sandbox wait for first use.

`from treadle import Session, Provider, run_session_loop, tool` sits at the top of every program;
httpx (about 60 ms), aiohttp, the sandbox layer and OpenTelemetry must not load with it (the
benchmark's S5 measures the time; this keeps the cause from coming back).
"""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("httpx", "aiohttp", "treadle.sandbox", "opentelemetry", "mcp", "rich")


def test_the_first_import_loads_nothing_heavy() -> None:
    code = (
        "import sys\n"
        "from treadle import Session, Provider, run_session_loop, tool\n"
        f"heavy = {HEAVY!r}\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy or m in heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
