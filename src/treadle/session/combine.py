"""What `Session.merge` and `Session.with_data` compute and check, apart from the plumbing."""

from __future__ import annotations

from collections.abc import Iterable

from treadle.errors import ConfigurationError
from treadle.session.lineage import LineageNode, shared_usage
from treadle.session.rows import ChunkTable
from treadle.session.usage import Usage, merged_usage

__all__ = ["check_data_fields", "merged_rows_and_usage", "require_text"]


def merged_rows_and_usage(
    mine: tuple[ChunkTable, Usage],
    theirs: tuple[ChunkTable, Usage],
    lineages: tuple[LineageNode, LineageNode],
) -> tuple[ChunkTable, Usage]:
    """`mine`'s rows, then `theirs` past the common prefix; usage counting shared ancestors once.

    Call it once both sides have settled: by then every ancestor's usage is on the lineage.
    """
    common = 0
    for a, b in zip(mine[0], theirs[0], strict=False):
        if a is not b and a != b:
            break
        common += 1
    table = mine[0].extend(theirs[0].rows[common:])
    return table, merged_usage(mine[1], theirs[1], shared_usage(*lineages))


def check_data_fields(names: Iterable[str], known: frozenset[str]) -> None:
    """`ConfigurationError` naming the fields `with_data` does not have."""
    unknown = sorted(set(names) - known)
    if unknown:
        raise ConfigurationError(
            f"with_data takes SessionData fields ({', '.join(sorted(known))}); "
            f"unknown: {', '.join(unknown)}."
        )


def require_text(name: str, value: object) -> None:
    """`ConfigurationError` unless `value` is a str."""
    if not isinstance(value, str):
        raise ConfigurationError(f"{name} must be a str, got {type(value).__name__}.")
