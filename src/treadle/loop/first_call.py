"""Functions whose module loads on their first call (how `treadle.loop.api` stays light).

`from treadle import run_session_loop` should not pay for the engine, the runtime thread's
asyncio machinery and the tool layer before the first pass (docs/performance.md, imports). A
name bound with `on_first_call` is a stand-in: its first call imports the real function, puts it
in the caller's module namespace under the same name (so later calls go straight to it, with no
cost of their own) and forwards the call. Concurrent first calls each forward correctly: the
import lock serialises the import and rebinding a name is atomic.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, MutableMapping
from typing import Any


def on_first_call(
    namespace: MutableMapping[str, Any], module: str, name: str
) -> Callable[..., Any]:
    """A stand-in for `module.name` bound as `name` in `namespace` (a module's `globals()`)."""

    def first_call(*args: Any, **kwargs: Any) -> Any:
        real = getattr(importlib.import_module(module), name)
        namespace[name] = real
        return real(*args, **kwargs)

    first_call.__name__ = first_call.__qualname__ = name
    first_call.__doc__ = f"Loads `{module}` and calls its `{name}` (first call only)."
    return first_call
