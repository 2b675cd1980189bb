"""A faster `__init__` for frozen, slotted dataclasses built on every round.

A frozen dataclass's generated `__init__` sets each field with `object.__setattr__(self, name,
value)`: a method lookup and a name lookup per field, about 570 ns for four fields here against
160 ns for a plain slotted class. A pass builds some forty such objects (a request's `Usage` and
its sums, each tool call's `ToolContext`, ...): about 1.5% of a streamed pass's CPU
(docs/performance.md). `quick_init` replaces that `__init__` with one of the same signature that
sets each slot through its member descriptor's `__set__`, bound once at import (about 330 ns for
four fields): the instance, its equality, hash, pickling and frozenness are the dataclass's own.

Only what the hot classes use is supported (positional or keyword-only fields with a default or
a default factory, a `__post_init__`); a class with anything else (`init=False` fields, `InitVar`s)
is refused at import, so it cannot silently lose a field.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, TypeVar

__all__ = ["quick_init"]

C = TypeVar("C", bound=type)

_NO_DEFAULT: Any = dataclasses.MISSING


def quick_init(cls: C) -> C:
    """Give frozen slotted dataclass `cls` a faster `__init__` (same signature and behaviour)."""
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen or not params.init or "__slots__" not in cls.__dict__:
        raise TypeError(f"quick_init is for frozen, slotted dataclasses; {cls.__name__} is not")
    fields = dataclasses.fields(cls)
    generated = cls.__dict__["__init__"]  # the dataclass's own: its parameters are the fields'
    params_of = list(inspect.signature(generated).parameters)[1:]
    if params_of != [f.name for f in fields] or not all(f.init for f in fields):
        raise TypeError(
            f"{cls.__name__} has fields quick_init does not build (InitVar, init=False)"
        )
    names: dict[str, Any] = {}
    positional: list[str] = []
    keyword: list[str] = []
    body: list[str] = []
    for i, field in enumerate(fields):
        setter, value = f"_set{i}", field.name
        names[setter] = cls.__dict__[field.name].__set__  # the slot's member descriptor
        param = field.name
        if field.default is not _NO_DEFAULT:
            names[f"_default{i}"] = field.default
            param += f"=_default{i}"
        elif field.default_factory is not _NO_DEFAULT:
            names[f"_factory{i}"] = field.default_factory
            param += "=_FACTORY"
            value = f"_factory{i}() if {field.name} is _FACTORY else {field.name}"
        (keyword if field.kw_only else positional).append(param)
        body.append(f"    {setter}(self, {value})")
    if hasattr(cls, "__post_init__"):
        body.append("    self.__post_init__()")
    names["_FACTORY"] = _FACTORY
    signature = ", ".join(["self", *positional, *(["*", *keyword] if keyword else [])])
    source = f"def __init__({signature}):\n" + ("\n".join(body) or "    pass") + "\n"
    exec(source, names)
    init = names["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    init.__doc__ = generated.__doc__
    init.__annotations__ = dict(generated.__annotations__)
    type.__setattr__(cls, "__init__", init)
    return cls


class _Factory:
    """The default of a field whose default comes from a factory (called when not given)."""

    def __repr__(self) -> str:
        return "<factory>"


_FACTORY: Any = _Factory()
