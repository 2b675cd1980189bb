"""FakeOpenAIServer: built-in scripts, routes, fault rules, recording and the command line."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import httpx
from pydantic_core import from_json, to_json

from treadle.testing import FakeOpenAIServer, Reply, file_worker, tool_loop


def chat(client: httpx.Client, server: FakeOpenAIServer, messages: list[dict[str, Any]]) -> Any:
    response = client.post(
        f"{server.base_url}/chat/completions", json={"model": "m", "messages": messages}
    )
    response.raise_for_status()
    return response.json()


def test_file_worker_script_drives_a_two_tool_session() -> None:
    with FakeOpenAIServer("file_worker") as server, httpx.Client() as client:
        messages: list[dict[str, Any]] = [{"role": "user", "content": "write then read"}]
        first = chat(client, server, messages)["choices"][0]
        assert first["finish_reason"] == "tool_calls"
        call = first["message"]["tool_calls"][0]
        assert call["function"]["name"] == "write_workspace_file"
        assert from_json(call["function"]["arguments"]) == {
            "path": "notes.txt",
            "content": "hello from treadle\n",
        }
        messages += [
            first["message"],
            {"role": "tool", "tool_call_id": call["id"], "content": '{"ok": true}'},
        ]
        second = chat(client, server, messages)["choices"][0]["message"]
        shell = second["tool_calls"][0]
        assert shell["function"]["name"] == "run_shell_command"
        assert from_json(shell["function"]["arguments"]) == {"cmd": "cat notes.txt"}
        result = {"ok": True, "exit_code": 0, "stdout": "hello from treadle\n", "stderr": ""}
        messages += [
            second,
            {"role": "tool", "tool_call_id": shell["id"], "content": to_json(result).decode()},
        ]
        final = chat(client, server, messages)["choices"][0]
        assert final["finish_reason"] == "stop"
        assert "hello from treadle" in final["message"]["content"]


def test_tool_loop_and_echo_are_stateless_functions_of_the_request() -> None:
    script = tool_loop(2, tool_name="noop")
    tool = {"role": "tool", "tool_call_id": "c", "content": "{}"}
    assert script({"messages": []}).tool_calls[0].name == "noop"
    assert script({"messages": [tool]}).tool_calls[0].arguments == '{"round":2}'
    assert script({"messages": [tool, tool]}).content == "finished after 2 tool rounds"
    assert file_worker({"messages": [{"role": "user", "content": "x"}]}).tool_calls
    with FakeOpenAIServer("echo") as server, httpx.Client() as client:
        reply = chat(client, server, [{"role": "user", "content": "ping"}])
        assert reply["choices"][0]["message"]["content"] == "ping"
        assert reply["object"] == "chat.completion" and reply["id"].startswith("chatcmpl-")


def test_routes_and_errors() -> None:
    with FakeOpenAIServer(model="my-model") as server, httpx.Client() as client:
        root = server.base_url.removesuffix("/v1")
        assert client.get(f"{root}/health").json() == {"status": "ok"}
        assert client.get(f"{server.base_url}/models").json()["data"][0]["id"] == "my-model"
        assert client.get(f"{root}/nope").status_code == 404
        bad = client.post(f"{server.base_url}/chat/completions", content=b"not json")
        assert bad.status_code == 400 and "error" in bad.json()


def test_fault_rules_queue_order_and_recording() -> None:
    with FakeOpenAIServer("echo", max_recorded=3) as server, httpx.Client() as client:
        server.add_fault(
            Reply.server_error(503), when=lambda r: r["messages"][-1]["content"] == "fail"
        )
        server.enqueue(Reply.text("queued"))
        url = f"{server.base_url}/chat/completions"
        failing = client.post(
            url, json={"model": "m", "messages": [{"role": "user", "content": "fail"}]}
        )
        assert failing.status_code == 503 and failing.headers["x-request-id"]
        assert (
            chat(client, server, [{"role": "user", "content": "a"}])["choices"][0]["message"][
                "content"
            ]
            == "queued"
        )
        for text in ("b", "c", "d"):
            chat(client, server, [{"role": "user", "content": text}])
        assert server.request_count == 5 and len(server.requests) == 3
        assert server.requests[-1].body["messages"][0]["content"] == "d"


def test_probabilistic_faults_are_seeded() -> None:
    with FakeOpenAIServer("echo", seed=1) as server, httpx.Client() as client:
        server.add_fault(Reply.rate_limited(1), probability=0.5)
        url = f"{server.base_url}/chat/completions"
        body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
        statuses = [client.post(url, json=body).status_code for _ in range(40)]
        assert 5 < statuses.count(429) < 35 and statuses.count(200) == 40 - statuses.count(429)


def test_stream_without_usage_option_sends_no_usage_chunk() -> None:
    with FakeOpenAIServer("echo") as server, httpx.Client() as client:
        body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}
        text = client.post(f"{server.base_url}/chat/completions", json=body).text
        events = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert all(from_json(e)["choices"] for e in events[:-1])


def test_command_line_prints_the_url_and_serves() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "treadle.testing.fake_server", "--port", "0", "--script",
         "tool_loop", "--rounds", "1", "--latency-ms", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")
        with httpx.Client() as client:
            reply = client.post(
                f"{url}/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": "go"}]},
            ).json()
        assert reply["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "noop"
    finally:
        proc.terminate()
        proc.communicate(timeout=10)


def test_a_required_key_is_checked_like_a_real_endpoint() -> None:
    with FakeOpenAIServer(script="echo", api_key="sk-required") as server:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        url = f"{server.base_url}/chat/completions"
        assert httpx.post(url, json=body).status_code == 401
        wrong = httpx.post(url, json=body, headers={"authorization": "Bearer sk-wrong"})
        assert wrong.status_code == 401
        right = httpx.post(url, json=body, headers={"authorization": "Bearer sk-required"})
        assert right.status_code == 200
