"""The `treadle` command's error paths print before the pass's imports.

A bad flag, a missing key or a `--base-url` without a scheme must print their line at once: the
runtime (asyncio, httpx, pydantic, the loop) and rich (with `--color always`, as on a terminal)
are loaded only once a pass is about to run. Checked by the modules loaded, not by a clock
(`benchmarks/cli_startup.py` measures the time).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from test_cli import _env

HEAVY = (
    "asyncio",
    "httpx",
    "aiohttp",
    "anyio",
    "pydantic",
    "pydantic_core",
    "rich",
    "mcp",
    "treadle.loop",
    "treadle.runtime",
    "treadle.sandbox",
    "treadle.cli.run",
)

ERROR_PATHS = {
    "bad flag": ["run", "--bogus", "hi"],
    "missing key": ["run", "hi", "--model", "m", "--base-url", "https://example.com/v1"],
    "no scheme": ["run", "hi", "--model", "m", "--base-url", "127.0.0.1:8765/v1"],
    "no model": ["run", "hi", "--base-url", "http://127.0.0.1:8765/v1"],
}


@pytest.mark.parametrize("words", ERROR_PATHS.values(), ids=list(ERROR_PATHS))
def test_error_paths_load_nothing_heavy(words: list[str]) -> None:
    code = (
        "import json, sys\n"
        "from treadle.cli.app import main\n"
        "try:\n"
        f"    code = main(['--color', 'always', *{words!r}])\n"
        "except SystemExit as exit:\n"
        "    code = exit.code\n"
        f"heavy = {HEAVY!r}\n"
        "loaded = sorted(m for m in sys.modules if m in heavy or m.split('.')[0] in heavy)\n"
        "print(json.dumps([code, loaded]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    exit_code, loaded = json.loads(proc.stdout)
    assert exit_code == 2, proc.stderr
    assert "treadle" in proc.stderr and "fix:" in proc.stderr
    assert loaded == [], f"{' '.join(words)} loads {loaded} before printing its error"


# A real SIGINT, sent by the process to itself at the moment `treadle.cli.app` starts to load:
# the Ctrl-C of a user who gives up during start-up, without a race on when it lands.
_CTRL_C_WHILE_APP_LOADS = """
import importlib.abc, os, signal, sys

class CtrlC(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "treadle.cli.app":
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, CtrlC())
from treadle.cli import main
sys.exit(main(["--help"]))
"""


def test_ctrl_c_while_the_command_loads_exits_130_without_a_traceback() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _CTRL_C_WHILE_APP_LOADS],
        capture_output=True, text=True, env=_env(), timeout=120,
    )  # fmt: skip
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.strip() == "treadle: interrupted."
    assert proc.stdout == ""  # interrupted before the help was printed


def test_the_entry_point_module_loads_no_command_code() -> None:
    code = (
        "import sys, treadle.cli\n"
        "print(sorted(m for m in sys.modules if m.startswith('treadle.cli.')))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
