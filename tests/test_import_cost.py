"""What the README's first import loads: the HTTP stack and the sandbox wait for first use.

`from treadle import Session, Provider, run_session_loop, tool` sits at the top of every program;
httpx (about 60 ms), aiohttp, the sandbox layer and OpenTelemetry must not load with it (the
benchmark's S5 measures the time; this keeps the cause from coming back).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HEAVY = ("httpx", "aiohttp", "treadle.sandbox", "opentelemetry", "mcp", "rich")


def test_the_first_import_loads_nothing_heavy() -> None:
    code = (
        "import sys\n"
        "from treadle import Session, Provider, run_session_loop, tool\n"
        f"heavy = {HEAVY!r}\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy or m in heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_passes_never_load_aiohttp() -> None:
    # Completions go over Treadle's own HTTP/1.1 lane: a program that only runs passes, whole or
    # streamed, never pays aiohttp's import (about 170 ms).
    code = (
        "import sys\n"
        "from treadle import Session, Provider, run_session_loop\n"
        "from treadle.testing import FakeOpenAIServer\n"
        "with FakeOpenAIServer('echo') as server:\n"
        "    for stream in (False, True):\n"
        "        provider = Provider(model='m', base_url=server.base_url, api_key='k',"
        " stream=stream)\n"
        "        out = run_session_loop(Session.from_user_message('hi'),"
        " Session.from_agent_prompt('sys'), agent_provider=provider)\n"
        "        assert out.stop_reason == 'final_answer', out.stop_reason\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'aiohttp'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_importing_treadle_mcp_waits_for_a_name_to_load_the_sdk() -> None:
    # The SDK costs most of a second to import: `import treadle.mcp` leaves it to the first use.
    code = (
        "import sys\n"
        "import treadle.mcp\n"
        "before = sorted(m for m in sys.modules if m.split('.')[0] in ('mcp', 'mcp_types'))\n"
        "server = treadle.mcp.MCPServer\n"
        "print(before, 'mcp' in sys.modules, server.__module__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["[]", "True", "treadle.mcp.server"], out.stdout


def test_deferred_schemas_build_once_when_threads_race_to_first_use() -> None:
    # Wire and row models build their schemas on first use (not at import); eight threads that
    # validate at once in a fresh process must all get the built validators, none an error.
    code = (
        "import threading\n"
        "from treadle.llm.wire import ChatCompletion, ChatCompletionChunk\n"
        "from treadle.session.rows import ChunkRow\n"
        "gate, errors = threading.Barrier(8), []\n"
        "reply = {'choices': [{'index': 0, 'message': {'role': 'assistant', 'content': 'hi',"
        " 'tool_calls': [{'id': 'c', 'type': 'function', 'function': {'name': 'f',"
        " 'arguments': '{}'}}]}, 'finish_reason': 'stop'}]}\n"
        "def work():\n"
        "    gate.wait()\n"
        "    try:\n"
        "        assert ChatCompletion.model_validate(reply).message.content == 'hi'\n"
        "        ChatCompletionChunk.model_validate_json(b'{\"choices\": []}')\n"
        "        ChunkRow('assistant', {'content': None, 'tool_calls': [{'id': 'c',"
        " 'function': {'name': 'f', 'arguments': '{}'}}]})\n"
        "    except Exception as exc:\n"
        "        errors.append(repr(exc))\n"
        "threads = [threading.Thread(target=work) for _ in range(8)]\n"
        "for t in threads: t.start()\n"
        "for t in threads: t.join()\n"
        "print(errors)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


_RACE_DIRECT = r"""
import sys, threading
sys.setswitchinterval(1e-6)
from treadle.llm.accumulate import _validate_completion
from treadle.llm.chunk_parse import parse_chunk
from treadle.llm.client import _parse_completion
from treadle.tools import tool

@tool
def add(a: int, b: int) -> int:
    "Add."
    return a + b

gate, errors = threading.Barrier(8), []
reply = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                      "finish_reason": "stop"}]}
import json
raw = json.dumps(reply).encode()

def work():
    gate.wait()
    try:
        assert _validate_completion(reply).choices[0].message.content == "hi"
        assert parse_chunk(b'{"choices": []}', None, None)[0].choices == []
        assert _parse_completion(raw, None).choices[0].message.content == "hi"
        assert add.validate({"a": "1", "b": 2}) == {"a": 1, "b": 2}
    except Exception as exc:
        errors.append(repr(exc))

threads = [threading.Thread(target=work) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
print(errors)
"""


def test_direct_validator_calls_build_deferred_schemas_once_when_threads_race() -> None:
    # The stream's final check, a typed chunk, a whole reply and a tool's arguments call the
    # model's validator itself, not `model_validate`: its first use is pydantic's stand-in,
    # which must build the schema once under `DeferredModel`'s lock for eight racing threads.
    for _ in range(3):
        out = subprocess.run(
            [sys.executable, "-c", _RACE_DIRECT], capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_stores_transcripts_and_event_streams_load_with_the_first_pass_using_them() -> None:
    """Passes without `store=`, `persist=` or `stream_session_loop` never need them (issue 33's
    import target: about 30 ms of CPU between them)."""
    lazy = ("treadle.stores", "treadle.persist", "treadle.runtime.streams", "anyio.streams")
    for names in ("Provider, Session, run_session_loop", "Agent", "Agent, map"):
        code = (
            "import sys\n"
            f"from treadle import {names}\n"
            f"lazy = {lazy!r}\n"
            "print(sorted(m for m in sys.modules if m.startswith(lazy)))\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == "[]", (names, out.stdout)


def test_the_readme_import_leaves_the_engine_to_the_first_pass() -> None:
    """The engine, the runtime (and asyncio), the tool and model layers load with the first
    pass (issue 33's 0.2 s import target: about half of that import's CPU); the pass then runs."""
    code = (
        "import sys\n"
        "from treadle import Provider, Session, run_session_loop\n"
        "later = ('asyncio', 'treadle.runtime', 'treadle.loop.engine', 'treadle.loop.planning',"
        " 'treadle.tools', 'treadle.llm.turn')\n"
        "print(sorted(m for m in sys.modules if m.startswith(later)))\n"
        "from treadle.testing import FakeOpenAIServer\n"
        "with FakeOpenAIServer('echo') as server:\n"
        "    provider = Provider(model='m', base_url=server.base_url, api_key='k')\n"
        "    for _ in range(2):\n"
        "        out = run_session_loop(Session.from_user_message('hi'),"
        " Session.from_agent_prompt('sys'), agent_provider=provider)\n"
        "        print(out.stop_reason)\n"
        "import treadle.loop.api as api, treadle.loop.engine as engine\n"
        "print(api.run_pass is engine.run_pass)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:4] == ["[]", "final_answer", "final_answer", "True"], out.stdout


def test_a_first_call_stand_in_forwards_once_then_steps_aside() -> None:
    import json
    import threading

    from treadle.loop.first_call import on_first_call

    namespace: dict[str, object] = {}
    stand_in = on_first_call(namespace, "json", "dumps")
    namespace["dumps"] = stand_in
    gate, results = threading.Barrier(8), []

    def work(n: int) -> None:
        gate.wait()
        results.append(stand_in({"n": n}, sort_keys=True))

    threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == sorted(json.dumps({"n": n}) for n in range(8))
    assert namespace["dumps"] is json.dumps
    missing = on_first_call(namespace, "json", "no_such_name")
    try:
        missing()
    except AttributeError:
        pass
    else:
        raise AssertionError("a stand-in for a missing name must raise AttributeError")


def test_a_patch_in_place_during_the_first_pass_is_not_kept_by_the_stand_in() -> None:
    """Issue 33: patching `treadle.runtime.submit` for the first pass (a test's monkeypatch) and
    undoing it left `treadle.loop.api.submit` bound to the patch for good. The stand-in resolves
    the function from its home module, so the loop ends up with the real one."""
    code = (
        "import treadle.runtime as rt, treadle.runtime.background as background\n"
        "import treadle.loop.api as api\n"
        "from treadle import Provider, Session, run_session_loop\n"
        "from treadle.testing import FakeOpenAIServer\n"
        "real = rt.submit\n"
        "with FakeOpenAIServer('echo') as server:\n"
        "    provider = Provider(model='m', base_url=server.base_url, api_key='k')\n"
        "    rt.submit = lambda coro: real(coro)\n"
        "    for text in ('a', 'b'):\n"
        "        run_session_loop(Session.from_user_message(text),"
        " Session.from_agent_prompt('sys'), agent_provider=provider).final_text\n"
        "        rt.submit = real\n"
        "print(api.submit is real is background.submit)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True", out.stdout


def test_a_stand_in_does_not_keep_a_patch_of_its_home_module(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import json

    from treadle.loop.first_call import on_first_call

    real = json.dumps
    namespace: dict[str, object] = {}
    stand_in = on_first_call(namespace, "json", "dumps")
    namespace["dumps"] = stand_in
    monkeypatch.setattr(json, "dumps", lambda value: "patched")
    assert stand_in(1) == "patched"  # forwarded to what is there now...
    assert namespace["dumps"] is stand_in  # ...but not kept: it is not json's own function
    monkeypatch.undo()
    assert stand_in(1) == "1" and namespace["dumps"] is real


_FORK_WHILE_BUILDING = r"""
import os, sys, threading, time
from treadle.session import deferred
from treadle.llm.wire import ChatCompletion

held, release = threading.Event(), threading.Event()

def builder():  # another thread inside a build when the process forks
    with deferred._BUILD_LOCK:
        held.set()
        release.wait()

thread = threading.Thread(target=builder)
thread.start()
held.wait()
pid = os.fork()
if pid == 0:  # the child: its first validation builds under a lock nobody here holds
    reply = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                          "finish_reason": "stop"}]}
    ok = ChatCompletion.model_validate(reply).choices[0].message.content == "hi"
    os._exit(0 if ok else 3)
release.set()
thread.join()
for _ in range(600):  # the child hung if it has not exited within a minute
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        print("exit", os.waitstatus_to_exitcode(status))
        break
    time.sleep(0.1)
else:
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    print("hung")
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX")
def test_a_child_forked_while_another_thread_builds_a_schema_builds_its_own() -> None:
    # The schema-build lock held by a thread the child does not have would make the child's
    # first validation wait forever.
    out = subprocess.run(
        [sys.executable, "-c", _FORK_WHILE_BUILDING], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "exit 0", out.stdout + out.stderr
