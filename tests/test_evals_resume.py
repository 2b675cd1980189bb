"""Acceptance: a 2,000-item evaluation killed with SIGKILL three times and resumed.

`treadle eval` runs in a subprocess against the fake server (in this process, on 127.0.0.1). Each
of three runs is SIGKILLed once the log holds a seeded random number of samples, then the fourth
run resumes to the end. The log must hold every sample exactly once, every transcript it names
must load, and its summary must equal that of an uninterrupted run of the same configuration
(latency aside: it is the only figure that differs between two runs). A few items are answered
with a 400 so the summary also carries non-retryable errors.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from treadle.evals import read_log, summarize
from treadle.persist import load_session
from treadle.testing import FakeOpenAIServer, Reply

ITEMS = 2000
SEED = 20261123
ROOT = Path(__file__).resolve().parent.parent

AGENT_MODULE = """
import os
from treadle import Agent, Provider

agent = Agent(
    "echo-solver",
    "Answer with the number only.",
    provider=Provider(model="fake-model", base_url=os.environ["FAKE_URL"], api_key="test-key",
                      max_retries=0),
)
"""


def _dataset(path: Path) -> None:
    with path.open("w") as file:
        for i in range(ITEMS):
            text = f"boom {i}" if i % 97 == 0 else f"answer {i % 7}"
            item = {
                "id": f"item-{i:04d}",
                "input": text,
                "expected": f"answer {i % 5}",
                "metadata": {"tags": [f"group-{i % 4}"]},
            }
            file.write(json.dumps(item) + "\n")


def _script(request: dict[str, Any]) -> Reply:
    text = request["messages"][-1]["content"]
    if text.startswith("boom"):
        return Reply.bad_request("this item is refused")  # a 400: the agent's failure, not retried
    return Reply.text(text)


def _lines(log: Path) -> int:
    try:
        return log.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def _eval(cwd: Path, log: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "treadle.cli", "eval", "data.jsonl"]
    command += ["--agent", "evalagent:agent", "--log", log, "--concurrency", "64"]
    return subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )


@pytest.mark.slow  # three killed eval runs, 15 s: `make test-slow`
def test_kill_three_times_and_resume(tmp_path: Path) -> None:
    _dataset(tmp_path / "data.jsonl")
    (tmp_path / "evalagent.py").write_text(AGENT_MODULE)
    rng = random.Random(SEED)
    with FakeOpenAIServer(_script, latency_ms=5) as server:
        env = {**os.environ, "FAKE_URL": server.base_url, "PYTHONPATH": str(ROOT / "src")}
        log = tmp_path / "killed.jsonl"
        floor = 0
        for round_ in range(3):
            # Kill somewhere in the next stretch of the run: each run gets further.
            target = rng.randint(floor + 50, floor + 550)
            proc = _eval(tmp_path, log.name, env)
            deadline = time.monotonic() + 120  # a hang guard, not a timing assertion
            while _lines(log) < target and proc.poll() is None:
                assert time.monotonic() < deadline, "the eval made no progress"
                time.sleep(0.002)
            proc.send_signal(signal.SIGKILL)
            _, stderr = proc.communicate(timeout=60)
            assert proc.returncode == -signal.SIGKILL, (
                f"run {round_} ended before it was killed: {stderr.decode()}"
            )
            data = log.read_bytes()
            floor = data.count(b"\n") - 1
            assert 0 < floor < ITEMS, f"run {round_} left {floor} samples"
        resumed = _eval(tmp_path, log.name, env)
        _, stderr = resumed.communicate(timeout=120)
        assert resumed.returncode == 0, stderr.decode()

        clean = _eval(tmp_path, "clean.jsonl", env)
        _, stderr = clean.communicate(timeout=120)
        assert clean.returncode == 0, stderr.decode()

    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert lines[0]["type"] == "header"
    keys = Counter((line["item_id"], line["sample"]) for line in lines[1:])
    assert len(keys) == ITEMS and set(keys.values()) == {1}, "a sample is missing or doubled"
    killed_log, clean_log = read_log(log), read_log(tmp_path / "clean.jsonl")
    killed, uninterrupted = summarize(killed_log), summarize(clean_log)
    assert killed.outcome() == uninterrupted.outcome()
    assert killed.errors == {"bad_request": len(range(0, ITEMS, 97))}
    assert killed.samples == ITEMS and killed.tokens["requests"] == ITEMS - len(range(0, ITEMS, 97))
    for record in killed_log.records:
        if record.error_kind is None:
            assert record.transcript is not None
            loaded = load_session(tmp_path / record.transcript)
            assert loaded.closed and loaded.session.final_text == record.answer
