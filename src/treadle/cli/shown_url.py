"""How the command line shows an endpoint: `scheme://host[:port]`, nothing more.

A base URL can carry a secret in its user-info (`https://user:password@host/v1`) or its query
(`?key=...`), and stderr ends up in terminals, CI logs and bug reports. Every endpoint the CLI
prints goes through `shown_url`, and every error line it prints through `redact_urls`. Standard
library only: it runs on the error paths, before the pass's imports.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

__all__ = ["has_secret_parts", "redact_urls", "shown_url"]

# A URL inside a message ends at white space or a quote; a trailing full stop or comma is prose.
_URL_IN_TEXT = re.compile(r"https?://[^\s'\"<>]+?(?=[.,;:)]?(?:[\s'\"<>]|$))")


def shown_url(url: str) -> str:
    """`scheme://host[:port]` of `url`; `url` itself only when it has no host to show."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError:  # an unparseable port: show the host part without it
        parts = urlsplit(url)
        host, port = parts.netloc.rpartition("@")[2].split(":")[0] or None, None
    if not host or not parts.scheme:
        return url
    shown = f"[{host}]" if ":" in host else host
    return f"{parts.scheme}://{shown}" + (f":{port}" if port is not None else "")


def has_secret_parts(url: str) -> bool:
    """True when `url` has user-info or a query, the parts that can hold a key."""
    before_path = url.split("//", 1)[-1].split("/", 1)[0]
    return "@" in before_path or "?" in url


def redact_urls(text: str, *, keep_safe_paths: bool = False) -> str:
    """`text` with every http(s) URL cut to its origin.

    With `keep_safe_paths` a URL without user-info or query is kept whole (a fix line that
    suggests a `--base-url` to type needs its path).
    """

    def cut(match: re.Match[str]) -> str:
        url = match.group(0)
        return url if keep_safe_paths and not has_secret_parts(url) else shown_url(url)

    return _URL_IN_TEXT.sub(cut, text)
