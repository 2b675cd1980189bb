"""The example chat service (examples/chat_service), served by uvicorn on 127.0.0.1 and driven
over real HTTP (server-sent events), and once by headless Chromium running its page."""

from __future__ import annotations

import importlib.util
import json
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


@tool
async def wait_for_operator() -> str:
    """Wait until someone answers (the tests cancel it by disconnecting)."""
    try:
        await anyio.sleep_forever()
    finally:
        tool_cancelled.set()
    return "never"


def model(request: dict[str, Any]) -> Any:
    last = request["messages"][-1]
    if last["role"] == "user" and last["content"] == "wait":
        return Reply.tool_call("wait_for_operator", {})
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
    with httpx.stream(
        "POST", f"{served.url}/chat/bob", json={"message": "wait"}, timeout=TIMEOUT
    ) as reply:
        for line in reply.iter_lines():
            if line.startswith("event: tool"):
                break  # the tool runs: hang up now
    assert tool_cancelled.wait(TIMEOUT)  # the disconnect reached the pass and cancelled its tool
    deadline = time.monotonic() + TIMEOUT
    # The pass was recorded as running when its tool started; it records its cancellation just
    # after the tool is cancelled.
    while [p.status for p in store.pending("bob")] != ["cancelled"]:
        assert time.monotonic() < deadline, store.pending("bob")
        time.sleep(0.05)
    assert store.conversation("bob").rows == ()


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (.ci/run installs it)")
def test_the_page_chats_and_approves_in_headless_chromium(
    service: tuple[Served, Store], tmp_path: Path
) -> None:
    served, store = service
    assert CHROMIUM is not None
    url = f"{served.url}/?key=web&say={quote('deploy staging')}&approve=1"
    proc = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--disable-background-networking", f"--user-data-dir={tmp_path / 'profile'}",
         "--enable-logging=stderr", "--v=0", "--virtual-time-budget=30000", "--dump-dom", url],
        capture_output=True, text=True, timeout=TIMEOUT, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [line for line in proc.stderr.splitlines() if ":CONSOLE" in line] == []
    assert "Done: deployed to staging" in proc.stdout
    assert "done: final_answer (version 4)" in proc.stdout
    rows = store.conversation("web").rows
    assert [r.kind for r in rows] == ["user", "assistant", "tool_result", "assistant"]
