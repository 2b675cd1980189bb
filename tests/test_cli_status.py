"""The CLI shows what it is doing while the model thinks: in a real terminal (tmux) and in a pipe.

A slow fake model (seconds before each reply) stands in for a real endpoint. The tests check
order, not speed: the status must be on screen while no reply has been sent yet, its elapsed time
must advance, and it must be gone (no half-drawn line) once real output arrives. Also here: the
`--extra-body` flag and the `treadle show` command `treadle demo` prints, run as printed.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from test_cli import _env, file_worker_run
from treadle.testing import FakeOpenAIServer

ROOT = Path(__file__).resolve().parent.parent
SLOW_MS = 1500.0  # every reply of the fake model waits this long
HANG_GUARD = 60.0  # seconds; only a hung CLI hits this


@pytest.fixture
def slow_server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer(script="file_worker", latency_ms=SLOW_MS) as server:
        yield server


def _replies_sent(server: FakeOpenAIServer) -> int:
    return server.request_count - server.in_flight


def test_without_a_tty_each_phase_is_a_line_on_stderr_before_the_model_answers(
    slow_server: FakeOpenAIServer, tmp_path: Path
) -> None:
    seen_before_reply: list[str] = []
    lines: list[str] = []
    with subprocess.Popen(
        [sys.executable, "-m", "treadle.cli", *file_worker_run(slow_server, "local")],
        cwd=tmp_path,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        assert proc.stderr is not None and proc.stdout is not None
        err = proc.stderr

        def read_stderr() -> None:
            for line in err:
                if _replies_sent(slow_server) == 0:
                    seen_before_reply.append(line)
                lines.append(line)

        reader = threading.Thread(target=read_stderr)
        reader.start()
        out = proc.stdout.read()
        assert proc.wait(HANG_GUARD) == 0, "".join(lines)
        reader.join(HANG_GUARD)
    host = slow_server.base_url.split("/")[2]
    # Before the first reply, the user already reads where treadle connects and what it awaits.
    assert f"treadle: waiting for fake-model at {host}...\n" in seen_before_reply
    assert not any("connecting" in line for line in lines)  # a slow model is not a slow connect
    assert lines.count("treadle: waiting for fake-model...\n") == 2  # after each tool round
    # stdout keeps the transcript only: no status text, no terminal control codes
    assert "waiting for" not in out and "\x1b" not in out
    assert "notes.txt contains: hello from treadle" in out


def _tmux() -> str:
    found = shutil.which("tmux")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("tmux is missing on CI (.ci/run installs it)")
        pytest.skip("tmux is not installed (apt-get install tmux): no real terminal to test in")
    return found


def _pane(tmux: list[str]) -> str:
    return subprocess.run(
        [*tmux, "capture-pane", "-p", "-J"], capture_output=True, text=True, check=True
    ).stdout


def _elapsed(screen: str) -> float | None:
    for line in screen.splitlines():
        if "waiting for fake-model" in line and line.rstrip().endswith(" s"):
            return float(line.rstrip()[:-2].rsplit(" ", 1)[1])
    return None


def test_in_a_terminal_the_status_line_counts_up_then_gives_way_to_output(
    slow_server: FakeOpenAIServer, tmp_path: Path
) -> None:
    tmux = [_tmux(), "-L", f"treadle-test-{uuid.uuid4().hex[:8]}"]
    env = _env(TERM="xterm-256color")
    command = shlex.join(
        [sys.executable, "-m", "treadle.cli", *file_worker_run(slow_server, "local")]
    )
    done = tmp_path / "done"
    script = f"{command}; echo exit=$? > {shlex.quote(str(done))}; sleep 600"
    started = time.monotonic()
    subprocess.run(
        [*tmux, "new-session", "-d", "-x", "160", "-y", "40", "-c", str(tmp_path), script],
        env=env,
        check=True,
    )
    try:
        readings: list[float] = []
        first_seen: float | None = None
        deadline = time.monotonic() + HANG_GUARD
        while time.monotonic() < deadline and len(set(readings)) < 3:
            screen = _pane(tmux)
            value = _elapsed(screen)
            if value is not None and _replies_sent(slow_server) == 0:
                first_seen = first_seen or time.monotonic() - started
                readings.append(value)
            elif _replies_sent(slow_server) > 0:
                break
            time.sleep(0.05)
        # The line was there before any reply, and its clock moved.
        assert len(set(readings)) >= 3, (readings, _pane(tmux))
        assert readings == sorted(readings)
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        screen = _pane(tmux)
        assert done.read_text().strip() == "exit=0", screen
        assert "notes.txt contains: hello from treadle" in screen
        # Erased before each output line: no status text left anywhere on the screen.
        assert "waiting for" not in screen and "running " not in screen, screen
        print(f"status first seen {first_seen:.2f} s after launching the command in tmux")
    finally:
        subprocess.run([*tmux, "kill-server"], check=False, capture_output=True)


def test_extra_body_reaches_every_request(tmp_path: Path) -> None:
    with FakeOpenAIServer(script="echo") as server:
        proc = subprocess.run(
            [
                *(sys.executable, "-m", "treadle.cli", "run", "hi", "--model", "fake-model"),
                *("--base-url", server.base_url, "--extra-body", '{"top_k": 20, "min_p": 0.1}'),
            ],
            cwd=tmp_path,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=HANG_GUARD,
        )
        assert proc.returncode == 0, proc.stderr
        body = server.requests[-1].body
        assert body is not None and body["top_k"] == 20 and body["min_p"] == 0.1
    bad = subprocess.run(
        [sys.executable, "-m", "treadle.cli", "run", "hi", "--extra-body", "[1, 2]"],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=HANG_GUARD,
    )
    assert bad.returncode == 2 and "expected a JSON object" in bad.stderr


def test_the_show_command_the_demo_prints_works_as_printed(tmp_path: Path) -> None:
    # A newcomer's shell after `make demo`: the venv is not activated, so `treadle` is not on
    # PATH. The printed command must run as it is, from the same directory.
    bare_path = os.pathsep.join(
        p for p in os.environ.get("PATH", "").split(os.pathsep)
        if not (Path(p) / "treadle").exists()
    )  # fmt: skip
    env = _env(PATH=bare_path)
    demo = subprocess.run(
        [sys.executable, "-m", "treadle.cli", "demo", "--fanout", "0", "--latency-ms", "0"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD,
    )
    assert demo.returncode == 0, demo.stderr
    [line] = [x for x in demo.stdout.splitlines() if x.startswith("See it again with: ")]
    command = line.removeprefix("See it again with: ")
    shown = subprocess.run(
        command, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert shown.returncode == 0, (command, shown.stderr)
    assert "hello from treadle" in shown.stdout


def test_the_local_model_demo_prints_text_not_reprs(tmp_path: Path) -> None:
    # The real model needs llama.cpp (make e2e); here a stand-in module serves the same demo
    # from the fake server, so the CLI's rendering of it is what is tested.
    stand_in = tmp_path / "stand_in_local_model.py"
    stand_in.write_text(
        "from pathlib import Path\n"
        "from treadle.llm import Provider\n"
        "from treadle.testing import FakeOpenAIServer, Reply\n"
        "from treadle.testing.local_model import demo_tools\n\n"
        "def ensure_installed(*, progress):\n"
        "    progress('model ready')\n"
        "    return Path('model.gguf')\n\n"
        "class LocalModelServer:\n"
        "    def __init__(self, path):\n"
        "        self.fake = FakeOpenAIServer(replies=[\n"
        "            Reply.tool_call('add', {'a': 2, 'b': 3}), Reply.text('2 + 3 = 5')])\n"
        "        self.startup_seconds = 0.1\n"
        "    def start(self):\n"
        "        self.fake.start()\n"
        "        self.base_url = self.fake.base_url\n"
        "        return self\n"
        "    def provider(self, **kw):\n"
        "        return Provider(model='gemma', base_url=self.base_url, **kw)\n"
        "    def stop(self):\n"
        "        self.fake.stop()\n"
    )
    code = (
        "import sys\n"
        "import treadle.cli.demo as demo\n"
        "demo.LOCAL_MODEL_MODULE = 'stand_in_local_model'\n"
        "from treadle.cli import main\n"
        "sys.exit(main(['demo', '--local-model']))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=_env(PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{tmp_path}"),
        capture_output=True,
        text=True,
        timeout=HANG_GUARD,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "-> add(a=2, b=3)" in proc.stdout and '<- add: {"result": 5}' in proc.stdout
    assert "2 + 3 = 5" in proc.stdout and "stop: final_answer" in proc.stdout
    for raw in ("Usage(", "ChunkRow(", "usage=", "stop_reason="):
        assert raw not in proc.stdout, proc.stdout
