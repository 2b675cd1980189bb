"""Where a store is: its location checked (`check_location`) and shown without a password
(`redact`), and libpq's keyword/value DSN told apart from a file name (`KEYWORD_DSN`)."""

from __future__ import annotations

import os
import re

from treadle.errors import ConfigurationError

__all__ = ["KEYWORD_DSN", "check_location", "redact"]

#: A libpq keyword/value DSN ("host=db dbname=app ..."): it starts with one of libpq's
#: connection keywords and `=`, which no sensible SQLite file name does.
KEYWORD_DSN = re.compile(
    r"\s*(host|hostaddr|port|dbname|user|password|passfile|service|sslmode|connect_timeout"
    r"|options|application_name|target_session_attrs)\s*=",
    re.IGNORECASE,
)
_SECRETS = (
    (re.compile(r"(://[^/@:]*:)[^/@]*@"), r"\1***@"),  # scheme://user:password@host
    (re.compile(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", re.IGNORECASE), r"\1***"),
)


def redact(location: str) -> str:
    """`location` with any password in it replaced by `***` (for error messages)."""
    for pattern, replacement in _SECRETS:
        location = pattern.sub(replacement, location)
    return location


def check_location(where: object, what: str) -> str:
    """`where` as text, or a `ConfigurationError` for what no store can open (not text, NUL)."""
    if isinstance(where, bytes) or not isinstance(where, str | os.PathLike):
        raise ConfigurationError(f"a {what} must be a str or a path, got {type(where).__name__}.")
    text = os.fspath(where)
    if not isinstance(text, str):
        raise ConfigurationError(f"a {what} must be text, not bytes.")
    if "\x00" in text:
        raise ConfigurationError(f"the {what} {redact(text)!r:.80} contains a NUL character.")
    return text
