"""`parse_arguments`: a tool call's arguments text as the object its tool validates.

The model's text is parsed by pydantic-core (`from_json`: a seventh of `json.loads`'s time for a
small object); whatever is not a JSON object becomes a `ToolArgumentsError` the model hears
about, never an exception of the parser's own.
"""

from __future__ import annotations

from typing import Any

from pydantic_core import from_json

from treadle.errors import ToolArgumentsError

__all__ = ["parse_arguments"]


def parse_arguments(raw: str) -> dict[str, Any]:
    """The arguments object of a call; empty or whitespace text means `{}`.

    Raises `ToolArgumentsError` for text that is not a JSON object, including a lone surrogate
    (escaped or as a character: no file or store could hold it) and nesting over 200 levels.
    """
    if not raw.strip():
        return {}
    try:
        value = from_json(raw)
    except (ValueError, RecursionError) as e:
        raise ToolArgumentsError(
            f"the arguments are not valid JSON ({e}); send a JSON object.",
        ) from None
    except TypeError:  # text that is not Unicode (a lone surrogate character) cannot be parsed
        raise ToolArgumentsError(
            "the arguments are not valid JSON (they hold a lone surrogate, which is not "
            "Unicode text); send a JSON object.",
        ) from None
    if not isinstance(value, dict):
        raise ToolArgumentsError(
            f"the arguments must be a JSON object, got {type(value).__name__}; "
            'send e.g. {"name": value}.'
        )
    return value
