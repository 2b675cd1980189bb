"""Frozen slotted dataclasses built from all their field values, without `__init__`'s cost.

A frozen dataclass's `__init__` sets every field with `object.__setattr__` (its own
`__setattr__` refuses), about 1.7 k instructions a field in CPython 3.11; a plain slot store
costs a few dozen. A process pool's driver builds such values for every outcome a worker sends:
the `PassOutcome`, a `RequestUsage` per completion, the output's `Usage` and `SessionData`
(docs/performance.md, issue 33, "the driver's frozen values"). `positional(cls)` returns a
twin class of `cls`, the same `__slots__` and no freezing, whose `__init__` takes every field
positionally, stores each in its slot and then makes the value a `cls` by `__class__`
assignment (which Python allows between classes of the same layout): calling the twin builds the
value `cls(*values)` builds, in about a quarter of the instructions. Its type is `cls`, and it
compares, hashes, pickles and refuses assignment as that one does.

Only a class this can build faithfully gets the fast path: a frozen dataclass with `slots=True`,
every field set by `__init__` and no `__post_init__`. Any other class is returned as it is (the
builder is then `cls` itself). This module must never build a value `cls(*values)` would not.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["positional"]

T = TypeVar("T")


def positional(cls: type[T]) -> Callable[..., T]:
    """A function `build(*values)` equal to `cls(*values)` for every field of `cls` given
    positionally, faster for a frozen slotted dataclass (else `cls` itself)."""
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen or hasattr(cls, "__post_init__"):
        return cls
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    names = tuple(f.name for f in fields)
    if getattr(cls, "__slots__", None) != names or not all(f.init for f in fields):
        return cls  # a `__weakref__` slot, an inherited field, a field `__init__` does not set
    if "self" in names or _CLASS in names:
        return cls  # the generated `__init__` below names these
    # A plain class with the same slots in the same order (the layout `__class__` assignment
    # requires) whose `__init__` stores each field and then makes the value a `cls`: one call
    # and plain slot stores, generated as dataclasses generate `__init__`s. Calling it builds
    # the value; no wrapper function around it (a frame more a value: a quarter of its cost).
    source = (
        f"def __init__(self, {', '.join(names)}):\n"
        + "".join(f"    self.{name} = {name}\n" for name in names)
        + f"    self.__class__ = {_CLASS}\n"
    )
    namespace: dict[str, Any] = {_CLASS: cls}
    exec(source, namespace)  # names are the dataclass's fields: identifiers
    twin: Any = type(
        f"_{cls.__name__}Build",
        (),
        {"__slots__": names, "__init__": namespace["__init__"], "__module__": __name__},
    )
    try:  # a layout Python refuses to swap (another base, say) keeps the plain constructor
        if type(twin(*([None] * len(names)))) is not cls:
            return cls
    except TypeError:
        return cls
    return twin  # type: ignore[no-any-return]


_CLASS = "_frozen_class_"
