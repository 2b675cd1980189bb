"""Shared fixtures. Tests talk to real parts: the runtime thread, real files, real subprocesses."""

from __future__ import annotations

# CPython 3.11 keeps one AST-construction depth counter per interpreter, not per thread
# (python/cpython#106905), so two threads building ASTs at once can raise a spurious
# "AST constructor recursion depth mismatch". Hypothesis's pytest plugin imports (and pytest
# rewrites) the hypothesis package lazily at the end of the session, while Treadle's runtime and
# worker threads may still be running; importing it here, before any thread starts, removes that
# window.
import hypothesis  # noqa: F401
