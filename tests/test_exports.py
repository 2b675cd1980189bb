"""The public face: every exported name imports, is what the lazy map says, and type-checks.

`treadle` and `treadle.testing` load their names lazily from one map each; these tests keep the
map, `__all__`, the `TYPE_CHECKING` re-exports type checkers read, and a user's `mypy --strict`
in agreement.
"""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

import treadle
import treadle.testing

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "treadle"


def _type_checking_imports(path: Path) -> dict[str, tuple[str, str]]:
    """`name -> (module, imported name or alias)` from the module's `if TYPE_CHECKING:` block."""
    found: dict[str, tuple[str, str]] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for stmt in node.body:
                assert isinstance(stmt, ast.ImportFrom) and stmt.module is not None
                for alias in stmt.names:
                    found[alias.asname or alias.name] = (stmt.module, alias.asname or "")
    return found


def test_all_is_exactly_the_lazy_map() -> None:
    assert treadle.__all__ == ["__version__", *treadle._EXPORTS]
    assert len(set(treadle.__all__)) == len(treadle.__all__)
    assert sorted(dir(treadle)) == sorted(treadle.__all__)


@pytest.mark.parametrize("name", sorted(treadle._EXPORTS))
def test_every_name_imports_from_its_home(name: str) -> None:
    home = importlib.import_module(treadle._EXPORTS[name])
    assert getattr(treadle, name) is getattr(home, name)
    namespace: dict[str, object] = {}
    exec(f"from treadle import {name}", namespace)
    assert namespace[name] is getattr(home, name)


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        treadle.Nope  # noqa: B018
    with pytest.raises(ImportError):
        exec("from treadle import Nope", {})


def test_type_checkers_see_the_same_names_as_explicit_re_exports() -> None:
    seen = _type_checking_imports(SRC / "__init__.py")
    assert {name: module for name, (module, _) in seen.items()} == treadle._EXPORTS
    # `from m import X as X`: an explicit re-export, which `mypy --strict` lets users import.
    assert all(alias == name for name, (_, alias) in seen.items())


def test_testing_names_import_from_their_homes() -> None:
    homes = treadle.testing._HOMES
    assert sorted(treadle.testing.__all__) == sorted(homes)
    for name in treadle.testing.__all__:
        home = importlib.import_module(f"treadle.testing.{homes[name]}")
        assert getattr(treadle.testing, name) is getattr(home, name)
    seen = _type_checking_imports(SRC / "testing" / "__init__.py")
    assert {name: module for name, (module, _) in seen.items()} == {
        name: f"treadle.testing.{home}" for name, home in homes.items()
    }


def _readme_block(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split(f"## {title}\n", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None, f"README section {title!r} has no python block"
    return match.group(1)


def test_readme_program_passes_mypy_strict(
    tmp_path: Path, user_mypy: Callable[..., subprocess.CompletedProcess[str]]
) -> None:
    """A user's program with the README's imports type-checks against the installed package."""
    pytest.importorskip("mypy")
    program = tmp_path / "user_program.py"
    program.write_text(_readme_block("Fifteen lines"))
    # Outside the repository, so neither the project's mypy config nor its sources are used
    # (tests/user_mypy.py: a user's strict configuration, a cache shared with the other checks).
    proc = user_mypy(tmp_path, program.name)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Success" in proc.stdout
