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


def test_passes_never_load_aiohttp() -> None:
    # Completions go over Treadle's own HTTP/1.1 lane: a program that only runs passes, whole or
    # streamed, never pays aiohttp's import (about 170 ms).
    code = (
        "import sys\n"
        "from treadle import Session, Provider, run_session_loop\n"
        "from treadle.testing import FakeOpenAIServer\n"
        "with FakeOpenAIServer('echo') as server:\n"
        "    for stream in (False, True):\n"
        "        provider = Provider(model='m', base_url=server.base_url, api_key='k',"
        " stream=stream)\n"
        "        out = run_session_loop(Session.from_user_message('hi'),"
        " Session.from_agent_prompt('sys'), agent_provider=provider)\n"
        "        assert out.stop_reason == 'final_answer', out.stop_reason\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'aiohttp'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
