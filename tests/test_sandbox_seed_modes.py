"""Seeding meets modes a command left (issue 29, review round 2): a destination directory or the
workspace root a command made unwritable is refused before anything moves, as `SandboxError`
(never a raw `PermissionError`); the staging directory is made beside the workspace, where no
box can see or rename it, and is always removed."""

from __future__ import annotations

import json
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandbox_support import BACKENDS, open_sandbox, run_as_nobody
from treadle.sandbox import Sandbox, seed_workspace
from treadle.sandbox.seed_staging import _make_stage

_SRC = Path(__file__).resolve().parent.parent / "src"


@pytest.fixture(params=BACKENDS)
def sandbox(request: pytest.FixtureRequest) -> Iterator[Sandbox]:
    yield from open_sandbox(request.param)


def test_the_staging_directory_is_beside_the_workspace_and_private(sandbox: Sandbox) -> None:
    root = sandbox.workspace
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        stage = _make_stage(root, fd)
    finally:
        os.close(fd)
    try:
        assert stage.parent == root.parent  # not in the workspace: the box cannot name it
        assert stage.name.startswith(".treadle-seed-")
        assert stat.S_IMODE(os.lstat(stage).st_mode) == 0o700
    finally:
        stage.rmdir()


async def test_a_seed_leaves_no_staging_directory_anywhere(
    sandbox: Sandbox, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import treadle.sandbox.seed_staging as staging

    made: list[Path] = []

    def spy(root: Path, root_fd: int) -> Path:  # the real function; only its result is noted
        made.append(_make_stage(root, root_fd))
        return made[-1]

    # The workspace's parent is shared with other tests' boxes (xdist workers seed beside this
    # one), so this seed's own staging directory is followed, not every name in that parent.
    monkeypatch.setattr(staging, "_make_stage", spy)
    source = tmp_path / "seed"
    (source / "d").mkdir(parents=True)
    (source / "d" / "f.txt").write_text("f")
    assert await seed_workspace(sandbox, source) == 1
    assert (sandbox.workspace / "d" / "f.txt").read_text() == "f"
    assert made and not [p for p in made if p.is_symlink() or p.exists()]
    assert not [n for n in os.listdir(sandbox.workspace) if n.startswith(".treadle-seed-")]


# Run as uid nobody (root writes through any mode): a local box whose workspace a "command" left
# with the given modes, then a seed of `top.txt` and `sub/t.txt`.
_AS_A_USER = """
import asyncio, json, os, sys, tempfile
from pathlib import Path
from treadle.sandbox import SandboxHandle, seed_workspace
src = Path(tempfile.mkdtemp()); (src / "sub").mkdir()
(src / "sub" / "t.txt").write_text("t"); (src / "top.txt").write_text("t")
report = {}
async def main():
    for case in ("root 555", "root 000", "sub 555"):
        handle = SandboxHandle("local"); box = handle.open(); ws = box.workspace
        (ws / "sub").mkdir()
        os.chmod(ws / "sub" if case.startswith("sub") else ws, int(case.split()[1], 8))
        try:
            await seed_workspace(box, src)
            outcome = "seeded"
        except Exception as e:
            outcome = f"{type(e).__module__}.{type(e).__name__}: {e}"
        os.chmod(ws, 0o700); os.chmod(ws / "sub", 0o700)
        report[case] = [outcome, sorted(str(p.relative_to(ws)) for p in ws.rglob("*"))]
        handle.release(); handle.wait_closed(60)
asyncio.run(main())
print(json.dumps(report))
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="needs an ordinary user (uid nobody, made with setpriv from root)",
)
def test_modes_a_command_left_refuse_the_whole_seed_as_an_ordinary_user() -> None:
    proc = run_as_nobody(["-c", _AS_A_USER], pythonpath=str(_SRC), timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    for case, (outcome, left) in report.items():
        assert outcome.startswith("treadle.errors.SandboxError: "), (case, outcome)
        assert "Nothing was seeded" in outcome, (case, outcome)
        assert left == ["sub"], (case, left)  # nothing moved, no staging directory
    assert "without write permission (mode 555)" in report["sub 555"][0]
    assert "chmod" in report["root 000"][0]
