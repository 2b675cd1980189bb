"""Frozen slotted dataclasses built from all their field values, without `__init__`'s cost.

A frozen dataclass's `__init__` sets every field with `object.__setattr__` (its own
`__setattr__` refuses), about 1.7 k instructions a field in CPython 3.11; a plain slot store
costs a few dozen. A process pool's driver builds such values for every outcome a worker sends:
the `PassOutcome`, a `RequestUsage` per completion, the output's `Usage` and `SessionData`
(docs/performance.md, issue 33, "the driver's frozen values"). `positional(cls)` returns a
function taking every field positionally that builds an unfrozen twin of `cls` (the same
`__slots__`, plain stores) and makes it a `cls` by `__class__` assignment, which Python allows
between classes of the same layout. The value is the one `cls(*values)` builds: its type is
`cls`, it compares, hashes, pickles and refuses assignment as that one does.

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
    # A plain (unfrozen) dataclass with the same slots in the same order: the layout `__class__`
    # assignment requires. Its `__init__` is plain slot stores (dataclasses generate it).
    twin: Any = dataclasses.make_dataclass(f"_{cls.__name__}Build", names, slots=True)
    if twin.__slots__ != names:
        return cls

    def build(*values: Any) -> T:
        value = twin(*values)
        value.__class__ = cls
        return value  # type: ignore[no-any-return]

    try:  # a layout Python refuses to swap (another base, say) keeps the plain constructor
        build(*([None] * len(names)))
    except TypeError:
        return cls
    build.__doc__ = f"`{cls.__qualname__}(*values)`, every field given positionally."
    return build
