"""`quick_init`: a frozen slotted dataclass's faster `__init__` builds what the dataclass's own
would, with the same signature, defaults, factories, `__post_init__` and errors."""

from __future__ import annotations

import dataclasses
import inspect
import pickle
from dataclasses import InitVar, dataclass, field
from typing import Any, Generic, TypeVar

import pytest

from treadle._frozen import quick_init
from treadle.session.calls import ToolCall
from treadle.session.usage import Usage
from treadle.tools.context import ToolContext

T = TypeVar("T")
SEEN: list[Any] = []


def _pair(**options: Any) -> tuple[type, type]:
    """The same dataclass twice: as `dataclass` makes it, and with `quick_init`."""

    def make() -> type:
        class Row:
            __annotations__ = {"a": "int", "b": "str", "c": "list[int]", "d": "float"}
            b = "x"
            c = field(default_factory=lambda: [1, 2])
            d = field(default=0.5, kw_only=True)

            def __post_init__(self) -> None:
                SEEN.append(self)

        return dataclass(frozen=True, slots=True, **options)(Row)

    return make(), quick_init(make())


def test_the_same_instances_as_the_dataclasss_own_init() -> None:
    plain, quick = _pair()
    for args, kwargs in [((1,), {}), ((1, "y"), {}), ((1, "y", [3]), {"d": 2.0}), ((), {"a": 4})]:
        mine, theirs = quick(*args, **kwargs), plain(*args, **kwargs)
        assert dataclasses.astuple(mine) == dataclasses.astuple(theirs)
        assert repr(mine).split("(", 1)[1] == repr(theirs).split("(", 1)[1]
    assert quick(1).c is not quick(1).c  # a fresh list from the factory each time
    assert str(inspect.signature(quick)) == str(inspect.signature(plain))


def test_post_init_runs_once_on_the_built_instance() -> None:
    _, quick = _pair()
    SEEN.clear()
    row = quick(7)
    assert [row] == SEEN


def test_still_frozen_hashable_and_picklable() -> None:
    usage = Usage(1, 2, 3, 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        usage.prompt_tokens = 9  # type: ignore[misc]
    assert hash(usage) == hash(Usage(1, 2, 3, 4))
    assert pickle.loads(pickle.dumps(usage)) == usage
    call = ToolCall("c1", "noop", "{}")
    assert pickle.loads(pickle.dumps(call)) == call
    assert Usage() == Usage(0, 0, 0, 0)


def test_wrong_arguments_fail_as_the_dataclasss_own_would() -> None:
    plain, quick = _pair()
    for args, kwargs in [((), {}), ((1,), {"e": 2}), ((1, "b", [], 4.0), {}), ((1,), {"a": 2})]:
        with pytest.raises(TypeError) as theirs:
            plain(*args, **kwargs)
        with pytest.raises(TypeError) as mine:
            quick(*args, **kwargs)
        assert str(mine.value) == str(theirs.value)


def test_a_generic_class() -> None:
    context: ToolContext[int] = ToolContext(deps=3)
    assert context.deps == 3
    assert context.for_call(ToolCall("c1", "noop", "{}")).deps == 3


def test_classes_it_cannot_build_are_refused_at_import() -> None:
    @dataclass(slots=True)
    class Mutable:
        a: int

    @dataclass(frozen=True)
    class NoSlots:
        a: int

    @dataclass(frozen=True, slots=True)
    class Hidden:
        a: int
        b: int = field(default=0, init=False)

    @dataclass(frozen=True, slots=True)
    class WithInitVar(Generic[T]):
        a: int
        scale: InitVar[int] = 1

    class NotADataclass:
        pass

    for cls in (Mutable, NoSlots, Hidden, WithInitVar, NotADataclass):
        with pytest.raises(TypeError, match=r"quick_init"):
            quick_init(cls)
