"""`DeferredModel`: a pydantic base whose schemas are built on first use, one build at a time.

Building a model's validator at class creation costs import time in every program (the wire and
row models are about 30 ms of `from treadle import ...`), so these models defer it
(`defer_build`). Pydantic then builds on the first validation, in whichever thread comes first,
and two threads building related models at once can see each other's half-built schemas. Every
build of a `DeferredModel` subclass therefore takes one process-wide lock: the first validation
builds, the others wait for it and then find the model complete.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from pydantic import BaseModel, ConfigDict

__all__ = ["DeferredModel"]

_BUILD_LOCK = threading.RLock()
"""Held while a deferred schema builds (re-entrant: a model's build builds the models it uses)."""


def _fresh_lock_in_child() -> None:
    # A fork while another thread builds copies the lock held by a thread the child does not
    # have: every build in the child (its first pass) would wait forever. The child's copy of a
    # half-built model is not complete, so its first use builds it again under the new lock.
    global _BUILD_LOCK
    _BUILD_LOCK = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_fresh_lock_in_child)


class DeferredModel(BaseModel):
    """An open model (unknown fields kept) whose schema builds lazily under `_BUILD_LOCK`."""

    model_config = ConfigDict(extra="allow", defer_build=True)

    @classmethod
    def model_rebuild(
        cls,
        *,
        force: bool = False,
        raise_errors: bool = True,
        _parent_namespace_depth: int = 2,
        _types_namespace: Any = None,
    ) -> bool | None:
        """`BaseModel.model_rebuild`, one build at a time across threads."""
        with _BUILD_LOCK:
            # One frame deeper than pydantic expects: its namespace lookup walks the caller's.
            return super().model_rebuild(
                force=force,
                raise_errors=raise_errors,
                _parent_namespace_depth=_parent_namespace_depth + 1,
                _types_namespace=_types_namespace,
            )
