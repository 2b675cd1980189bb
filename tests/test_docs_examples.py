"""Every ```python block in README.md and docs/, and every script in examples/, runs.

So docs cannot drift from the code. Every block runs ALONE, in a fresh interpreter inside a
temporary working directory, as a reader who copies that one block would run it: a block that
needs a name from an earlier block fails here (`NameError`). Examples run as scripts. Blocks
fenced as ```text or ```bash are not run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def _blocks(page: Path) -> list[str]:
    return FENCE.findall(page.read_text())


@pytest.mark.parametrize("page", [p for p in PAGES if _blocks(p)], ids=lambda p: p.name)
def test_each_doc_block_runs_alone(page: Path, tmp_path: Path) -> None:
    failures = []
    for number, block in enumerate(_blocks(page), 1):
        cwd = tmp_path / f"block{number}"
        cwd.mkdir()
        script = cwd / f"{page.stem}_block{number}.py"
        script.write_text(block)
        label = f"{page.name}, python block {number} (line {_line_of(page, block)})"
        try:
            _run(script, cwd, label)
        except AssertionError as err:
            failures.append(str(err))
    assert not failures, "\n\n".join(failures)


def _line_of(page: Path, block: str) -> int:
    return page.read_text()[: page.read_text().index(block)].count("\n") + 1


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(example: Path, tmp_path: Path) -> None:
    _run(example, tmp_path, example.name)


def _run(script: Path, cwd: Path, label: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=240,
        env={**_clean_env(), "PYTHONPATH": str(ROOT / "src")},
    )
    assert proc.returncode == 0, f"{label} failed:\n{proc.stdout}\n{proc.stderr}"


def _clean_env() -> dict[str, str]:
    # Examples must run offline with no real key: drop any the developer has set.
    return {
        k: v
        for k, v in os.environ.items()
        if not (k.startswith("OPENAI_") or k.startswith("TREADLE_"))
    }
