"""The API key never leaks: not into persisted files, logs, reprs, exceptions or CLI output.

A full pass runs with a distinctive key, persisted and logged at DEBUG; then a 401, a server error
whose body echoes the key, and (when the `treadle` CLI is installed) `treadle run` as a
subprocess. Every output is searched for the key.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

from treadle import Provider, Session, run_session_loop
from treadle.errors import AuthenticationError, ProviderError
from treadle.persist import load_session
from treadle.testing import FakeOpenAIServer, Reply

KEY = "sk-SECRET-canary-1234567890"


def _error_texts(err: BaseException) -> list[str]:
    texts = ["".join(traceback.format_exception(err)), repr(err), str(err)]
    cause: BaseException | None = err
    while cause is not None:
        texts.extend(
            [repr(cause), str(cause), repr(vars(cause)) if hasattr(cause, "__dict__") else ""]
        )
        cause = cause.__cause__ or cause.__context__
    return texts


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_key_never_leaks_from_a_library_pass(
    stream: bool, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("OPENAI_API_KEY", KEY)  # also offered to sandbox commands: must be scrubbed
    texts: list[str] = []
    with FakeOpenAIServer(script="file_worker") as server:
        provider = Provider(
            model="fake",
            base_url=server.base_url,
            api_key=KEY,
            stream=stream,
            max_retries=1,
            retry_base_delay=0.01,
        )
        server.add_fault(Reply.server_error(503), times=1)  # one retry, logged
        user = Session.from_user_message("Create a file, then read it back.").to("local")
        file = tmp_path / "pass.jsonl"
        out = run_session_loop(
            user,
            Session.from_agent_prompt("Use tools."),
            agent_provider=provider,
            persist_path=file,
        )
        assert out.stop_reason == "final_answer"
        loaded = load_session(file, sandbox=False)
        texts += [file.read_text(), repr(provider), str(provider), repr(out), repr(out.usage)]
        texts += [repr(r) for r in out.rows] + [r.message_json().decode() for r in out.rows]
        texts += [repr(loaded), repr(out.metadata), repr(out.lineage), out.lineage_mermaid()]
        texts += [repr(provider.resolve())]
        out.close_sandbox()

        server.add_fault(Reply.unauthorized(), times=1)
        failed = run_session_loop(
            Session.from_user_message("hi"), Session.from_agent_prompt("x"), agent_provider=provider
        )
        with pytest.raises(AuthenticationError) as auth:
            failed.synchronize()
        texts += [*_error_texts(auth.value), repr(failed)]

        # A proxy that echoes the Authorization header back in its error body.
        server.add_fault(Reply.error(500, f"bad upstream header 'Bearer {KEY}'"), times=2)
        echoed = run_session_loop(
            Session.from_user_message("hi"), Session.from_agent_prompt("x"), agent_provider=provider
        )
        with pytest.raises(ProviderError) as err:
            echoed.synchronize()
        assert "***" in (err.value.body or "")
        texts += _error_texts(err.value)
    texts += [r.getMessage() for r in caplog.records] + [caplog.text]
    assert any("retrying" in r.getMessage() for r in caplog.records)
    leaks = [t for t in texts if KEY in t]
    assert not leaks, leaks[0][:500]


@pytest.mark.skipif(
    not shutil.which("treadle") and not Path(sys.executable).with_name("treadle").exists(),
    reason="the treadle CLI is not installed",
)
def test_key_never_leaks_from_the_cli(tmp_path: Path) -> None:
    cli = shutil.which("treadle") or str(Path(sys.executable).with_name("treadle"))
    env = {**os.environ, "OPENAI_API_KEY": KEY, "TREADLE_MODEL": "fake", "NO_COLOR": "1"}
    outputs: list[str] = []
    with FakeOpenAIServer(script="file_worker") as server:
        runs = [
            ["run", "Create a file, then read it back.", "--sandbox", "local", "--persist"],
            ["run", "hi", "--json", "--no-stream"],
        ]
        for args in runs:
            done = subprocess.run(
                [cli, *args, "--base-url", server.base_url],
                env=env,
                cwd=tmp_path,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert done.returncode == 0, done.stderr
            outputs += [done.stdout, done.stderr]
        server.add_fault(Reply.unauthorized())
        done = subprocess.run(
            [cli, "run", "hi", "--base-url", server.base_url],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode != 0
        outputs += [done.stdout, done.stderr]
    files = list((tmp_path / ".treadle").rglob("*.jsonl"))
    assert files, "--persist wrote no session file"
    outputs += [f.read_text() for f in files]
    assert not [o for o in outputs if KEY in o]
