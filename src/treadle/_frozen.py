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
import types
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
    order = [f.name for f in fields if not f.kw_only] + [f.name for f in fields if f.kw_only]
    if list(inspect.signature(generated).parameters)[1:] != order or not all(
        f.init for f in fields
    ):
        raise TypeError(
            f"quick_init cannot build {cls.__name__}: its __init__ takes other parameters than "
            "its fields (an InitVar, an init=False field)"
        )
    # Every name the generated code uses starts with `__qi_`, which no field of a class body can
    # (a `__` name there is mangled to `_Class__...`); one made by `make_dataclass` is refused.
    if any(f.name.startswith("__qi_") for f in fields):
        raise TypeError(f"quick_init cannot build {cls.__name__}: a field is named __qi_...")
    names: dict[str, Any] = {"__qi_cls": cls, "__qi_own": generated, "__qi_FACTORY": _FACTORY}
    positional: list[str] = []
    keyword: list[str] = []
    body: list[str] = []
    for i, field in enumerate(fields):
        slot = _slot_of(cls, field.name)
        setter, value, param = f"__qi_set{i}", field.name, field.name
        names[setter] = slot.__set__
        if field.default is not _NO_DEFAULT:
            names[f"__qi_default{i}"] = field.default
            param += f"=__qi_default{i}"
        elif field.default_factory is not _NO_DEFAULT:
            names[f"__qi_factory{i}"] = field.default_factory
            param += "=__qi_FACTORY"
            value = f"__qi_factory{i}() if {field.name} is __qi_FACTORY else {field.name}"
        (keyword if field.kw_only else positional).append(param)
        body.append(f"    {setter}(__qi_self, {value})")
    if hasattr(cls, "__post_init__"):
        body.append("    __qi_self.__post_init__()")
    # A subclass that is not a dataclass itself inherits this `__init__`; it may have replaced a
    # field by a property, which only the dataclass's own `__init__` (by attribute name) honours.
    passed = [f"{f.name}={f.name}" for f in fields]
    fallback = [
        "    if type(__qi_self) is not __qi_cls:",
        *(
            f"        {f.name} = __qi_factory{i}() if {f.name} is __qi_FACTORY else {f.name}"
            for i, f in enumerate(fields)
            if f.default_factory is not _NO_DEFAULT
        ),
        f"        return __qi_own({', '.join(['__qi_self', *passed])})",
    ]
    signature = ", ".join(["__qi_self", *positional, *(["*", *keyword] if keyword else [])])
    source = f"def __init__({signature}):\n" + "\n".join([*fallback, *body]) + "\n"
    exec(source, names)  # built from the dataclass's own field names only
    init = names["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    init.__doc__ = generated.__doc__
    init.__annotations__ = dict(generated.__annotations__)
    type.__setattr__(cls, "__init__", init)
    return cls


def _slot_of(cls: type, name: str) -> Any:
    """The member descriptor of slot `name` (on `cls` or the dataclass it extends)."""
    for klass in cls.__mro__:
        if name in klass.__dict__:
            found = klass.__dict__[name]
            if isinstance(found, types.MemberDescriptorType):
                return found
            break
    raise TypeError(f"quick_init cannot build {cls.__name__}: field {name!r} is not a slot")


class _Factory:
    """The default of a field whose default comes from a factory (called when not given)."""

    def __repr__(self) -> str:
        return "<factory>"


_FACTORY: Any = _Factory()
