"""Lineage: which sessions a session was made from, and by which operator.

Each session holds a `LineageNode`. A node keeps strong references to its parents (so ancestors
stay walkable) and weak references to its children (so descendants are walkable while they live,
and a long fan-out never accumulates a process-wide registry). Pure values, no I/O.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from treadle.session.usage import Usage

__all__ = ["LineageNode", "record_usage", "shared_usage"]

_children_lock = threading.Lock()


def _after_fork_in_child() -> None:
    # Another parent thread may have held the lock at fork time; that thread does not exist in
    # the child, so the child would wait forever on its first derived session. The lists it
    # guarded are whole in the child (each change to one is a single append or assignment).
    global _children_lock
    _children_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)

PRUNE_FROM = 64
"""Weak references a node's children list holds before it first drops its dead ones."""


class LineageNode:
    """Where one session came from: its `id`, the `operator` that made it, its `kind`, parents."""

    __slots__ = (
        "__weakref__",
        "_children",
        "_prune_at",
        "id",
        "kind",
        "operator",
        "parents",
        "usage",
    )

    def __init__(
        self, id: str, operator: str, kind: str, parents: Iterable[LineageNode] = ()
    ) -> None:
        self.id = id
        self.operator = operator
        self.kind = kind
        self.parents: tuple[LineageNode, ...] = tuple(parents)
        self.usage: Usage | None = None
        """The session's usage once its data is known (what `merge` must not count twice)."""
        # Plain weak references to the children, made with the first child (most nodes, a
        # fan-out's outputs, never have one). One reference (without a callback) serves every
        # parent, where a `WeakSet` per parent made one reference with a callback per parent
        # and per child: 1.0 -> 0.4 µs of each submission (docs/performance.md, issue 33).
        # Dead references are dropped when the list doubles (amortised), and on reading.
        self._children: list[weakref.ref[LineageNode]] | None = None
        self._prune_at = PRUNE_FROM
        if self.parents:
            ref = weakref.ref(self)
            with _children_lock:  # appends and prunes from many threads keep every child
                for parent in self.parents:
                    children = parent._children
                    if children is None:
                        parent._children = [ref]
                    else:
                        children.append(ref)
                        if len(children) >= parent._prune_at:
                            parent._prune()

    def _prune(self) -> None:
        """Drop the references to dead children (under `_children_lock`)."""
        live = [r for r in self._children or () if r() is not None]
        self._children = live
        self._prune_at = max(PRUNE_FROM, 2 * len(live))

    @property
    def parent_ids(self) -> tuple[str, ...]:
        """Ids of the direct parents, in order."""
        return tuple(p.id for p in self.parents)

    @property
    def children(self) -> list[LineageNode]:
        """Direct children that are still alive (sorted by id for a stable order)."""
        with _children_lock:
            self._prune()
            refs = list(self._children or ())
        live = {id(n): n for n in (r() for r in refs) if n is not None}  # a parent given twice
        return sorted(live.values(), key=lambda n: n.id)

    def ancestors(self) -> list[LineageNode]:
        """Every ancestor, nearest first (breadth-first, each once)."""
        return _walk(self, lambda n: n.parents)

    def descendants(self) -> list[LineageNode]:
        """Every living descendant, nearest first (breadth-first, each once)."""
        return _walk(self, lambda n: n.children)

    def to_mermaid(self) -> str:
        """The graph of this node's ancestors and descendants as Mermaid `graph TD` text."""
        nodes = {n.id: n for n in [*self.ancestors(), self, *self.descendants()]}
        lines = ["graph TD"]
        for node in nodes.values():
            marker = ":::focus" if node is self else ""
            lines.append(f'    {_mid(node)}["{node.operator}<br/>{node.id[:8]}"]{marker}')
        for node in nodes.values():
            for parent in node.parents:
                if parent.id in nodes:
                    lines.append(f"    {_mid(parent)} --> {_mid(node)}")
        lines.append("    classDef focus stroke-width:3px")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"LineageNode(id={self.id!r}, operator={self.operator!r}, kind={self.kind!r}, "
            f"parents={list(self.parent_ids)!r})"
        )


def _mid(node: LineageNode) -> str:
    return "s_" + "".join(c if c.isalnum() else "_" for c in node.id)


def _walk(
    start: LineageNode, next_of: Callable[[LineageNode], Iterable[LineageNode]]
) -> list[LineageNode]:
    seen: set[int] = {id(start)}
    out: list[LineageNode] = []
    queue: deque[LineageNode] = deque([start])
    while queue:
        node = queue.popleft()
        for nxt in next_of(node):
            if id(nxt) not in seen:
                seen.add(id(nxt))
                out.append(nxt)
                queue.append(nxt)
    return out


def shared_usage(a: LineageNode, b: LineageNode) -> Usage:
    """The usage of the nearest common ancestor (or self) that both sides' usage includes."""
    from treadle.session.usage import Usage

    mine = {id(n) for n in (a, *a.ancestors())}
    shared = [n.usage for n in (b, *b.ancestors()) if id(n) in mine and n.usage is not None]
    return max(shared, key=lambda u: (u.total_tokens, u.requests), default=Usage())


def record_usage(node: LineageNode, value: Any) -> None:
    """Done-callback of a lazy session's value: remember its usage on its lineage node."""
    try:
        if value.exception() is None:
            node.usage = value.result(0).usage
    except BaseException:  # cancelled or failed: nothing was spent that merge could double
        return
