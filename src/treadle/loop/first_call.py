"""Functions whose module loads on their first call (how `treadle.loop.api` stays light).

`from treadle import run_session_loop` should not pay for the engine, the runtime thread's
asyncio machinery and the tool layer before the first pass (docs/performance.md, imports). A
name bound with `on_first_call` is a stand-in: its first call imports the real function, puts it
in the caller's module namespace under the same name (so later calls go straight to it, with no
cost of their own) and forwards the call. Concurrent first calls each forward correctly: the
import lock serialises the import and rebinding a name is atomic.

`module` is the function's home (the module that defines it, not one that re-exports it), and
the stand-in keeps only a function defined there: a patch in place at the first call (a test's
monkeypatch of the home module or of a re-export) gets that call, then the next call looks again,
so the name never stays bound to a patch that was undone.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, MutableMapping
from typing import Any


def on_first_call(
    namespace: MutableMapping[str, Any], module: str, name: str
) -> Callable[..., Any]:
    """A stand-in for `module.name` bound as `name` in `namespace` (a module's `globals()`);
    `module` is the one that defines the function."""

    def first_call(*args: Any, **kwargs: Any) -> Any:
        real = getattr(importlib.import_module(module), name)
        if getattr(real, "__module__", None) == module:  # not a patch: keep it
            namespace[name] = real
        return real(*args, **kwargs)

    first_call.__name__ = first_call.__qualname__ = name
    first_call.__doc__ = f"Loads `{module}` and calls its `{name}` (first call only)."
    return first_call
