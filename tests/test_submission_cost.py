"""What a submitted pass keeps: its own tool set, built from the tools as they are at its call.

Issue 33 tried a cache of the last call's tool set (a fan-out submits the same tools with every
pass); it gave stale sets for a tool changed between calls, let a name clash through, and kept
dropped tools and MCP servers alive for the life of the process, so each pass builds its own
again. A bad input raises at its own call, and a tool given as a class gets an instance per pass.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import pytest

from treadle import ConfigurationError, Provider, Session, tool
from treadle.loop.planning import plan_pass
from treadle.session.lineage import LineageNode
from treadle.tools import Tool

PROVIDER = Provider(model="m", base_url="http://127.0.0.1:9/v1", api_key="k")
USER = Session.from_user_message("hi")
AGENT = Session.from_agent_prompt("be brief")


@tool
def ping() -> str:
    """Answer pong."""
    return "pong"


@tool(name="ping")
def other_ping() -> str:
    """Answer pong too."""
    return "pong"


def _tools_of(tools: Any) -> Any:
    return plan_pass(USER, AGENT, "x", agent_provider=PROVIDER, tools=tools).tools


def test_a_tool_changed_between_calls_is_seen_as_it_is_now() -> None:
    @tool
    def alpha() -> str:
        """A."""
        return "a"

    @tool
    def beta() -> str:
        """B."""
        return "b"

    tools = [alpha, beta]
    assert list(_tools_of(tools)) == ["alpha", "beta"]
    beta.name = "gamma"
    assert list(_tools_of(tools)) == ["alpha", "gamma"]
    beta.name = "alpha"  # now a clash: refused at this call
    with pytest.raises(ConfigurationError, match="two tools are named 'alpha'"):
        _tools_of(tools)


def test_a_tool_dropped_after_its_passes_is_not_kept_alive() -> None:
    import gc
    import weakref

    class Big:
        pass

    captured = Big()

    def make() -> Any:
        def probe() -> str:
            """Uses captured data."""
            return str(captured)

        return tool(probe)

    probe = make()
    _tools_of([probe])
    seen = weakref.ref(probe)
    del probe
    gc.collect()
    assert seen() is None


def test_a_bad_tool_list_raises_at_its_call_after_a_good_one_was_reused() -> None:
    assert list(_tools_of([ping])) == ["ping"]
    with pytest.raises(ConfigurationError, match="two tools are named 'ping'"):
        _tools_of([ping, other_ping])
    with pytest.raises(ConfigurationError, match="a tool must be a function or a Tool"):
        _tools_of([ping, 3])
    assert list(_tools_of([ping])) == ["ping"]


def test_other_tools_get_their_own_set() -> None:
    first = _tools_of([ping])
    assert _tools_of([other_ping]) is not first
    assert _tools_of([other_ping])["ping"] is other_ping
    assert list(_tools_of(None)) == []


class Counter(Tool):
    """A tool class: each pass gets its own instance, which may keep state."""

    name = "counter"
    description = "Count this pass's calls."
    parameters: dict[str, Any] = {"type": "object", "properties": {}}

    def __init__(self) -> None:
        self.calls = 0

    def validate(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """No arguments."""
        return {}

    async def invoke(self, arguments: Mapping[str, Any], *, context: Any) -> Any:
        """Count."""
        self.calls += 1
        return self.calls


def test_a_tool_class_is_instantiated_per_pass() -> None:
    first, second = _tools_of([Counter])["counter"], _tools_of([Counter])["counter"]
    assert isinstance(first, Counter)
    assert first is not second


def test_a_node_without_children_lists_none_and_children_from_threads_are_all_kept() -> None:
    parent = LineageNode("p", "new", "user")
    assert parent.children == []
    assert parent.descendants() == []
    kids: list[LineageNode] = []
    lock = threading.Lock()

    def derive(i: int) -> None:
        for j in range(50):
            node = LineageNode(f"c{i}-{j:02d}", "fork", "user", [parent])
            with lock:
                kids.append(node)

    threads = [threading.Thread(target=derive, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(parent.children) == 400
