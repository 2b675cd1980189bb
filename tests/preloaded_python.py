"""A Python that has already imported Treadle and runs scripts, each in its own forked child.

The docs test runs ~110 code blocks and examples, each alone as a reader would (`python
block.py`). Started fresh, each interpreter spends most of its time importing Treadle, pydantic,
the MCP SDK and OpenTelemetry (about 0.5 CPU-second; the blocks themselves take little): over a
minute of CPU in every `make test`. This process imports them once, then forks one child per
script, so each script still runs alone, in its own process, with its own `__main__`, working
directory, standard streams and exit code, as `python script.py` would.

Two differences from a fresh interpreter are removed on purpose: the `treadle` package gets back
the attributes a bare `import treadle` gives it (so a block that uses `treadle.testing` without
importing it still fails, as it would for a reader), and the child's `sys.path[0]` is the
script's directory.

Run as `python preloaded_python.py` (with the environment the scripts should see). Protocol, one
JSON object a line: the parent writes `{"script", "cwd", "stdout", "stderr"}` (paths); this
process answers `{"pid": n}` once the child is forked and `{"returncode": n}` when it has exited
(negative: killed by that signal, as `subprocess` reports it).
"""

from __future__ import annotations

import builtins
import contextlib
import gc
import importlib
import json
import os
import sys
import threading
import types
from typing import Any

# What the docs and examples import (a module left off only costs its import in each child):
# importing them here is the whole saving.
PRELOAD = (
    "treadle.agents",
    "treadle.distributed",
    "treadle.errors",
    "treadle.evals",
    "treadle.llm",
    "treadle.loop",
    "treadle.mcp",
    "treadle.persist",
    "treadle.runtime",
    "treadle.sandbox",
    "treadle.session",
    "treadle.stores",
    "treadle.telemetry",
    "treadle.testing",
    "treadle.testing.scripted",
    "treadle.tools",
    "mcp",
    "mcp.client.stdio",
    "mcp.client.streamable_http",
    "mcp.server",
    "opentelemetry.sdk.trace",
    "opentelemetry.sdk.metrics",
)


def _preload() -> set[str]:
    import treadle

    bare = set(vars(treadle))  # what a reader's `import treadle` has
    for name in treadle.__all__:
        getattr(treadle, name)
    for module in PRELOAD:
        # an optional extra not installed: its blocks import it themselves
        with contextlib.suppress(ImportError):
            importlib.import_module(module)
    return bare


def _become_script(request: dict[str, Any], bare: set[str]) -> None:
    """In the forked child: turn this process into `python <script>` and run it."""
    import treadle

    for name in set(vars(treadle)) - bare:
        delattr(treadle, name)
    with open(os.devnull, "rb") as null:
        os.dup2(null.fileno(), 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        with open(path, "wb") as out:
            os.dup2(out.fileno(), fd)
    sys.stdin = open(os.devnull)  # noqa: SIM115 - the script's stdin for the rest of its life
    script = request["script"]
    os.chdir(request["cwd"])
    sys.argv = [script]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    main = types.ModuleType("__main__")
    main.__file__ = script
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    with open(script, "rb") as f:
        code = compile(f.read(), script, "exec")
    exec(code, main.__dict__)


def serve() -> None:
    """Answer requests until stdin closes; a child leaves this loop through `SystemExit` or its
    own exception, which the interpreter then reports as it would for `python script.py`."""
    bare = _preload()
    if threading.active_count() != 1:
        # fork() copies only the calling thread: a preloaded module that starts a thread makes
        # forked children unsafe, so refuse rather than run the docs on a broken copy.
        sys.exit(f"preloaded_python: a preloaded module started a thread: {threading.enumerate()}")
    # Every child would otherwise walk (and so copy, page by page) the whole preloaded heap in
    # its collections and at exit: 0.29 CPU-second a child, against 0.04 with the heap frozen.
    gc.freeze()
    reply = sys.stdout
    for line in sys.stdin:
        request = json.loads(line)
        reply.flush()
        pid = os.fork()
        if pid == 0:
            _become_script(request, bare)
            sys.exit(0)
        reply.write(json.dumps({"pid": pid}) + "\n")
        reply.flush()
        _, status = os.waitpid(pid, 0)
        reply.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")
        reply.flush()


if __name__ == "__main__":
    serve()
