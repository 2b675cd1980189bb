"""Tool results become JSON text by a fast path for plain values and a careful path for the rest;
both must give the same text wherever the fast one applies."""

from __future__ import annotations

import dataclasses
import datetime
import enum
import json
import math
from typing import Any

import pydantic
import pydantic_core
import pytest

from treadle.tools import results
from treadle.tools.results import success_content


class Colour(enum.Enum):
    RED = "red"


class Model(pydantic.BaseModel):
    name: str
    score: float


@dataclasses.dataclass
class Point:
    x: int
    y: float


def careful(value: Any, limit: int = results.MAX_TEXT_CHARS) -> str:
    """The careful path alone (what `_encode` did before the fast path)."""
    body: dict[str, Any] = {"ok": True}
    if isinstance(value, dict):
        body.update({str(k): v for k, v in value.items()})
    else:
        body["result"] = value
    jsonable = results._jsonable(body)
    return pydantic_core.to_json(results._cap_strings(jsonable, limit)).decode()


PLAIN: list[Any] = [
    {"round": 3},
    "text",
    "ünïcödé ✓",
    [1, 2.5, None, True, "x"],
    {"nested": {"list": [{"a": 1}], "t": (1, 2)}},
    {1: "int key", 2.5: "float key"},
    {"nan": math.nan, "inf": math.inf, "ninf": -math.inf},
    b"utf-8 bytes",
    Model(name="m", score=1.5),
    Point(1, math.inf),
    Colour.RED,
    datetime.date(2026, 11, 23),
    frozenset({1}),
]


@pytest.mark.parametrize("value", PLAIN, ids=[type(v).__name__ for v in PLAIN])
def test_the_fast_path_gives_the_careful_text(value: Any) -> None:
    assert success_content(value) == careful(value)
    json.loads(success_content(value))  # valid JSON always


def test_what_the_fast_path_cannot_take_still_encodes() -> None:
    cyclic: list[Any] = [1]
    cyclic.append(cyclic)
    long = "z" * (results.MAX_TEXT_CHARS + 50)
    for value in (cyclic, b"\xff\xfe binary", object(), {"long": long}, {(1, 2): "tuple key"}):
        text = success_content(value)
        assert json.loads(text)["ok"] is True
        assert text == careful(value)
    assert len(json.loads(success_content({"long": long}))["long"]) < len(long)  # capped
