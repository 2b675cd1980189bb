"""Every ```python block in README.md and docs/, and every script in examples/, runs.

So docs cannot drift from the code. Each page runs in a fresh interpreter (blocks of one page
share a namespace, in order) inside a temporary working directory; examples run as scripts.
Blocks fenced as ```text or ```bash are not run.
"""

from __future__ import annotations

import os
import re
import shutil
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
def test_doc_page_code_runs(page: Path, tmp_path: Path) -> None:
    code = "\n\n".join(_blocks(page))
    if "Isolated(" in code and shutil.which("bwrap") is None and not os.environ.get("CI"):
        pytest.skip("bwrap is not installed (package bubblewrap; `make install` installs it)")
    script = tmp_path / f"{page.stem}_blocks.py"
    script.write_text(code)
    _run(script, tmp_path, page.name)


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
