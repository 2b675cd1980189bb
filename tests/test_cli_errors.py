"""What `treadle run` prints when something is wrong: each error says what to type.

Driven as subprocesses against the fake server over loopback HTTP, as a user would meet them: a
URL without a scheme, a host DNS does not know, a rejected key, a timeout, a mistyped flag, two
MCP servers whose tools clash.
"""

from __future__ import annotations

import json
import re
import shlex
import socket
import sys
from pathlib import Path

import pytest

from test_cli import _env, run_with_rejected_key, treadle
from treadle.testing import FakeOpenAIServer, Reply


def test_a_url_without_scheme_is_reported_before_the_missing_key(tmp_path: Path) -> None:
    proc = treadle("run", "hi", "--model", "m", "--base-url", "127.0.0.1:8765/v1", cwd=tmp_path)
    assert proc.returncode == 2
    assert "No API key" not in proc.stderr
    assert "--base-url '127.0.0.1:8765/v1' has no http:// or https:// scheme" in proc.stderr
    assert "treadle: fix: pass --base-url http://127.0.0.1:8765/v1" in proc.stderr
    assert proc.stdout == ""


def test_a_url_without_scheme_in_the_environment_names_the_variable(tmp_path: Path) -> None:
    env = _env(OPENAI_BASE_URL="api.example.com/v1", TREADLE_MODEL="m")
    proc = treadle("run", "hi", cwd=tmp_path, env=env)
    assert proc.returncode == 2
    assert "OPENAI_BASE_URL='api.example.com/v1' has no http:// or https://" in proc.stderr
    assert "export OPENAI_BASE_URL=https://api.example.com/v1" in proc.stderr


def test_the_missing_key_fix_names_the_flag_and_the_variable(tmp_path: Path) -> None:
    proc = treadle("run", "hi", "--model", "m", cwd=tmp_path)
    assert proc.returncode == 2
    assert "--api-key KEY" in proc.stderr and "OPENAI_API_KEY" in proc.stderr


def _dns_says_no_such_host(host: str) -> bool:
    try:
        socket.getaddrinfo(host, 443)
    except socket.gaierror as err:
        return err.errno != socket.EAI_AGAIN
    return False


def test_a_host_dns_does_not_know_fails_at_once_without_retries(tmp_path: Path) -> None:
    host = "no-such-host.invalid"  # RFC 2606: never resolves
    if not _dns_says_no_such_host(host):
        pytest.skip("this machine's resolver does not answer 'no such host' for .invalid")
    proc = treadle(
        "run", "hi", "--model", "m", "--base-url", f"https://{host}/v1", "--retries", "3",
        cwd=tmp_path, env=_env(OPENAI_API_KEY="sk-test-0000000000000000"),
    )  # fmt: skip
    assert proc.returncode == 4, proc.stderr
    assert f"Cannot resolve the host '{host}'" in proc.stderr
    assert "a retry would fail the same way" in proc.stderr
    assert "retries" not in proc.stderr  # reported before any attempt, so none was retried
    assert "treadle: fix: check the host name in --base-url" in proc.stderr


def test_a_rejected_key_reads_as_one_sentence_and_names_the_flag(tmp_path: Path) -> None:
    proc = run_with_rejected_key("sk-wrong-key-123456789", tmp_path)
    assert proc.returncode == 3
    cause = next(line for line in proc.stderr.splitlines() if "error:" in line)
    assert "rejected the API key: Incorrect API key provided. (HTTP 401)" in cause, cause
    assert ".;" not in proc.stderr and "Provider(" not in proc.stderr
    assert "--api-key KEY" in proc.stderr
    assert "sk-wrong-key-123456789" not in proc.stderr + proc.stdout


def test_api_key_flag_is_the_bearer_token_and_never_printed(tmp_path: Path) -> None:
    key = "sk-from-the-flag-0123456789"
    with FakeOpenAIServer(script="echo") as srv:
        proc = treadle(
            "run", "hi", "--model", "m", "--base-url", srv.base_url, "--api-key", key,
            cwd=tmp_path,
        )  # fmt: skip
        sent = [r.headers.get("authorization") for r in srv.requests]
    assert proc.returncode == 0, proc.stderr
    assert sent and all(value == f"Bearer {key}" for value in sent)
    assert key not in proc.stdout + proc.stderr


def test_a_timeout_names_the_timeout_flag(tmp_path: Path) -> None:
    with FakeOpenAIServer(script="echo") as srv:
        srv.add_fault(Reply.text("late").with_latency(60_000))  # far past --timeout 0.5
        proc = treadle(
            "run", "hi", "--model", "m", "--base-url", srv.base_url, "--timeout", "0.5",
            "--retries", "0", "--no-stream", cwd=tmp_path,
        )  # fmt: skip
    assert proc.returncode == 4, proc.stderr
    assert "Timed out" in proc.stderr
    assert "Provider.timeout" not in proc.stderr
    assert "treadle: fix: pass --timeout SECONDS" in proc.stderr


def test_a_bad_flag_prints_the_subcommand_usage_and_a_suggestion(tmp_path: Path) -> None:
    proc = treadle("run", "hi", "--base_url", "http://127.0.0.1:1/v1", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.startswith("usage: treadle run ")
    assert "treadle run: error: unrecognized arguments: --base_url" in proc.stderr
    assert "did you mean --base-url?" in proc.stderr
    assert "`treadle run --help` lists every flag" in proc.stderr
    proc = treadle("eval", "report", "log.jsonl", "--bogus", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.startswith("usage: treadle eval report ")


def test_help_lists_each_command_once(tmp_path: Path) -> None:
    proc = treadle("--help", cwd=tmp_path)
    assert proc.returncode == 0
    assert "eval-report" not in proc.stdout and "eval-compare" not in proc.stdout
    assert "eval report" in proc.stdout and "eval compare" in proc.stdout


def test_mcp_prefix_must_follow_a_server(tmp_path: Path) -> None:
    proc = treadle("run", "hi", "--mcp-prefix", "git", cwd=tmp_path)
    assert proc.returncode == 2
    assert "put it after one, e.g. --mcp" in proc.stderr


def test_clashing_mcp_tools_name_the_flag_that_fixes_them(tmp_path: Path) -> None:
    pytest.importorskip("mcp")
    from mcp_helpers import SERVER_SCRIPT, calls_then_answer, server_children

    stdio = shlex.join([sys.executable, SERVER_SCRIPT])
    script = calls_then_answer(("b_add", {"a": 40, "b": 2}))
    with FakeOpenAIServer(script=script) as fake:
        base = ("run", "add", "--model", "m", "--base-url", fake.base_url, "--json")
        proc = treadle(*base, "--mcp", stdio, "--mcp", stdio, cwd=tmp_path)
        assert proc.returncode == 2
        assert "two tools are named 'add'" in proc.stderr
        assert "MCPServer" not in proc.stderr
        cause = next(line for line in proc.stderr.splitlines() if "error:" in line)
        assert not cause.endswith("e.g."), cause  # a sentence, not one cut after "e.g."
        assert "one from MCP server" in cause and cause.endswith("."), cause
        assert "treadle: fix: add --mcp-prefix NAME right after the --mcp" in proc.stderr
        assert fake.request_count == 0
        proc = treadle(*base, "--mcp", stdio, "--mcp", stdio, "--mcp-prefix", "b", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        sent = {t["function"]["name"] for t in fake.requests[0].body["tools"]}
    assert {"add", "b_add", "echo", "b_echo"} <= sent
    (result,) = [m for m in json.loads(proc.stdout)["messages"] if m["role"] == "tool"]
    assert result["name"] == "b_add"
    assert json.loads(result["content"])["structured"] == {"result": 42}
    assert server_children() == {}


def test_counts_read_as_english() -> None:
    from treadle.cli.describe import counted

    assert counted(1, "request") == "1 request" and counted(2, "request") == "2 requests"
    assert counted(1, "retry") == "1 retry" and counted(0, "retry") == "0 retries"
    assert counted(1024, "request", grouped=True) == "1,024 requests"


def _provider_errors() -> list[Exception]:
    from treadle import errors as e

    return [
        e.AuthenticationError("The endpoint rejected the API key; check Provider(api_key=...).",
                              status_code=401),
        e.RateLimitError("kept rate-limiting; raise max_retries.", status_code=429),
        e.ContextLengthError("does not fit", status_code=400),
        e.ProviderTimeout("Timed out waiting for http://h/v1; raise Provider.timeout."),
        e.ProviderConnectionError("Could not connect; check base_url and that the server runs."),
        e.ProtocolMismatchError("The server at https://h:1/v1 speaks plain HTTP; use "
                                "base_url=http://h:1/v1."),
        e.NotOpenAIEndpointError("no chat-completions endpoint; check base_url.", status_code=404),
        e.ModelNotFoundError("no such model; check Provider.model.", status_code=404),
        e.InvalidRequestError("cannot parse", status_code=500),
        e.ProviderError("refused", status_code=400),
        e.ProviderError("The endpoint failed with a server error; retry later.", status_code=503),
        e.MalformedResponse("The endpoint's reply is not a valid chat completion: no choices."),
        e.ConfigurationError("two tools are named 'add'; give one of the servers a prefix, e.g. "
                             "MCPServer.stdio(..., prefix='git')."),
        e.ConfigurationError("tool 'read_file' shadows a built-in sandbox tool; rename it with "
                             "@tool(name=...)."),
        e.SandboxUnavailable("the isolated sandbox needs `bwrap`, which is not on PATH."),
        e.BudgetExceededError("the pass went over its token budget."),
    ]  # fmt: skip


@pytest.mark.parametrize("error", _provider_errors(), ids=lambda e: type(e).__name__)
def test_every_endpoint_and_configuration_error_names_what_to_type(error: Exception) -> None:
    from treadle.cli.failures import explain

    failure = explain(error, "run")
    assert re.search(r"--[a-z]|treadle [a-z]|OPENAI_|TREADLE_", failure.fix), failure
    for python_only in ("Provider.", "Provider(", "MCPServer", "base_url=", "max_retries",
                        "@tool("):  # fmt: skip
        assert python_only not in failure.cause + failure.fix, failure
    assert ".;" not in failure.cause and not failure.cause.endswith(".."), failure
