"""What `StreamAccumulator` keeps beside the dicts it folds into, so that a fold is linear in the
reply's length: a growing text field kept as its pieces (`Text`, joined when the fold is read),
the item maps of long indexed lists, and copies (`own`) where an event's or a reader's objects
would otherwise be shared with the fold. Pure: no I/O."""

from __future__ import annotations

from typing import Any

__all__ = ["SCAN_ITEMS", "Fold", "Text", "add_text", "own", "take"]


class Text:
    """A text field while its stream goes on: its pieces, joined once when the fold is read.

    Only made for a second non-empty piece (most fields arrive whole, in one piece), and only
    ever held in the dicts being folded: `StreamAccumulator._joined` (`llm/accumulate.py`)
    replaces each by its `str` before anything reads them, and a merge that reads the field's
    value (not to add text to it) joins it first (`take`). Truthy, as the non-empty text it
    stands for."""

    __slots__ = ("pieces",)

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces


class Fold:
    """What a fold keeps beside the dicts it folds into: `StreamAccumulator` is one (a base
    class, not an object of its own: one object fewer per streamed reply)."""

    __slots__ = ("_items", "_texts")
    _texts: list[tuple[dict[str, Any], str]]
    """Where `Text`s were put: (dict, key) pairs, joined by `StreamAccumulator._joined`."""
    _items: dict[int, tuple[list[Any], dict[Any, Any]]]
    """For an indexed list past `SCAN_ITEMS` items (by `id`): the list itself (so that its id
    is not reused while mapped) and its items by index (`_merge_indexed`, `llm/accumulate.py`)."""


#: An indexed list up to this long is scanned for an item's index; a longer one is mapped.
SCAN_ITEMS = 8


def add_text(acc: dict[str, Any], key: str, value: str, fold: Fold) -> None:
    """`acc[key] + value` when `acc[key]` is a text, else `value`: without copying the text."""
    old = acc.get(key)
    if type(old) is Text:
        old.pieces.append(value)
    elif isinstance(old, str) and old:
        if value:
            acc[key] = Text([old, value])
            fold._texts.append((acc, key))
    else:
        acc[key] = value


def own(value: Any) -> Any:
    """`value` with every dict and list in it copied: what the fold keeps of an event never
    aliases the event (a later merge would change the caller's event), and what a read hands
    out never aliases the fold (a later event would change what the caller holds)."""
    kind = type(value)
    if kind is dict:
        return {k: own(v) for k, v in value.items()}
    if kind is list:
        return [own(v) for v in value]
    return value


def take(acc: dict[str, Any], key: str) -> Any:
    """`acc.get(key)`, a streamed text joined (and kept joined) first."""
    value = acc.get(key)
    if type(value) is Text:
        value = acc[key] = "".join(value.pieces)
    return value
