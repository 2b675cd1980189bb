"""The example chat service (examples/chat_service), served by uvicorn on 127.0.0.1 and driven
over real HTTP (server-sent events), and once by headless Chromium running its page."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import quote

import anyio
import httpx
import pytest
import uvicorn

from treadle import Provider, tool
from treadle.stores import Store
from treadle.testing import FakeOpenAIServer, Reply

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
TIMEOUT = 120.0


def _load_app() -> ModuleType:
    path = ROOT / "examples" / "chat_service" / "app.py"
    spec = importlib.util.spec_from_file_location("chat_service_app", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


chat_app = _load_app()
tool_cancelled = threading.Event()


tool_running = threading.Event()
"""Set when `wait_for_operator` runs (the `tool` event goes out before the pass records its
intent and starts the tool: a disconnect before that cancels a tool that never ran)."""


@tool
async def wait_for_operator() -> str:
    """Wait until someone answers (the tests cancel it by disconnecting)."""
    tool_running.set()
    try:
        await anyio.sleep_forever()
    finally:
        tool_cancelled.set()
    return "never"


stall_asked = threading.Event()
"""Set when the model is asked the stalling question: the pass has opened its conversation."""


def model(request: dict[str, Any]) -> Any:
    last = request["messages"][-1]
    if last["role"] == "user" and last["content"] == "wait":
        return Reply.tool_call("wait_for_operator", {})
    if last["role"] == "user" and last["content"] == "stall":
        stall_asked.set()
        # the first words stream at once, then the model goes quiet for ten minutes
        return Reply.text("Let me think about it for a long while.", chunk_chars=8).stalled(600_000)
    return chat_app.fake_model(request)


class Served:
    """The app on uvicorn in a thread, on a free port."""

    def __init__(self, store: Store, provider: Provider) -> None:
        app = chat_app.create_app(store, provider, tools=[chat_app.deploy, wait_for_operator])
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]})
        self.thread.start()
        deadline = time.monotonic() + TIMEOUT
        while not self.server.started:  # uvicorn's own readiness flag
            assert self.thread.is_alive() and time.monotonic() < deadline
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(TIMEOUT)
        self.sock.close()


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Served, Store]]:
    with (
        FakeOpenAIServer(script=model) as fake,
        Store.sqlite(tmp_path_factory.mktemp("chat") / "chat.db") as store,
    ):
        served = Served(store, Provider(model="fake", base_url=fake.base_url, api_key="k"))
        try:
            yield served, store
        finally:
            served.stop()


def _events(url: str, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    found = []
    with httpx.stream("POST", url, json=body, timeout=TIMEOUT) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        event = ""
        for line in reply.iter_lines():
            if line.startswith("event: "):
                event = line.removeprefix("event: ")
            elif line.startswith("data: "):
                found.append((event, json.loads(line.removeprefix("data: "))))
    return found


def test_chat_streams_a_pass_and_continues_the_stored_conversation(
    service: tuple[Served, Store],
) -> None:
    served, store = service
    first = _events(f"{served.url}/chat/alice", {"message": "hello"})
    streamed = "".join(data["text"] for kind, data in first if kind == "delta")
    assert streamed == "You said: hello"  # the reply as it streamed, then whole
    assert [e for e in first if e[0] != "delta"] == [
        ("message", {"text": "You said: hello"}),
        ("done", {"stop_reason": "final_answer", "version": 2}),
    ]
    second = _events(f"{served.url}/chat/alice", {"message": "again"})
    assert second[-1] == ("done", {"stop_reason": "final_answer", "version": 4})
    stored = httpx.get(f"{served.url}/conversations/alice", timeout=TIMEOUT).json()
    assert [m["content"] for m in stored["messages"]] == [
        "hello", "You said: hello", "again", "You said: again",
    ]  # fmt: skip
    assert store.conversation("alice").metadata["version"] == 4
    bad = httpx.post(f"{served.url}/chat/alice", json={"nope": 1}, timeout=TIMEOUT)
    assert bad.status_code == 400


def test_an_approval_stops_the_pass_and_a_later_request_resumes_it(
    service: tuple[Served, Store],
) -> None:
    served, store = service
    asked = _events(f"{served.url}/chat/ops", {"message": "deploy prod"})
    (kind, approval) = asked[0]
    assert kind == "approval" and approval["calls"][0]["name"] == "deploy"
    assert asked[-1] == ("done", {"stop_reason": "interrupted", "version": 2})
    call_id = approval["calls"][0]["id"]
    resumed = _events(f"{served.url}/approve/ops", {"approvals": {call_id: True}})
    assert ("tool", {"name": "deploy", "arguments": '{"target":"prod"}'}) in resumed
    assert ("message", {"text": "Done: deployed to prod"}) in resumed
    assert resumed[-1] == ("done", {"stop_reason": "final_answer", "version": 4})
    again = httpx.post(f"{served.url}/approve/ops", json={"approvals": {}}, timeout=TIMEOUT)
    assert again.status_code == 409  # nothing waits any more
    assert store.pending("ops") == []


def test_a_client_disconnect_cancels_the_pass_and_commits_nothing(
    service: tuple[Served, Store],
) -> None:
    served, store = service
    tool_cancelled.clear()
    tool_running.clear()
    with httpx.stream(
        "POST", f"{served.url}/chat/bob", json={"message": "wait"}, timeout=TIMEOUT
    ) as reply:
        lines = reply.iter_lines()  # kept open: a closed iterator closes the response
        for line in lines:
            if line.startswith("event: tool"):
                break
        # Hang up once the tool runs: under load the pass may still be recording the call's
        # intent when the `tool` event arrives, and cancelled then, its tool never starts.
        assert tool_running.wait(TIMEOUT)
    assert tool_cancelled.wait(TIMEOUT)  # the disconnect reached the pass and cancelled its tool
    deadline = time.monotonic() + TIMEOUT
    # The pass was recorded as running when its tool started; it records its cancellation just
    # after the tool is cancelled.
    while [p.status for p in store.pending("bob")] != ["cancelled"]:
        assert time.monotonic() < deadline, store.pending("bob")
        time.sleep(0.05)
    assert store.conversation("bob").rows == ()


def test_a_disconnect_while_the_model_streams_cancels_the_pass(
    service: tuple[Served, Store],
) -> None:
    """No tool runs here: the pass waits on the model's stream when the client hangs up. The
    pass must end `cancelled` (not stay `running`), with nothing committed."""
    served, store = service
    stall_asked.clear()
    with httpx.stream(
        "POST", f"{served.url}/chat/carol", json={"message": "stall"}, timeout=TIMEOUT
    ) as reply:
        assert reply.status_code == 200
        # Hang up once the pass waits on the model (before that, under load, the pass may not
        # have opened its conversation yet: cancelled then, it has nothing to record).
        assert stall_asked.wait(TIMEOUT)
    deadline = time.monotonic() + TIMEOUT
    while [p.status for p in store.pending("carol")] != ["cancelled"]:
        assert time.monotonic() < deadline, store.pending("carol")
        time.sleep(0.05)
    assert store.conversation("carol").rows == ()


@pytest.mark.parametrize(
    ("body", "says"),
    [(b"{not json", "not JSON"), (b"\xff\xfe", "not JSON"), (b"", "not JSON")],
)
def test_a_malformed_body_is_a_400_that_says_why(
    service: tuple[Served, Store], body: bytes, says: str
) -> None:
    served, _ = service
    for path in ("/chat/dave", "/approve/dave"):
        reply = httpx.post(
            f"{served.url}{path}",
            content=body,
            headers={"content-type": "application/json"},
            timeout=TIMEOUT,
        )
        assert reply.status_code == 400, reply.text
        assert says in reply.json()["error"]


def _raw(url: str, head: str, body: bytes = b"") -> tuple[int, dict[str, Any]]:
    """Send a raw request (what httpx will not send: a lying or unfinished body) and read the
    reply; the socket timeout only guards against a hang."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=TIMEOUT) as sock:
        sock.sendall(head.encode() + body)
        data = b""
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, json.loads(data.split(b"\r\n\r\n", 1)[1])


def test_a_body_over_the_limit_is_a_413_before_it_is_read(
    service: tuple[Served, Store],
) -> None:
    served, _ = service
    limit = chat_app.MAX_BODY_BYTES
    # Content-Length says 1 GB and no byte follows: only the header can have been checked.
    status, reply = _raw(
        served.url,
        "POST /chat/erin HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        "content-length: 1000000000\r\n\r\n",
    )
    assert status == 413 and str(limit) in reply["error"]
    # A chunked body (no Content-Length) past the limit whose end never comes: the service
    # answers once it has counted more than the limit, without waiting for the rest.
    chunk = b"x" * 8192
    framed = (f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n") * (limit // len(chunk) + 2)
    status, reply = _raw(
        served.url,
        "POST /chat/erin HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        "transfer-encoding: chunked\r\n\r\n",
        framed,
    )
    assert status == 413 and str(limit) in reply["error"]
    big = httpx.post(f"{served.url}/chat/erin", content=b"x" * (limit + 1), timeout=TIMEOUT)
    assert big.status_code == 413
    assert store_untouched(service[1], "erin")


def store_untouched(store: Store, key: str) -> bool:
    """Nothing of `key` is stored: no rows, no pass."""
    return store.conversation(key).rows == () and store.pending(key) == []


def _in_chromium(url: str, expression: str, profile: Path) -> Any:
    """Open `url` in headless Chromium and return the value of `expression` (a promise is
    awaited), over the DevTools protocol on a pipe (fds 3 and 4): the test waits for the page's
    own condition instead of a fixed time budget."""
    assert CHROMIUM is not None
    commands, chromium_in = os.pipe()  # chromium reads commands on its fd 3
    chromium_out, replies = os.pipe()  # and writes replies on its fd 4

    def wire() -> None:
        os.dup2(commands, 3)
        os.dup2(replies, 4)

    proc = subprocess.Popen(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--disable-background-networking", f"--user-data-dir={profile}",
         "--remote-debugging-pipe", "about:blank"],
        pass_fds=(3, 4), preexec_fn=wire, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    os.close(commands)
    os.close(replies)
    pending = b""
    sent = 0

    def call(method: str, params: dict[str, Any], session: str | None = None) -> Any:
        nonlocal pending, sent
        sent += 1
        message: dict[str, Any] = {"id": sent, "method": method, "params": params}
        if session is not None:
            message["sessionId"] = session
        os.write(chromium_in, json.dumps(message).encode() + b"\0")
        while True:
            while b"\0" not in pending:
                chunk = os.read(chromium_out, 65536)
                assert chunk, "chromium closed its DevTools pipe"
                pending += chunk
            raw, pending = pending.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == sent:
                if "error" in reply:
                    raise RuntimeError(reply["error"]["message"])
                return reply["result"]

    try:
        target = call("Target.createTarget", {"url": url})["targetId"]
        session = call("Target.attachToTarget", {"targetId": target, "flatten": True})
        deadline = time.monotonic() + TIMEOUT
        while True:
            try:  # the first context (about:blank) is replaced by the page's: ask again
                result = call(
                    "Runtime.evaluate",
                    {"expression": expression, "awaitPromise": True, "returnByValue": True},
                    session["sessionId"],
                )
                break
            except RuntimeError as err:
                if "context was destroyed" not in str(err) or time.monotonic() > deadline:
                    raise
        assert "exceptionDetails" not in result, result
        return result["result"]["value"]
    finally:
        os.close(chromium_in)
        proc.kill()
        proc.wait()
        os.close(chromium_out)


#: Resolves with the page's text once its status line says the pass finished (or says why not).
_PAGE_DONE = """new Promise((resolve, reject) => {
  const started = Date.now();
  const poll = setInterval(() => {
    const status = document.getElementById("status").textContent;
    if (status.startsWith("done: final_answer") || status.startsWith("error")) {
      clearInterval(poll);
      resolve(document.body.innerText);
    } else if (Date.now() - started > 100000) {
      clearInterval(poll);
      reject(new Error("the page did not finish: " + status));
    }
  }, 50);
})"""


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (.ci/run installs it)")
def test_the_page_chats_and_approves_in_headless_chromium(
    service: tuple[Served, Store], tmp_path: Path
) -> None:
    served, store = service
    url = f"{served.url}/?key=web&say={quote('deploy staging')}&approve=1"
    text = _in_chromium(url, _PAGE_DONE, tmp_path / "profile")
    assert "Done: deployed to staging" in text
    assert "done: final_answer (version 4)" in text
    rows = store.conversation("web").rows
    assert [r.kind for r in rows] == ["user", "assistant", "tool_result", "assistant"]


@pytest.mark.parametrize(
    ("method", "path", "body", "says"),
    [
        ("POST", "/chat/dave", b"[" * 30_000 + b"]" * 30_000, "nested too deep"),
        ("POST", "/approve/dave", b'{"a":' * 10_000 + b"1" + b"}" * 10_000, "nested too deep"),
        ("POST", "/chat/dave", b'{"message": "\\ud800"}', "lone surrogate"),
        ("POST", "/chat/a%00b", b'{"message": "hi"}', "NUL"),
        ("POST", "/chat/" + "k" * 600, b'{"message": "hi"}', "at most"),
        ("POST", "/approve/a%00b", b'{"approvals": {}}', "NUL"),
        ("GET", "/conversations/a%00b", b"", "NUL"),
        ("GET", "/conversations/" + "k" * 600, b"", "at most"),
    ],
)
def test_a_hostile_body_or_key_is_a_400_before_anything_streams(
    service: tuple[Served, Store], method: str, path: str, body: bytes, says: str
) -> None:
    served, _ = service
    reply = httpx.request(
        method,
        f"{served.url}{path}",
        content=body or None,
        headers={"content-type": "application/json"},
        timeout=TIMEOUT,
    )
    assert reply.status_code == 400, reply.text
    assert says in reply.json()["error"]
