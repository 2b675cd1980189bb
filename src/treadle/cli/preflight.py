"""Checks `treadle run` makes before any request, each failing with the flag to type.

The order is the order a user fixes things in: a `--base-url` without a scheme is reported
before a missing key (the key check depends on whether the URL is local), then the model, then
the key; last, the endpoint's host name must resolve. A DNS answer of "no such host" will not
change on a retry, so it is reported at once instead of after the pass's retries and backoff.

This module runs before the pass's imports (asyncio, httpx, pydantic): it imports only the
standard library, `treadle.errors` and the light `treadle.llm.provider`, so a configuration
error prints in a few tens of milliseconds. It must never print or put the API key in a message.
"""

from __future__ import annotations

import math
import os
import shlex
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from treadle.cli.failures import EXIT_CODES, CliFailure
from treadle.cli.shown_url import has_secret_parts
from treadle.llm.provider import DEFAULT_BASE_URL, is_loopback_url

__all__ = [
    "RESOLVE_TIMEOUT",
    "Endpoint",
    "check_endpoint",
    "check_host_resolves",
    "check_limits",
    "check_mcp_urls",
    "check_sandbox",
]

#: Seconds the pre-flight DNS lookup may take; a slower resolver is left to the pass itself.
RESOLVE_TIMEOUT = 5.0

# A proxy resolves the endpoint's host itself: the local resolver may rightly not know it.
_PROXY_VARIABLES = ("https_proxy", "http_proxy", "all_proxy")


@dataclass(frozen=True, slots=True)
class Endpoint:
    """What `treadle run` calls: model, base URL and key, from flags or the environment."""

    model: str
    base_url: str
    api_key: str | None

    def __repr__(self) -> str:  # the key is never shown
        return f"Endpoint(model={self.model!r}, base_url={self.base_url!r})"


def _with_scheme(url: str) -> str:
    """`url` with the scheme a server at that address most likely speaks."""
    bare = url.split("//", 1)[1] if url.startswith("//") else url
    guess = f"http://{bare}"
    return guess if is_loopback_url(guess) else f"https://{bare}"


def check_endpoint(*, model: str | None, base_url: str | None, api_key: str | None) -> Endpoint:
    """The endpoint the flags (else the environment) describe; `CliFailure` naming the flag."""
    flag_url = base_url
    url = base_url or os.environ.get("OPENAI_BASE_URL") or DEFAULT_BASE_URL
    if urlsplit(url).scheme not in ("http", "https"):
        if has_secret_parts(url):  # never echo user-info or a query: they can hold a key
            where = "--base-url" if flag_url else "OPENAI_BASE_URL"
            raise CliFailure(
                f"{where} has no http:// or https:// scheme.",
                f"put http:// (a local server) or https:// (a TLS one) in front of {where}.",
                EXIT_CODES["usage"],
            )
        fixed = _with_scheme(url)
        if flag_url:
            raise CliFailure(
                f"--base-url {url!r} has no http:// or https:// scheme.",
                f"pass --base-url {fixed} (http:// for a local server, https:// for a TLS one).",
                EXIT_CODES["usage"],
            )
        raise CliFailure(
            f"OPENAI_BASE_URL={url!r} has no http:// or https:// scheme.",
            f"export OPENAI_BASE_URL={fixed} (or pass --base-url {fixed}).",
            EXIT_CODES["usage"],
        )
    _check_endpoint_path(url, "--base-url" if flag_url else "OPENAI_BASE_URL")
    model = model or os.environ.get("TREADLE_MODEL")
    if not model:
        raise CliFailure(
            "No model configured.",
            "pass --model NAME or set TREADLE_MODEL (for example TREADLE_MODEL=gpt-4o-mini).",
            EXIT_CODES["usage"],
        )
    key = api_key or os.environ.get("OPENAI_API_KEY") or None
    if key is None and not is_loopback_url(url):
        raise CliFailure(
            f"No API key for {url}.",
            "set OPENAI_API_KEY (or pass --api-key KEY), or point --base-url at a local "
            "OpenAI-compatible server such as http://127.0.0.1:8080/v1.",
            EXIT_CODES["usage"],
        )
    return Endpoint(model=model, base_url=url, api_key=key)


# The request paths Treadle appends itself: a base URL ending in one 404s on every request.
_ENDPOINT_PATHS = ("/chat/completions", "/completions", "/responses", "/models")


def _check_endpoint_path(url: str, where: str) -> None:
    parts = urlsplit(url)
    path = parts.path.rstrip("/")
    for suffix in _ENDPOINT_PATHS:
        if path.endswith(suffix):
            if has_secret_parts(url):  # never echo user-info or a query: they can hold a key
                fix = f"remove {suffix} from the end of {where} (Treadle appends it)."
            else:
                base = parts._replace(path=path[: -len(suffix)]).geturl()
                typed = f"pass --base-url {base}"
                if where != "--base-url":
                    typed = f"export OPENAI_BASE_URL={base} (or {typed})"
                fix = f"{typed}; Treadle appends {suffix} itself."
            raise CliFailure(
                f"{where} ends in {suffix}, the request path: it must be the base URL (it ends "
                "in /v1 for most servers).",
                fix,
                EXIT_CODES["usage"],
            )


#: The placements `--sandbox` names by word; anything else is a directory.
SANDBOX_WORDS = ("local", "isolated")


def check_sandbox(value: str | None) -> None:
    """Refuse a `--sandbox` value that looks like a misspelt placement.

    A word that is neither `local`/`isolated`, nor an existing directory, nor a path with a `/`
    would otherwise be created as a new directory and its commands run on the host; the user
    asks for a new directory by writing it as a path (`./NAME`), whose parent must exist.
    """
    if value is None or value in SANDBOX_WORDS or os.path.isdir(value):
        return
    if not value.strip():
        raise CliFailure(
            "--sandbox was given an empty value.",
            "pass --sandbox local (a temporary directory), --sandbox isolated, or a directory "
            "like --sandbox ./work (created if missing).",
            EXIT_CODES["usage"],
        )
    if os.path.lexists(value):
        # A file (or a link to one) where a directory must be: creating it would fail later.
        raise CliFailure(
            f"--sandbox {value!r} is a file, not a directory.",
            "pass a directory (--sandbox ./work is created if missing), or --sandbox local for "
            "a temporary one.",
            EXIT_CODES["usage"],
        )
    if "/" in value:
        # Only the last part is created: a mistyped parent (`/tmp/wrok/box`) is not made.
        parent = os.path.dirname(os.path.abspath(value))
        if not os.path.isdir(parent):
            raise CliFailure(
                f"--sandbox {value!r}: its parent directory {parent} does not exist.",
                f"check the path, or create it first: mkdir -p {shlex.quote(value)}",
                EXIT_CODES["usage"],
            )
        return
    import difflib

    close = difflib.get_close_matches(value, SANDBOX_WORDS, n=1, cutoff=0.5)
    guess = f"did you mean --sandbox {close[0]}? " if close else ""
    raise CliFailure(
        f"--sandbox {value!r} is neither local, isolated nor an existing directory.",
        f"{guess}pass --sandbox local or --sandbox isolated, or --sandbox ./{value} to create "
        "a new directory.",
        EXIT_CODES["usage"],
    )


def check_limits(
    *,
    timeout: float | None = None,
    retries: int | None = None,
    max_steps: int | None = None,
    mcp_timeout: float | None = None,
) -> None:
    """Refuse a limit flag the pass would reject later, naming the flag (not `Provider`)."""
    for flag, seconds in (("--timeout", timeout), ("--mcp-timeout", mcp_timeout)):
        if seconds is not None and not (seconds > 0 and math.isfinite(seconds)):
            raise CliFailure(
                f"{flag} {seconds:g} is not a positive number of seconds.",
                f"pass {flag} SECONDS greater than 0, e.g. {flag} 30 (or leave it out for the "
                "default).",
                EXIT_CODES["usage"],
            )
    if retries is not None and retries < 0:
        raise CliFailure(
            f"--retries {retries} is negative.",
            "pass --retries 0 for no retries, or a higher --retries N.",
            EXIT_CODES["usage"],
        )
    if max_steps is not None and max_steps < 1:
        raise CliFailure(
            f"--max-steps {max_steps} allows no step.",
            "pass --max-steps 1 or more (or leave it out for the default).",
            EXIT_CODES["usage"],
        )


def check_mcp_urls(urls: Sequence[str]) -> None:
    """Refuse an `--mcp-url` without an http:// or https:// scheme before any server starts."""
    for url in urls:
        if urlsplit(url).scheme in ("http", "https") and urlsplit(url).hostname:
            continue
        if has_secret_parts(url):
            raise CliFailure(
                "an --mcp-url has no http:// or https:// scheme.",
                "put http:// (a local server) or https:// (a TLS one) in front of it.",
                EXIT_CODES["usage"],
            )
        fixed = _with_scheme(url)
        raise CliFailure(
            f"--mcp-url {url!r} has no http:// or https:// scheme.",
            f"pass --mcp-url {fixed} (http:// for a local server, https:// for a TLS one).",
            EXIT_CODES["usage"],
        )


def _uses_proxy() -> bool:
    return any(os.environ.get(name) or os.environ.get(name.upper()) for name in _PROXY_VARIABLES)


def check_host_resolves(base_url: str, *, timeout: float = RESOLVE_TIMEOUT) -> None:
    """Raise `CliFailure` when DNS says the host of `base_url` does not exist.

    Skipped for loopback and IP-literal hosts and behind a proxy. A lookup slower than
    `timeout`, or a temporary failure (`EAI_AGAIN`), is left to the pass and its retries.
    """
    import socket  # only a pass that is about to run needs it

    parts = urlsplit(base_url)
    host = parts.hostname
    if not host or is_loopback_url(base_url) or _uses_proxy() or _is_ip(host):
        return
    port = parts.port or (443 if parts.scheme == "https" else 80)
    outcome: list[BaseException | None] = []

    def lookup() -> None:
        try:
            socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as err:
            outcome.append(err)
        else:
            outcome.append(None)

    # A daemon thread, so a resolver that hangs past `timeout` cannot keep the command alive.
    thread = threading.Thread(target=lookup, name="treadle-preflight-dns", daemon=True)
    thread.start()
    thread.join(timeout)
    error = outcome[0] if outcome else None
    if not isinstance(error, socket.gaierror) or error.errno == socket.EAI_AGAIN:
        return
    raise CliFailure(
        f"Cannot resolve the host {host!r} of {base_url} ({error.strerror}); a retry would "
        "fail the same way.",
        "check the host name in --base-url / OPENAI_BASE_URL (and your DNS or proxy settings).",
        EXIT_CODES["connection"],
    )


def _is_ip(host: str) -> bool:
    import socket

    try:
        socket.inet_pton(socket.AF_INET6 if ":" in host else socket.AF_INET, host)
    except OSError:
        return False
    return True
