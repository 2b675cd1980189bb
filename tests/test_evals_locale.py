"""Workspace files of eval items in a process whose locale is not UTF-8 (`LC_ALL=C`, no UTF-8
mode): non-ASCII text is written as UTF-8 all the same, and a name the file system encoding
cannot hold is refused, naming item and file, before any request. Run in a real subprocess with
that locale, since the encodings are fixed when the interpreter starts."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from treadle import Agent, Provider
    from treadle.evals import run_eval
    from treadle.testing import FakeOpenAIServer, Reply
    files = json.loads(sys.argv[1])
    items = [{"id": f"q{i}", "input": f"echo {i}", "expected": f"echo {i}"} for i in range(3)]
    items[1]["files"] = files
    requests = []
    def reply(request):
        requests.append(1)
        return Reply.text(request["messages"][-1]["content"])
    with FakeOpenAIServer(reply) as fake:
        provider = Provider(
            model="fake-model", base_url=fake.base_url, api_key="k", max_retries=0
        )
        agent = Agent("echo", "Repeat.", provider=provider)
        try:
            result = run_eval(agent, items, "exact", log=sys.argv[2], sandbox=True, concurrency=1)
            outcome = {"samples": result.summary.samples, "errors": result.summary.errors}
        except Exception as error:
            outcome = {"raised": type(error).__name__, "message": str(error)}
    outcome["requests"] = len(requests)
    print(ascii(json.dumps(outcome)))
    """
)


def _run_in_c_locale(files: dict[str, str], log: str) -> dict[str, object]:
    env = {**os.environ, "LC_ALL": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0"}
    env.pop("PYTHONIOENCODING", None)
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, json.dumps(files), log],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return dict(json.loads(ast.literal_eval(done.stdout.strip())))  # ascii() of a JSON string


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX locales")
def test_non_ascii_text_is_written_as_utf8_in_a_c_locale(tmp_path: Path) -> None:
    outcome = _run_in_c_locale({"notes.txt": "café ☕"}, str(tmp_path) + "/text.jsonl")
    assert outcome == {"samples": 3, "errors": {}, "requests": 3}


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX locales")
def test_a_name_the_file_system_encoding_cannot_hold_is_refused_first(tmp_path: Path) -> None:
    outcome = _run_in_c_locale({"café.txt": "x"}, str(tmp_path) + "/name.jsonl")
    assert outcome["raised"] == "ConfigurationError" and outcome["requests"] == 0
    assert "item 'q1': workspace file 'café.txt'" in str(outcome["message"])
    assert "file system encoding" in str(outcome["message"])
