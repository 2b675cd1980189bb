"""`Item` and `Dataset`: what an evaluation runs over, loaded from JSONL or any iterable.

An item is an id, an input (the user message), optional workspace files (written into the
sample's own sandbox), an optional expected value and free metadata (`tags` there drive the
report's score-by-tag chart). A dataset is a list of items with unique ids and a content hash,
which is part of a run's configuration hash. This module must never run anything: items are data.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, cast

from pydantic_core import PydanticSerializationError, from_json, to_json

from treadle.errors import ConfigurationError

__all__ = ["Dataset", "Item"]

_ITEM_KEYS = frozenset({"id", "input", "files", "expected", "metadata"})


@dataclass(frozen=True)
class Item:
    """One case of a dataset."""

    id: str
    """Unique within the dataset; the log and comparisons key on it."""
    input: str
    """The user message the agent receives."""
    files: Mapping[str, str] = field(default_factory=dict)
    """Workspace files `{relative path: text}`, written into the sample's sandbox."""
    expected: Any = None
    """What a scorer compares the answer with (any JSON value), or None."""
    metadata: Mapping[str, Any] = field(default_factory=dict)
    """Free JSON data; `metadata["tags"]` (a list of str) groups items in the report."""

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise ConfigurationError(f"an item id must be a non-empty str, got {self.id!r}.")
        if not isinstance(self.input, str):
            raise ConfigurationError(f"item {self.id!r}: input must be a str (the user message).")
        for what, value in (("id", self.id), ("input", self.input)):
            if not _encodes(value):
                raise ConfigurationError(
                    f"item {self.id!r}: its {what} holds a lone surrogate (not valid Unicode), "
                    "so it cannot be sent or logged."
                )
        _check_files(self.id, self.files)
        logged: tuple[tuple[str, Any], ...] = (
            ("expected", self.expected),
            ("metadata", self.metadata),
        )
        for what, data in logged:
            try:
                to_json(data)
            except PydanticSerializationError as error:
                raise ConfigurationError(
                    f"item {self.id!r}: its {what} cannot be logged as JSON ({error})."
                ) from None
        tags = self.metadata.get("tags", [])
        if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
            raise ConfigurationError(f"item {self.id!r}: metadata['tags'] must be a list of str.")

    @property
    def tags(self) -> list[str]:
        """The item's tags (`metadata["tags"]`)."""
        return list(self.metadata.get("tags", []))

    def to_json(self) -> dict[str, Any]:
        """The item as a JSON-able dict (the JSONL line shape)."""
        return {
            "id": self.id,
            "input": self.input,
            "files": dict(self.files),
            "expected": self.expected,
            "metadata": dict(self.metadata),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any], *, where: str = "item") -> Item:
        """An item from a dict with keys id, input and optionally files, expected, metadata."""
        if not isinstance(data, Mapping):
            raise ConfigurationError(
                f"{where}: an item is a JSON object, got {type(data).__name__}."
            )
        unknown = set(data) - _ITEM_KEYS
        if unknown:
            raise ConfigurationError(
                f"{where}: unknown item keys {sorted(unknown)}; use id, input, files, expected, "
                "metadata (put anything else in metadata)."
            )
        missing = {"id", "input"} - set(data)
        if missing:
            raise ConfigurationError(f"{where}: an item needs {sorted(missing)}.")
        item_id = data["id"]
        return cls(
            id=str(item_id) if isinstance(item_id, int) else item_id,
            input=data["input"],
            files=dict(data.get("files") or {}),
            expected=data.get("expected"),
            metadata=dict(data.get("metadata") or {}),
        )


#: Bytes of one path component most file systems accept.
_NAME_MAX = 255
#: Longest workspace file path (bytes): Linux's PATH_MAX less room for the workspace folder the
#: sandbox puts it under (a longer path fails at the first sample, after requests are spent).
_PATH_MAX = 4096 - 512


def _encodes(text: str) -> bool:
    """Whether `text` is valid Unicode for a file (no lone surrogate)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _fs_encodes(path: str) -> bool:
    """Whether `path` can be a file name here (a non-UTF-8 locale cannot name `café.txt`)."""
    try:
        os.fsencode(path)
    except UnicodeEncodeError:
        return False
    return True


def _check_files(item_id: str, files: Mapping[str, Any]) -> None:
    """Refuse workspace files that cannot all be laid out in one directory: a path that is not
    relative, leaves the workspace, names the workspace itself (`.`), holds a NUL byte, a lone
    surrogate or an over-long name, is longer than `_PATH_MAX` bytes, names the same file as
    another (`a` and `./a`), or is both a file and a directory (`a` and `a/b`); or whose text
    holds a lone surrogate (it cannot be written as UTF-8)."""
    laid: dict[tuple[str, ...], str] = {}
    for path, text in files.items():
        pure = PurePosixPath(path) if isinstance(path, str) else None
        why = None
        if pure is None or not isinstance(text, str):
            why = "files maps relative paths inside the workspace to text"
        elif "\0" in path:
            why = "the path holds a NUL byte"
        elif not _encodes(path):
            why = "the path holds a lone surrogate (not valid Unicode)"
        elif not _encodes(text):
            why = "its text holds a lone surrogate (not valid Unicode), so it cannot be written"
        elif not _fs_encodes(path):
            why = (
                f"the path cannot be a file name in this process's file system encoding "
                f"({sys.getfilesystemencoding()}; run with PYTHONUTF8=1 or a UTF-8 locale)"
            )
        elif len(path.encode()) > _PATH_MAX:
            why = f"the path is {len(path.encode()):,} bytes, longer than {_PATH_MAX:,}"
        elif pure.is_absolute() or ".." in pure.parts:
            why = "the path leaves the workspace"
        elif not pure.parts:
            why = "the path names the workspace itself, not a file in it"
        elif any(len(part.encode()) > _NAME_MAX for part in pure.parts):
            why = f"a name in the path is longer than {_NAME_MAX} bytes"
        elif pure.parts in laid:
            why = f"it names the same file as {laid[pure.parts]!r}"
        if why is None:
            assert pure is not None
            laid[pure.parts] = path
            continue
        raise ConfigurationError(f"item {item_id!r}: workspace file {path!r}: {why}.")
    for parts, path in laid.items():
        for depth in range(1, len(parts)):
            if parts[:depth] in laid:
                raise ConfigurationError(
                    f"item {item_id!r}: workspace file {path!r} needs {laid[parts[:depth]]!r} "
                    "to be a directory, but it is a file too; rename one of them."
                )


class Dataset(Sequence[Item]):
    """Items with unique ids, in order, and a content hash.

    Build from `Item`s or dicts (`Dataset([...])`), or from a JSONL file (`Dataset.from_jsonl`).
    """

    def __init__(self, items: Iterable[Item | Mapping[str, Any]], *, name: str = "dataset") -> None:
        built: list[Item] = []
        seen: set[str] = set()
        for position, raw in enumerate(items):
            item = raw if isinstance(raw, Item) else Item.from_json(raw, where=f"item {position}")
            if item.id in seen:
                raise ConfigurationError(f"item id {item.id!r} appears twice; ids must be unique.")
            seen.add(item.id)
            built.append(item)
        if not built:
            raise ConfigurationError(f"dataset {name!r} has no items.")
        self.name = name
        self._items = built
        digest = hashlib.sha256()
        for item in built:
            digest.update(to_json(item.to_json()))
            digest.update(b"\n")
        self.hash = digest.hexdigest()
        """sha256 of the items' canonical JSON, in order."""

    @classmethod
    def from_jsonl(cls, path: str | os.PathLike[str]) -> Dataset:
        """Items from a JSONL file, one JSON object per line (blank lines are skipped)."""
        file = Path(path)
        try:
            text = file.read_bytes()
        except OSError as err:
            raise ConfigurationError(
                f"cannot read dataset {str(file)!r}: {err.strerror}."
            ) from None
        items = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                data = from_json(line)
            except ValueError as err:
                raise ConfigurationError(f"{file}:{number}: not JSON ({err}).") from None
            items.append(Item.from_json(data, where=f"{file}:{number}"))
        return cls(items, name=file.stem)

    @classmethod
    def coerce(cls, value: Dataset | str | os.PathLike[str] | Iterable[Any]) -> Dataset:
        """A dataset from a dataset, a JSONL path, or an iterable of items / dicts."""
        if isinstance(value, Dataset):
            return value
        if isinstance(value, str | os.PathLike):
            return cls.from_jsonl(value)
        if isinstance(value, Iterable):
            return cls(cast("Iterable[Item | Mapping[str, Any]]", value))
        raise ConfigurationError(
            f"a dataset is a JSONL path or an iterable of items, got {type(value).__name__}."
        )

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index: Any) -> Any:
        return self._items[index]

    def __iter__(self) -> Iterator[Item]:
        return iter(self._items)

    def __repr__(self) -> str:
        return f"<Dataset {self.name!r}: {len(self)} items>"
