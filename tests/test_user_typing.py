"""A user's code type-checks: `mypy --strict` over examples/ and every docs ```python block.

The package says "Typing :: Typed", so the code we tell people to copy must pass a user's strict
type check against the installed package, not only our own `src/` run. Each docs block is its own
module (as tests/test_docs_examples.py runs each block alone) and each example is one, all checked
in a temporary directory outside the repository, so mypy sees `treadle` as a user does: through
the installed package and its `py.typed`, with no project config.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))

# A user's strict configuration: no exception for `treadle`, so this test also guards that
# every top-level name the docs use is an explicit re-export.
MYPY_INI = """\
[mypy]
strict = True
warn_unused_ignores = True
"""


def _modules(target: Path) -> list[str]:
    names = []
    for page in PAGES:
        for number, block in enumerate(FENCE.findall(page.read_text()), 1):
            name = f"doc_{page.stem.replace('-', '_').lower()}_{number}.py"
            (target / name).write_text(block)
            names.append(name)
    for example in EXAMPLES:
        name = f"example_{example.name}"
        (target / name).write_text(example.read_text())
        names.append(name)
    return names


def test_docs_blocks_and_examples_pass_mypy_strict_as_user_code(tmp_path: Path) -> None:
    pytest.importorskip("mypy")
    code = tmp_path / "user_code"
    code.mkdir()
    names = _modules(code)
    assert len(names) > 40, names  # the docs and examples are really there
    (tmp_path / "mypy.ini").write_text(MYPY_INI)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            str(tmp_path / "mypy.ini"),
            "--cache-dir",
            str(tmp_path / "cache"),
            *names,
        ],
        cwd=code,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, (
        "user code does not type-check (file names: doc_<page>_<block number>.py, "
        f"example_<file>.py):\n{proc.stdout}\n{proc.stderr}"
    )


def test_map_keeps_the_session_type(tmp_path: Path) -> None:
    # `treadle.map` used to return `list[Any]`: a typo on a result went unnoticed by mypy.
    (tmp_path / "mypy.ini").write_text(MYPY_INI)
    (tmp_path / "user_map.py").write_text(
        "import treadle\n"
        "from treadle import Agent, Provider\n\n"
        'agent = Agent("a", "Answer.", provider=Provider(model="m"))\n'
        'outs = treadle.map(agent, ["x"])\n'
        "reveal_type(outs)\n"
        'mixed = treadle.map(agent, ["x"], return_exceptions=True)\n'
        "reveal_type(mixed)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", "mypy.ini", "user_map.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert 'Revealed type is "list[treadle.session.session.Session]"' in proc.stdout, proc.stdout
    assert "list[treadle.session.session.Session | BaseException]" in proc.stdout
