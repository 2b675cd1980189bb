"""What produced a transcript or an eval log: Treadle's version, the model, the endpoint and the
options that shape the model's output, as one small JSON object (`"producer"` in a header).

```
{"treadle": "0.1.0", "model": "gpt-4o-mini", "endpoint": "https://api.openai.com",
 "options": {"temperature": 0.2, "seed": 7}}
```

It must never record a secret: the API key is never read, the base URL is cut to its origin
(`scheme://host[:port]`: a path, a query or user-info can carry a key), and `extra_body` fields
whose names look like credentials are masked. Pure values; no I/O.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from treadle.errors import ConfigurationError

if TYPE_CHECKING:  # a provider is read, never built, here
    from treadle.llm.provider import Provider

__all__ = ["OUTPUT_OPTIONS", "endpoint_origin", "plain_json", "producer_record"]

#: `Provider` fields that change what the model answers (the rest are transport and limits).
OUTPUT_OPTIONS = (
    "temperature",
    "top_p",
    "max_tokens",
    "seed",
    "stop",
    "response_format",
    "tool_choice",
    "parallel_tool_calls",
    "extra_body",
)

_SECRET_WORDS = ("key", "token", "secret", "password", "auth", "credential")


def endpoint_origin(base_url: str | None) -> str | None:
    """`scheme://host[:port]` of `base_url`: no user-info, path or query (they can hold keys)."""
    if not base_url:
        return None
    try:
        parts = urlsplit(base_url)
        host, port = parts.hostname, parts.port
    except ValueError:  # an unparseable port: record nothing rather than the raw text
        return None
    if not host:
        return None
    shown = f"[{host}]" if ":" in host else host
    return f"{parts.scheme}://{shown}" + (f":{port}" if port is not None else "")


def plain_json(value: Any) -> Any:
    """A JSON-able copy of an option value (unknown objects by their repr); the evals' agent
    fingerprint renders its values with it too."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, Mapping):
        return {str(k): plain_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain_json(v) for v in value]
    return repr(value)


def _masked(value: Any) -> Any:
    """`value` with every credential-looking key masked, at any depth (`extra_body` may nest
    headers: `{"headers": {"Authorization": ...}}`)."""
    if isinstance(value, Mapping):
        return {
            str(k): "***" if any(w in str(k).lower() for w in _SECRET_WORDS) else _masked(v)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [_masked(v) for v in value]
    return plain_json(value)


def producer_record(provider: Provider | None, *, version: str | None = None) -> dict[str, Any]:
    """The `"producer"` object for a pass run with `provider` (None: a custom executor).

    The provider's environment fallbacks (`TREADLE_MODEL`, `OPENAI_BASE_URL`) are filled in when
    it resolves; a provider that cannot resolve is recorded as given.
    """
    if version is None:
        # The package is always loaded before its submodules, and this layer may not import the
        # `treadle` face (tests/test_layers.py): read the version off the loaded package.
        version = str(sys.modules["treadle"].__version__)
    record: dict[str, Any] = {"treadle": version}
    if provider is None:
        return record
    # A custom executor may run with a provider that names no key or model: recorded as given.
    with contextlib.suppress(ConfigurationError):
        provider = provider.resolve()
    record["model"] = provider.model
    record["endpoint"] = endpoint_origin(provider.base_url)
    options: dict[str, Any] = {}
    for name in OUTPUT_OPTIONS:
        value = getattr(provider, name)
        if value is None:
            continue
        options[name] = _masked(value) if name == "extra_body" else plain_json(value)
    record["options"] = options
    return record
