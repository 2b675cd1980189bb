"""Every ```python block in README.md and docs/, and every script in examples/, runs.

So docs cannot drift from the code. Every block runs ALONE, in its own process inside a
temporary working directory, as a reader who copies that one block would run it: a block that
needs a name from an earlier block fails here (`NameError`). Examples run as scripts. Blocks
fenced as ```text or ```bash are not run.

Each block is its own test, so pytest-xdist spreads them over its workers, and each runs in a
child forked from one Python per worker that has already imported Treadle
(tests/preloaded_python.py): the same isolation as `python block.py` without paying the imports
~110 times.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
# A hang guard, not a timing assertion.
TIMEOUT_SECONDS = 240.0


def _blocks(page: Path) -> list[str]:
    return FENCE.findall(page.read_text())


BLOCKS = [(page, number) for page in PAGES for number in range(1, len(_blocks(page)) + 1)]


class PreloadedPython:
    """One tests/preloaded_python.py process: `run(script, cwd)` runs a script in a forked child."""

    def __init__(self, env: dict[str, str]) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("preloaded_python.py"))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )

    def _answer(self) -> dict[str, int]:
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        assert line, f"preloaded_python exited ({self._proc.wait()}); see the captured stderr"
        answer: dict[str, int] = json.loads(line)
        return answer

    def run(self, script: Path, cwd: Path, logs: Path) -> tuple[int, str, str]:
        """Run `script` as `python script` in `cwd`, its output kept in `logs`: (returncode,
        stdout, stderr)."""
        assert self._proc.stdin is not None
        out, err = logs / "stdout", logs / "stderr"
        request = {"script": str(script), "cwd": str(cwd), "stdout": str(out), "stderr": str(err)}
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        pid = self._answer()["pid"]
        # As subprocess.run(timeout=...) does: kill a script that hangs, then report it.
        guard = threading.Timer(TIMEOUT_SECONDS, os.kill, (pid, signal.SIGKILL))
        guard.start()
        try:
            returncode = self._answer()["returncode"]
        finally:
            guard.cancel()
        return returncode, out.read_text(errors="replace"), err.read_text(errors="replace")

    def close(self) -> None:
        """Stop the process (it exits when its stdin closes)."""
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.close()
        self._proc.wait(timeout=60)
        self._proc.stdout.close()


@pytest.fixture(scope="session")
def python() -> Iterator[PreloadedPython]:
    runner = PreloadedPython({**_clean_env(), "PYTHONPATH": str(ROOT / "src")})
    yield runner
    runner.close()


@pytest.mark.parametrize("page, number", BLOCKS, ids=[f"{p.name}-{n}" for p, n in BLOCKS])
def test_each_doc_block_runs_alone(
    page: Path, number: int, tmp_path: Path, python: PreloadedPython
) -> None:
    block = _blocks(page)[number - 1]
    cwd = tmp_path / f"block{number}"
    cwd.mkdir()
    script = cwd / f"{page.stem}_block{number}.py"
    script.write_text(block)
    label = f"{page.name}, python block {number} (line {_line_of(page, block)})"
    _run(python, script, cwd, label)


def _line_of(page: Path, block: str) -> int:
    return page.read_text()[: page.read_text().index(block)].count("\n") + 1


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(example: Path, tmp_path: Path, python: PreloadedPython) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    _run(python, example, cwd, example.name)


def _run(python: PreloadedPython, script: Path, cwd: Path, label: str) -> None:
    # The output files sit beside `cwd`, not in it, so a script that lists its directory sees
    # what it would see alone.
    returncode, stdout, stderr = python.run(script, cwd, cwd.parent)
    assert returncode == 0, f"{label} failed (exit {returncode}):\n{stdout}\n{stderr}"


def _clean_env() -> dict[str, str]:
    # Examples must run offline with no real key: drop any the developer has set.
    return {
        k: v
        for k, v in os.environ.items()
        if not (k.startswith("OPENAI_") or k.startswith("TREADLE_"))
    }
