"""Start-up of the `treadle` command's error paths: how long until the one error line prints.

`python benchmarks/cli_startup.py [--runs N] [--src DIR]` runs each path N times (default 9) in
a pipe and in a pseudo-terminal (where rich would load), and prints the median wall time next to
`python -c pass` (the interpreter's own floor) and the ratio to it. `--src` points at another
checkout's `src/` to compare before and after a change on the same machine, in one sitting.
"""

from __future__ import annotations

import argparse
import os
import pty
import statistics
import subprocess
import sys
import time

PATHS = {
    "bad flag": ["run", "--bogus", "hi"],
    "missing key": ["run", "hi", "--model", "m", "--base-url", "https://example.com/v1"],
    "no scheme": ["run", "hi", "--model", "m", "--base-url", "127.0.0.1:8765/v1"],
}


def _env(src: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "TREADLE_"))}
    if src:
        env["PYTHONPATH"] = src
    return env


def _pipe(argv: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run(argv, env=env, capture_output=True, check=False)
    return time.perf_counter() - started


def _tty(argv: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    pid, fd = pty.fork()
    if pid == 0:  # pragma: no cover - the child
        os.execve(argv[0], argv, env)
    try:
        while True:
            try:
                if not os.read(fd, 4096):
                    break
            except OSError:
                break
    finally:
        os.waitpid(pid, 0)
        os.close(fd)
    return time.perf_counter() - started


def main() -> None:
    """Print the median start-up of each error path, in a pipe and on a terminal."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--src", help="a checkout's src/ directory (default: the installed one)")
    args = parser.parse_args()
    env = _env(args.src)
    floor = statistics.median(_pipe([sys.executable, "-c", "pass"], env) for _ in range(args.runs))
    print(f"python -c pass: {floor * 1000:.0f} ms (median of {args.runs})")
    for name, words in PATHS.items():
        argv = [sys.executable, "-m", "treadle.cli", *words]
        for how, measure in (("pipe", _pipe), ("tty", _tty)):
            median = statistics.median(measure(argv, env) for _ in range(args.runs))
            print(f"{name:12} {how:4}: {median * 1000:6.0f} ms  ({median / floor:.1f}x the floor)")


if __name__ == "__main__":
    main()
