"""Saved-file fuzzing: header and trailer fields of the wrong type, size or range (huge counts,
negative schema, empty placement, NaN and infinities) are each a `PersistenceError` naming the
file and the line; a seeded random mutation of a good file either loads or is one, never any
other error. The named cases came from fuzzing the loader (issue 29).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from test_persist_hostile import HEADER, ROWS
from treadle import load_session
from treadle.errors import PersistenceError
from treadle.persist.checks import MAX_NAME_CHARS, MAX_PARENTS


def _write(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "s.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _lines(header: dict[str, Any], rows: list[dict[str, Any]] = ROWS) -> list[str]:
    return [json.dumps(obj) for obj in [header, *rows]]


def _usage(text: str) -> list[str]:
    """A file whose trailer's prompt_tokens is the JSON text `text` (line 4)."""
    trailer = json.dumps({**ROWS[2], "usage": {"prompt_tokens": "@"}}).replace('"@"', text)
    return [*_lines(HEADER, ROWS[:2]), trailer]


_BAD_HEADERS: dict[str, Any] = {
    "schema-negative": {"schema": -1},
    "schema-float": {"schema": 1.5},
    "schema-bool": {"schema": True},
    "placement-empty": {"placement": ""},
    "placement-number": {"placement": 3},
    "placement-huge": {"placement": "x" * (MAX_NAME_CHARS + 1)},
    "parent_ids-int": {"parent_ids": 5},
    "parent_ids-object": {"parent_ids": {"a": 1}},
    "parent_ids-of-ints": {"parent_ids": [1, 2]},
    "parent_ids-empty-id": {"parent_ids": [""]},
    "parent_ids-too-many": {"parent_ids": ["p"] * (MAX_PARENTS + 1)},
    "session_id-huge": {"session_id": "s" * (MAX_NAME_CHARS + 1)},
    "operator-list": {"operator": ["run"]},
    "created_at-string": {"created_at": "yesterday"},
    "created_at-negative": {"created_at": -1.0},
    "created_at-bool": {"created_at": False},
    "producer-string": {"producer": "me"},
    "placement_options-list": {"placement_options": [1]},
}


@pytest.mark.parametrize("change", list(_BAD_HEADERS.values()), ids=list(_BAD_HEADERS))
def test_a_bad_header_field_is_a_persistence_error_with_file_and_line(
    tmp_path: Path, change: dict[str, Any]
) -> None:
    path = _write(tmp_path, _lines({**HEADER, **change}))
    field = next(iter(change))
    with pytest.raises(PersistenceError, match=f"line 1: the header's {field} is malformed"):
        load_session(path)
    with pytest.raises(PersistenceError) as raised:
        load_session(path, sandbox=False)
    assert str(raised.value).startswith(f"{path}: line 1: ")


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_created_at_nan_or_infinite_is_refused(tmp_path: Path, number: str) -> None:
    header = json.dumps({**HEADER, "created_at": "@"}).replace('"@"', number)
    path = _write(tmp_path, [header, *_lines(HEADER)[1:]])
    with pytest.raises(PersistenceError, match=f"{path}: line 1: the header's created_at"):
        load_session(path)


@pytest.mark.parametrize(
    "text", ["1" + "0" * 400, str(2**63), str(2**64 + 7), "-1", "1.5", "NaN", "1e999", "true"]
)
def test_a_usage_count_out_of_range_is_refused(tmp_path: Path, text: str) -> None:
    path = _write(tmp_path, _usage(text))
    with pytest.raises(PersistenceError, match=f"{path}: line 4: the trailer's usage"):
        load_session(path)


def test_the_largest_count_still_loads(tmp_path: Path) -> None:
    loaded = load_session(_write(tmp_path, _usage(str(2**63 - 1))), sandbox=False)
    assert loaded.session.usage.prompt_tokens == 2**63 - 1


@pytest.mark.parametrize("rows", [-1, 2**63, "2", 1.0])
def test_a_trailer_row_count_out_of_range_is_refused(tmp_path: Path, rows: object) -> None:
    path = _write(tmp_path, _lines(HEADER, [*ROWS[:2], {**ROWS[2], "rows": rows}]))
    with pytest.raises(PersistenceError, match=f"{path}: line 4: the trailer's rows"):
        load_session(path)


_VALUES: list[Any] = [
    None, True, 0, -1, 2**63, 10**400, 1.5, float("nan"), float("inf"), "", "x" * 5000,
    "isolated", [], [1], ["a"], {}, {"a": 1},
]  # fmt: skip
_FIELDS = ["schema", "session_id", "parent_ids", "operator", "created_at", "placement",
           "producer", "agent_rows", "placement_options"]  # fmt: skip


def test_random_header_mutations_load_or_are_persistence_errors(tmp_path: Path) -> None:
    chooser = random.Random(29)
    refused = 0
    for _ in range(300):
        header = dict(HEADER)
        for field in chooser.sample(_FIELDS, chooser.randint(1, 3)):
            header[field] = chooser.choice(_VALUES)
        trailer = {**ROWS[2], "usage": {"requests": chooser.choice(_VALUES)}}
        path = _write(tmp_path, _lines(header, [*ROWS[:2], trailer]))
        try:
            load_session(path, sandbox=chooser.random() < 0.5)
        except PersistenceError as err:
            assert str(err).startswith(str(path)), err
            refused += 1
    assert refused > 200  # almost every mutation is damage, and said so
