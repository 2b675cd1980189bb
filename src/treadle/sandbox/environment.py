"""The environment sandbox commands run with: an allow-list of basics, minus anything secret.

Only variables named in the allow-list (exact names or `PREFIX*` patterns) pass, and even those are
dropped when their name looks like a secret (`*_API_KEY`, `*_TOKEN`, `*_SECRET`, `*_PASSWORD`,
`OPENAI_*`, ...). This module must never log or return a secret value.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Iterable, Mapping

__all__ = ["DEFAULT_ENV_ALLOW", "SECRET_PATTERNS", "is_secret_name", "scrubbed_environment"]

#: Variables passed to sandbox commands by default (exact names or fnmatch patterns).
DEFAULT_ENV_ALLOW: tuple[str, ...] = (
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "LC_*", "TERM", "TZ",
    "TMPDIR",
)  # fmt: skip

#: Names that are never passed, even when allowed (matched case-insensitively).
SECRET_PATTERNS: tuple[str, ...] = (
    "*_API_KEY", "*APIKEY*", "*_TOKEN", "*_TOKEN_*", "*_SECRET", "*_SECRET_*", "*SECRET_KEY*",
    "*PASSWORD*", "*PASSWD*", "*_CREDENTIALS*", "*PRIVATE_KEY*", "OPENAI_*", "ANTHROPIC_*",
    "AWS_*", "GITHUB_TOKEN", "GH_TOKEN", "HF_TOKEN",
)  # fmt: skip


def is_secret_name(name: str) -> bool:
    """True when a variable called `name` may hold a secret."""
    upper = name.upper()
    return any(fnmatch.fnmatchcase(upper, pattern) for pattern in SECRET_PATTERNS)


def scrubbed_environment(
    environ: Mapping[str, str] | None = None,
    *,
    allow: Iterable[str] = DEFAULT_ENV_ALLOW,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The allowed, non-secret part of `environ` (default `os.environ`), plus `extra` as given.

    `extra` is the explicit way to hand a command a value; it is not filtered.
    """
    source = os.environ if environ is None else environ
    patterns = tuple(allow)
    env = {
        name: value
        for name, value in source.items()
        if any(fnmatch.fnmatchcase(name, p) for p in patterns) and not is_secret_name(name)
    }
    env.setdefault("PATH", os.defpath)
    if extra:
        env.update(extra)
    return env
