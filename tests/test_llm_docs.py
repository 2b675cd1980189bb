"""Every ```python block in docs/providers.md runs (self-contained, against the fake server)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parent.parent / "docs" / "providers.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_docs_block_runs(code: str) -> None:
    exec(compile(code, str(DOC), "exec"), {"__name__": "__docs__"})
