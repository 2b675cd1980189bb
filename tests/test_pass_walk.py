"""The walk of one pass: api -> engine -> llm -> tools -> sandbox, each file entered once.

A profiler records which Treadle files are on the stack at the two points where a pass leaves
Treadle: the request going out on the wire, and a sandbox command (and file write) running for a
built-in tool. Each stack is the straight path the pass took to get there; it must stay short and
never return to a file it already left (no ping-pong between layers).
"""

from __future__ import annotations

import os
import sys
from types import FrameType
from typing import Any

import treadle
from treadle import Provider, Session
from treadle.loop import arun_session_loop
from treadle.testing import FakeOpenAIServer

ROOT = os.path.dirname(treadle.__file__)
MAX_FILES_PER_PATH = 6

# (file, function) where a pass leaves Treadle: the HTTP send, and the sandbox backend.
LEAVES = {
    ("_http/pool.py", "_send"): "wire",
    ("sandbox/local.py", "run_command"): "shell",
    ("sandbox/local.py", "write_file"): "write",
}


def _stack_files(frame: FrameType | None) -> list[str]:
    files: list[str] = []
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(ROOT):
            rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
            if not files or files[-1] != rel:
                files.append(rel)
        frame = frame.f_back
    return list(reversed(files))


async def test_one_pass_walks_a_straight_short_path() -> None:
    stacks: dict[str, list[str]] = {}

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        path = frame.f_code.co_filename
        if not path.startswith(ROOT):
            return
        rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
        leaf = LEAVES.get((rel, frame.f_code.co_name))
        if leaf is not None:
            stacks.setdefault(leaf, _stack_files(frame))

    with FakeOpenAIServer(script="file_worker") as server:
        provider = Provider(model="fake-model", base_url=server.base_url, stream=False)
        user = Session.from_user_message("Create a file, then read it back.").to("local")
        sys.setprofile(profile)
        try:
            out = await arun_session_loop(
                user, Session.from_agent_prompt("Use tools."), agent_provider=provider
            )
        finally:
            sys.setprofile(None)
        out.close_sandbox()
        user.close_sandbox()
    assert out.final_text == "notes.txt contains: hello from treadle"
    assert set(stacks) == {"wire", "shell", "write"}, stacks
    for leaf, files in stacks.items():
        assert len(files) <= MAX_FILES_PER_PATH, (leaf, files)
        assert len(set(files)) == len(files), f"{leaf}: a file is entered twice: {files}"
    assert stacks["wire"][:3] == ["loop/api.py", "loop/engine.py", "llm/turn.py"]
    assert stacks["shell"][:3] == ["loop/api.py", "loop/engine.py", "tools/dispatch.py"]
