"""What every contestant runs: the prompt, the tools and their schemas, shared constants.

Kept in one place so Treadle, the hand loops and the peers do the same work per round.
It must never import Treadle or an HTTP client.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

MODEL = "fake-model"
API_KEY = "k"
SYSTEM_PROMPT = "You are a benchmark agent. Call the tools you are asked to call, then answer."
USER_PROMPT = "Run the tool rounds, then tell me you are done."
MAX_ROUNDS = 1000
"""Upper bound on tool rounds in one pass (the server decides when to stop)."""
NAP_SECONDS = 0.1
"""How long each call of the parallel-tools scenario sleeps."""
WARMUP_PASSES = 3

NOOP_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "noop",
        "description": "Do nothing and report the round.",
        "parameters": {
            "type": "object",
            "properties": {"round": {"type": "integer"}},
            "required": ["round"],
        },
    },
}
NAP_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "nap",
        "description": "Sleep a moment.",
        "parameters": {
            "type": "object",
            "properties": {"i": {"type": "integer"}},
            "required": ["i"],
        },
    },
}


def noop_result(round: int) -> dict[str, Any]:
    """The noop tool's result."""
    return {"round": round}


def sync_nap(i: int) -> dict[str, Any]:
    """A blocking tool call."""
    time.sleep(NAP_SECONDS)
    return {"i": i}


async def async_nap(i: int) -> dict[str, Any]:
    """A non-blocking tool call."""
    await asyncio.sleep(NAP_SECONDS)
    return {"i": i}


class Stamps:
    """CPU and wall stamps taken at each tool call (transcript growth)."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def mark(self) -> None:
        """Record the current times."""
        self.wall.append(time.perf_counter())
        self.cpu.append(time.process_time())

    def result(self) -> dict[str, Any]:
        """Per-round costs: differences between consecutive stamps (the first is the start)."""
        return {
            "round_cpu": [b - a for a, b in zip(self.cpu, self.cpu[1:], strict=False)],
            "round_wall": [b - a for a, b in zip(self.wall, self.wall[1:], strict=False)],
        }
