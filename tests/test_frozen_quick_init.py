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
    cases: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
        ((1,), {}),
        ((1, "y"), {}),
        ((1, "y", [3]), {"d": 2.0}),
        ((), {"a": 4}),
    ]
    for args, kwargs in cases:
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
    cases: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
        ((), {}),
        ((1,), {"e": 2}),
        ((1, "b", [], 4.0), {}),
        ((1,), {"a": 2}),
    ]
    for args, kwargs in cases:
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


def _twins(build: Any) -> tuple[Any, Any]:
    """`build()` (a frozen slotted dataclass) twice: as made, and with `quick_init`."""
    return build(), quick_init(build())


def _same(plain: Any, quick: Any, *args: Any, **kwargs: Any) -> None:
    """Both classes build equal fields from these arguments, or fail with the same error."""
    try:
        theirs = plain(*args, **kwargs)
    except Exception as error:
        with pytest.raises(type(error)) as mine:
            quick(*args, **kwargs)
        assert str(mine.value) == str(error)
        return
    mine = quick(*args, **kwargs)
    assert repr(mine).split("(", 1)[1] == repr(theirs).split("(", 1)[1]


def test_fields_named_like_its_own_helpers_or_self() -> None:
    # Field names the generated code might have used for itself: `self`, and names like the
    # helpers of an earlier version (`_FACTORY`, `_set0`, `_factory0`, `_default0`).
    def build() -> Any:
        @dataclass(frozen=True, slots=True)
        class Odd:
            self: int
            _set0: int = 1
            _FACTORY: int = 2
            _default0: int = 3
            b: list[int] = field(default_factory=list)
            _factory0: list[int] = field(default_factory=lambda: [7])

        return Odd

    plain, quick = _twins(build)
    _same(plain, quick, 0)
    _same(plain, quick, 0, 5, 6, 7, [8], [9])
    _same(plain, quick, self=1, _FACTORY=4)
    _same(plain, quick)


def test_fields_of_a_dataclass_base_and_keyword_only_ones_first() -> None:
    def build() -> Any:
        @dataclass(frozen=True, slots=True)
        class Base:
            a: int
            k: int = field(default=0, kw_only=True)

        @dataclass(frozen=True, slots=True)
        class Child(Base):
            b: str = "x"

        return Child

    plain, quick = _twins(build)
    assert str(inspect.signature(quick)) == str(inspect.signature(plain))
    _same(plain, quick, 1)
    _same(plain, quick, 1, "y", k=3)
    _same(plain, quick, 1, "y", 3)


def test_a_plain_subclass_keeps_what_its_properties_do() -> None:
    # A subclass that is no dataclass inherits the quick `__init__`; a field it turned into a
    # property is set through the property, as the dataclass's own `__init__` does.
    def build() -> Any:
        @dataclass(frozen=True, slots=True)
        class Point:
            a: int
            b: int = 0

        class Scaled(Point):
            __slots__ = ("_a",)

            @property
            def a(self) -> int:
                value: int = getattr(self, "_a")  # noqa: B009 - set by the setter below
                return value

            @a.setter
            def a(self, value: int) -> None:
                object.__setattr__(self, "_a", value * 10)

        return Scaled

    scaled_plain, scaled_quick = build(), build()
    point = quick_init(scaled_quick.__mro__[1])
    assert scaled_plain(1, 2).a == scaled_quick(1, 2).a == 10
    assert (point(1, 2).a, point(1, 2).b) == (1, 2)  # the class itself: its own slots
