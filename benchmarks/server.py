"""The fake OpenAI server in its own process, pinned to its own CPU, with CPU accounting.

`ServerProcess` starts `python -m benchmarks.server ...` (the project's `FakeOpenAIServer` with
the built-in `tool_loop` script, or the `parallel` script below), reads the base URL it prints and
reports the CPU seconds it used, so every result can say whether the server was the bottleneck.
It must never share a CPU with the client when the machine has two.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
from typing import Any

CLIENT_CPU = 0
SERVER_CPU = 1
_TICKS = os.sysconf("SC_CLK_TCK")


def can_pin() -> bool:
    """True when the client and the server can each have a CPU of their own."""
    return hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) >= 2


def machine_cpus() -> list[int]:
    """Every CPU of the machine (not this process's affinity, which the harness narrows)."""
    return list(range(os.cpu_count() or 1))


def unpin(pid: int) -> None:
    """Let `pid` (0: this process) run on any CPU of the machine, where affinity exists.

    `can_pin()` cannot guard this: it reads the caller's own affinity, and a process the
    harness pinned to the client CPU sees one CPU, so a check through it unpinned nothing
    (scenario 13's workers inherited the driver's CPU and ran on it, three processes on one CPU).
    """
    if hasattr(os, "sched_setaffinity") and len(machine_cpus()) >= 2:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(pid, machine_cpus())


def pin(pid: int, cpu: int) -> None:
    """Pin `pid` to `cpu` when the machine allows it (no-op otherwise)."""
    if hasattr(os, "sched_setaffinity") and len(machine_cpus()) >= 2:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(pid, {cpu})


def yield_to_clients() -> None:
    """Run this process (and the threads it starts) as `SCHED_BATCH`: its wake-ups no longer
    preempt the process running on its CPU, which then runs to the end of its slice or until it
    waits, and the server answers what came in meanwhile at once.

    For a scenario that must put a client on the server's CPU (scenario 13's second worker on
    a 2-CPU machine): the fake server stands for a model on another machine, whose requests
    would not interrupt the client. Woken on every request, it preempted the worker sharing its
    CPU thousands of times a second and the worker's CPU a completion rose by 10-20% with the
    cache refills (docs/performance.md, S13 placement). No effect on a CPU the server has alone.
    A no-op where the policy does not exist."""
    if hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_BATCH"):
        with contextlib.suppress(OSError):
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))


def proc_cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of `pid` so far, from /proc (0.0 where unavailable)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICKS


class ServerProcess:
    """A fake server subprocess: `with ServerProcess(script="tool_loop", rounds=3) as s: s.url`."""

    def __init__(
        self,
        script: str = "tool_loop",
        *,
        rounds: int = 3,
        latency_ms: float = 0,
        calls: int = 8,
        rate_limits: tuple[int, int, float] | None = None,
        batch: bool = False,
    ) -> None:
        """`rate_limits`: (requests, tokens, window seconds) the server enforces (None: none).
        `batch`: the server runs as `SCHED_BATCH` (see `yield_to_clients`)."""
        self.args = [
            "--script",
            script,
            "--rounds",
            str(rounds),
            "--latency-ms",
            str(latency_ms),
            "--calls",
            str(calls),
        ]
        if rate_limits is not None:
            rpm, tpm, window = rate_limits
            self.args += ["--rpm", str(rpm), "--tpm", str(tpm), "--rate-window", str(window)]
        if batch:
            self.args.append("--batch")
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""

    def __enter__(self) -> ServerProcess:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.server", *self.args],
            stdout=subprocess.PIPE,
            text=True,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        )
        pin(self.proc.pid, SERVER_CPU)
        assert self.proc.stdout is not None
        self.url = self.proc.stdout.readline().strip()
        if not self.url.startswith("http"):
            self.__exit__()
            raise RuntimeError("the fake server did not start")
        return self

    def cpu(self) -> float:
        """CPU seconds the server has used so far."""
        return proc_cpu_seconds(self.proc.pid) if self.proc is not None else 0.0

    def stats(self) -> dict[str, Any]:
        """The server's counters (`GET /stats`): requests, and with limits the 429s it sent."""
        import json
        import urllib.request

        with urllib.request.urlopen(self.url + "/stats", timeout=10) as reply:
            data: dict[str, Any] = json.loads(reply.read())
        return data

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            if self.proc.stdout is not None:
                self.proc.stdout.close()
            self.proc = None


def parallel_script(rounds: int, calls: int, tool_name: str = "nap") -> Any:
    """A script asking for `calls` parallel calls of `tool_name` per reply, `rounds` times."""
    from treadle.testing import Reply

    def script(request: dict[str, Any]) -> Reply:
        done = sum(1 for m in request.get("messages", ()) if m.get("role") == "assistant")
        if done < rounds:
            return Reply.tool_calls_of([(tool_name, {"i": i}) for i in range(calls)])
        return Reply.text(f"finished after {done} rounds")

    return script


def uneven_script(rounds: int) -> Any:
    """Passes whose user message starts with `long` call `noop` `rounds` times, the others
    answer at once: the load of a map spreads unevenly over its workers."""
    from treadle.testing import Reply

    def script(request: dict[str, Any]) -> Reply:
        messages = request.get("messages", ())
        done = sum(1 for m in messages if m.get("role") == "tool")
        user = next((m.get("content") for m in messages if m.get("role") == "user"), "")
        if str(user).startswith("long") and done < rounds:
            return Reply.tool_call("noop", {"round": done + 1})
        return Reply.text(f"finished after {done} tool rounds")

    return script


def main() -> None:
    """Serve until terminated, printing the base URL first."""
    parser = argparse.ArgumentParser(description="Fake OpenAI server for the benchmarks.")
    parser.add_argument("--script", default="tool_loop", help="tool_loop, parallel or uneven")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=8, help="calls per reply (parallel)")
    parser.add_argument("--latency-ms", type=float, default=0.0)
    parser.add_argument("--rpm", default=None, help="requests per rate window")
    parser.add_argument("--tpm", default=None, help="tokens per rate window")
    parser.add_argument("--rate-window", default="60", help="seconds standing for a minute")
    parser.add_argument("--batch", action="store_true", help="run as SCHED_BATCH")
    args = parser.parse_args()
    if args.batch:
        yield_to_clients()
    limits = []
    if args.rpm is not None:
        limits += ["--rpm", args.rpm, "--tpm", args.tpm, "--rate-window", args.rate_window]
    if args.script == "uneven":
        from treadle.testing import FakeOpenAIServer

        rpm, tpm = (None, None) if args.rpm is None else (int(args.rpm), int(args.tpm))
        uneven = FakeOpenAIServer(
            uneven_script(args.rounds),
            latency_ms=args.latency_ms,
            requests_per_minute=rpm,
            tokens_per_minute=tpm,
            rate_window=float(args.rate_window),
        )
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(uneven.serve_forever())
        return
    if args.script != "parallel":
        from treadle.testing.fake_server import main as serve

        serve(
            [
                "--script",
                args.script,
                "--rounds",
                str(args.rounds),
                "--latency-ms",
                str(args.latency_ms),
                *limits,
            ]
        )
        return
    from treadle.testing import FakeOpenAIServer

    server = FakeOpenAIServer(parallel_script(args.rounds, args.calls), latency_ms=args.latency_ms)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(server.serve_forever())


if __name__ == "__main__":
    main()
