"""`treadle.distributed.frozen.positional`: the driver's fast build of frozen slotted values is
the value their own constructor builds (type, equality, hash, pickling, frozenness), and any
class it cannot build faithfully keeps its own constructor."""

from __future__ import annotations

import copy
import dataclasses
import pickle
from dataclasses import dataclass, field
from typing import Any

import pytest

from treadle.distributed.frozen import positional
from treadle.distributed.outcome import PassItem, PassOutcome
from treadle.loop import RequestUsage
from treadle.session import SessionData, Usage
from treadle.session.rows import ChunkRow, ChunkTable

VALUES: list[tuple[type[Any], tuple[Any, ...]]] = [
    (RequestUsage, (110, 4, 1, 2, "chatcmpl-1", 0.25, "cpu-bound", "req_1")),
    (Usage, (808, 20, 828, 4)),
    (PassItem, (0, "id", [{"role": "user", "content": "hi"}], None, 1, {"traceparent": "x"}, None)),
    (
        PassOutcome,
        (3, "in-id", "ok", 1, "host:1", None, {"requests": 1}, "final_answer", None, (), {}, []),
    ),
    (
        SessionData,
        (ChunkTable._trusted([ChunkRow._trusted("user", {"content": "hi"})]), Usage(), None, {}),
    ),
]


@pytest.mark.parametrize(("cls", "values"), VALUES, ids=lambda v: getattr(v, "__name__", ""))
def test_a_fast_built_value_is_the_one_its_constructor_builds(
    cls: type[Any], values: tuple[Any, ...]
) -> None:
    build = positional(cls)
    assert build is not cls  # each of these takes the fast path
    fast, plain = build(*values), cls(*values)
    assert type(fast) is cls
    assert fast == plain and repr(fast) == repr(plain)
    for f in dataclasses.fields(cls):
        assert getattr(fast, f.name) is getattr(plain, f.name)
    if cls in (RequestUsage, Usage):  # the others hold dicts
        assert hash(fast) == hash(plain)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(fast, dataclasses.fields(cls)[0].name, 0)
    if cls is not SessionData:  # its table holds a lock: neither pickles
        assert pickle.loads(pickle.dumps(fast)) == plain
    assert copy.copy(fast) == plain and dataclasses.replace(fast) == plain
    with pytest.raises(TypeError):  # every field must be given, as positional callers do
        build(*values[:-1])


def test_an_item_from_a_str_is_the_one_its_constructor_builds() -> None:
    item = PassItem.from_input(3, "hello", {"traceparent": "x"})
    assert type(item) is PassItem
    assert item == PassItem(3, item.session_id, [{"role": "user", "content": "hello"}],
                            trace_context={"traceparent": "x"})  # fmt: skip


@dataclass(frozen=True)
class _NoSlots:
    a: int


@dataclass(frozen=True, slots=True)
class _Checked:
    a: int

    def __post_init__(self) -> None:
        if self.a < 0:
            raise ValueError("negative")


@dataclass(frozen=True, slots=True)
class _NotInInit:
    a: int
    b: int = field(init=False, default=0)


@dataclass(slots=True)
class _Mutable:
    a: int


@dataclass(frozen=True, slots=True, weakref_slot=True)
class _Weak:
    a: int


@pytest.mark.parametrize("cls", [_NoSlots, _Checked, _NotInInit, _Mutable, _Weak, int])
def test_a_class_it_cannot_build_faithfully_keeps_its_constructor(cls: type[Any]) -> None:
    assert positional(cls) is cls
