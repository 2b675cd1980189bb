"""`treadle run`'s pre-flight refusals and what it never prints, found by a new-user review.

Each case runs the real command as a subprocess (against the fake server over loopback HTTP where
a pass starts): a mistyped `--sandbox` word, limit flags the pass would reject, an `--mcp-url`
without a scheme, an MCP server that never answers, and a base URL carrying secrets.
"""

from __future__ import annotations

import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from test_cli import _env, treadle
from treadle.testing import FakeOpenAIServer


def test_a_mistyped_sandbox_word_is_refused_and_nothing_is_created(tmp_path: Path) -> None:
    with FakeOpenAIServer(script="echo") as srv:
        proc = treadle(
            "run", "hi", "--model", "m", "--base-url", srv.base_url, "--sandbox", "isolatd",
            cwd=tmp_path,
        )  # fmt: skip
        assert srv.request_count == 0
    assert proc.returncode == 2, proc.stderr
    assert "--sandbox 'isolatd' is neither local, isolated nor an existing directory" in (
        proc.stderr
    )
    assert "did you mean --sandbox isolated?" in proc.stderr
    assert "--sandbox ./isolatd to create a new directory" in proc.stderr
    assert not (tmp_path / "isolatd").exists()


@pytest.mark.parametrize("value", ["./work", "existing"])
def test_a_path_or_an_existing_directory_is_a_sandbox(tmp_path: Path, value: str) -> None:
    (tmp_path / "existing").mkdir()
    with FakeOpenAIServer(script="echo") as srv:
        proc = treadle(
            "run", "hi", "--model", "m", "--base-url", srv.base_url, "--sandbox", value,
            cwd=tmp_path,
        )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / value).is_dir()


@pytest.mark.parametrize(
    ("words", "said"),
    [
        (["--timeout", "0"], "--timeout 0 is not a positive number of seconds"),
        (["--timeout", "-2"], "--timeout -2 is not a positive number of seconds"),
        (["--timeout", "nan"], "--timeout nan is not a positive number of seconds"),
        (["--mcp-timeout", "0"], "--mcp-timeout 0 is not a positive number of seconds"),
        (["--retries", "-1"], "argument --retries: expected 0 or more, got -1"),
        (["--max-steps", "0"], "argument --max-steps: expected at least 1, got 0"),
    ],
)
def test_limit_flags_are_checked_before_the_pass_and_named(
    tmp_path: Path, words: list[str], said: str
) -> None:
    proc = treadle(
        "run", "hi", "--model", "m", "--base-url", "http://127.0.0.1:9/v1", *words, cwd=tmp_path
    )
    assert proc.returncode == 2, proc.stderr
    assert said in proc.stderr
    assert "Provider" not in proc.stderr
    assert "waiting for" not in proc.stderr  # refused before the pass started


def test_an_mcp_url_without_scheme_is_refused_at_once(tmp_path: Path) -> None:
    proc = treadle(
        "run", "hi", "--model", "m", "--base-url", "http://127.0.0.1:9/v1",
        "--mcp-url", "127.0.0.1:18406/mcp", cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "--mcp-url '127.0.0.1:18406/mcp' has no http:// or https:// scheme" in proc.stderr
    assert "fix: pass --mcp-url http://127.0.0.1:18406/mcp" in proc.stderr
    assert "MCPServer" not in proc.stderr


# An MCP server that starts but never says a word: it reads stdin until it is closed.
_SILENT_SERVER = "import sys; sys.stdin.read()"


@pytest.mark.parametrize("flag", ["--mcp-timeout", "--timeout"])
def test_an_mcp_server_that_never_answers_is_bounded_and_exits_4(tmp_path: Path, flag: str) -> None:
    pytest.importorskip("mcp")
    silent = shlex.join([sys.executable, "-c", _SILENT_SERVER])
    with FakeOpenAIServer(script="echo") as srv:
        proc = treadle(
            "run", "hi", "--model", "m", "--base-url", srv.base_url, "--mcp", silent,
            flag, "1", cwd=tmp_path,
        )  # fmt: skip
        assert srv.request_count == 0
    assert proc.returncode == 4, proc.stderr
    assert "could not start MCP server" in proc.stderr
    # the whole wait, loading the MCP SDK included, said as it was
    assert re.search(
        r": no answer within \d+\.\d s( \(\d+\.\d s of it loading the MCP SDK\))?\.", proc.stderr
    )
    assert "call again" not in proc.stderr  # advice for a Python caller, not a shell user
    assert "--mcp-timeout SECONDS" in proc.stderr


def test_an_mcp_server_that_cannot_start_gets_no_python_advice(tmp_path: Path) -> None:
    pytest.importorskip("mcp")
    crashing = shlex.join([sys.executable, "-c", "raise SystemExit('no such tool server')"])
    proc = treadle(
        "run", "hi", "--model", "m", "--base-url", "http://127.0.0.1:9/v1", "--mcp", crashing,
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "could not start MCP server" in proc.stderr
    assert "call again" not in proc.stderr
    assert "treadle: fix: check the --mcp command" in proc.stderr


def test_an_unreachable_mcp_url_exits_4_like_an_unreachable_endpoint(tmp_path: Path) -> None:
    pytest.importorskip("mcp")
    with socket.socket() as closed:  # a port nobody listens on: connections are refused
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    with FakeOpenAIServer(script="echo") as srv:
        proc = treadle(
            "run", "hi", "--model", "m", "--base-url", srv.base_url,
            "--mcp-url", f"http://127.0.0.1:{port}/mcp", cwd=tmp_path,
        )  # fmt: skip
        assert srv.request_count == 0
    assert proc.returncode == 4, proc.stderr
    assert f"could not start MCP server http://127.0.0.1:{port} (ConnectError" in proc.stderr
    assert "--mcp-url (host and port)" in proc.stderr


def test_secrets_in_the_base_url_are_never_printed_and_the_query_is_kept(tmp_path: Path) -> None:
    with FakeOpenAIServer(script="echo") as srv:
        secret_url = srv.base_url.replace("http://", "http://user:s3cretpass@")
        proc = treadle(
            "run", "hi", "--model", "fake-model", "--base-url",
            f"{secret_url}?api-version=1&key=qsecret", cwd=tmp_path,
        )  # fmt: skip
        paths = [r.path for r in srv.requests]
    assert proc.returncode == 0, proc.stderr
    assert paths == ["/v1/chat/completions?api-version=1&key=qsecret"]
    host = srv.base_url.split("//", 1)[1].split("/", 1)[0]
    assert f"waiting for fake-model at {host}" in proc.stderr
    assert "s3cretpass" not in proc.stderr + proc.stdout
    assert "qsecret" not in proc.stderr + proc.stdout


def test_secrets_in_the_base_url_stay_out_of_error_lines(tmp_path: Path) -> None:
    port = _closed_port()
    proc = treadle(
        "run", "hi", "--model", "m", "--retries", "0", "--base-url",
        f"http://user:s3cretpass@127.0.0.1:{port}/v1?key=qsecret", cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 4, proc.stderr
    assert f"http://127.0.0.1:{port}" in proc.stderr
    assert "s3cretpass" not in proc.stderr and "qsecret" not in proc.stderr
    proc = treadle("run", "hi", "--model", "m", "--base-url", "u:s3cretpass@h/v1", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "--base-url has no http:// or https:// scheme" in proc.stderr
    assert "s3cretpass" not in proc.stderr


def _closed_port() -> int:
    """A loopback port that was just free (bound, then closed): connecting to it is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def test_the_fake_server_command_plays_a_rejected_key(tmp_path: Path) -> None:
    with subprocess.Popen(
        [sys.executable, "-m", "treadle.testing.fake_server", "--api-key", "sk-right"],
        stdout=subprocess.PIPE, text=True, env=_env(), cwd=tmp_path,
    ) as server:  # fmt: skip
        try:
            assert server.stdout is not None
            base_url = server.stdout.readline().split()[-1]
            assert base_url.startswith("http://127.0.0.1:"), base_url
            wrong = treadle(
                "run", "hi", "--model", "m", "--base-url", base_url, "--api-key", "sk-wrong",
                cwd=tmp_path,
            )  # fmt: skip
            right = treadle(
                "run", "hi", "--model", "m", "--base-url", base_url, "--api-key", "sk-right",
                cwd=tmp_path,
            )  # fmt: skip
        finally:
            server.terminate()
    assert wrong.returncode == 3, wrong.stderr
    assert right.returncode == 0, right.stderr
