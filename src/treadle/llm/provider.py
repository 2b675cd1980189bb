"""`Provider`: where a model lives and how to call it (endpoint, key, sampling, retries, limits).

A `Provider` is a frozen value. Fields left as `None` fall back to the environment when the provider
is first resolved (`OPENAI_API_KEY`, `OPENAI_BASE_URL`, `TREADLE_MODEL`). This module must never
print, log or put the API key into an exception message: `repr`/`str` show it masked.
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from treadle.errors import ConfigurationError

if TYPE_CHECKING:  # httpx is imported by the first request, not by building a Provider
    import ssl

    import httpx

    from treadle._http.pool import NetworkOptions

__all__ = [
    "DEFAULT_BASE_URL",
    "DEFAULT_CONNECT_TIMEOUT",
    "DEFAULT_FIRST_WAVE",
    "DEFAULT_MAX_CONCURRENT_REQUESTS",
    "DEFAULT_POOL_TIMEOUT",
    "DEFAULT_READ_TIMEOUT",
    "Provider",
    "is_loopback_url",
    "mask_secret",
]

DEFAULT_BASE_URL = "https://api.openai.com/v1"

#: Body fields Treadle itself writes; options of the same name are ignored.
RESERVED_BODY_KEYS = frozenset({"messages", "tools", "stream"})
"""Used when neither `base_url` nor `OPENAI_BASE_URL` is set."""
DEFAULT_CONNECT_TIMEOUT = 10.0
"""Seconds to open a TCP (and TLS) connection."""
DEFAULT_READ_TIMEOUT = 600.0
"""Seconds to wait between two reads of a response (a long reasoning reply stays silent a while)."""
DEFAULT_MAX_CONCURRENT_REQUESTS = 1024
"""Default cap on requests in flight per endpoint: generous, it only stops runaway fan-outs."""
DEFAULT_POOL_TIMEOUT = 5.0
"""Seconds a request waits for a free connection of the pool (httpx's default)."""
DEFAULT_FIRST_WAVE = 16
"""Requests sent to a new endpoint before its first reply says what its limits are: below the
burst any provider we know of allows, and enough that a fan-out starts at once."""

_LOOPBACK_HOSTS = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


def mask_secret(secret: str | None) -> str:
    """Show a secret the way Treadle prints it: `sk-…abcd` (prefix and last four) or `***`."""
    if not secret:
        return "None"
    if len(secret) < 12:
        return "***"
    prefix = secret[:3] if secret.startswith("sk-") else ""
    return f"{prefix}…{secret[-4:]}"


def is_loopback_url(url: str) -> bool:
    """True when `url` points at this machine (localhost, 127.0.0.0/8, ::1): no API key needed."""
    host = (urlsplit(url).hostname or "").lower()
    if host in _LOOPBACK_HOSTS or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_range(name: str, value: float | None, low: float, high: float) -> None:
    if value is not None and not (low <= value <= high and math.isfinite(value)):
        raise ConfigurationError(
            f"Provider.{name} must be between {low} and {high}, got {value!r}."
        )


def _check_timeout(t: object) -> Any:
    """`t` if it is seconds, a `(connect, read)` pair or an `httpx.Timeout`; else a clear error.

    An `httpx.Timeout` can only exist once httpx is imported, so the check needs no import.
    """
    httpx_module = sys.modules.get("httpx")
    if httpx_module is not None and isinstance(t, httpx_module.Timeout):
        return t
    if isinstance(t, tuple):
        if len(t) != 2:
            raise ConfigurationError("Provider.timeout pair must be (connect, read) seconds.")
        _check_positive("timeout", t[0])
        _check_positive("timeout", t[1])
        return t
    if isinstance(t, int | float) and not isinstance(t, bool):
        _check_positive("timeout", t)
        return t
    raise ConfigurationError(
        "Provider.timeout must be seconds, a (connect, read) pair or an httpx.Timeout."
    )


def _check_positive(name: str, value: float | None) -> None:
    if value is not None and not (value > 0 and math.isfinite(value)):
        raise ConfigurationError(f"Provider.{name} must be a positive number, got {value!r}.")


@dataclass(frozen=True, eq=True, repr=False)
class Provider:
    """An OpenAI-compatible chat-completions endpoint plus the options of every request to it.

    `Provider(model="gpt-4o-mini")` is enough when `OPENAI_API_KEY` is set. A key is required
    unless `base_url` points at loopback (`localhost`, `127.0.0.1`, `::1`): local servers such as
    llama.cpp, vLLM, Ollama or `treadle.testing.FakeOpenAIServer` accept any key.
    """

    model: str | None = None
    """Model name sent in each request; falls back to `TREADLE_MODEL`."""
    base_url: str | None = None
    """Endpoint root such as `https://api.openai.com/v1`; falls back to `OPENAI_BASE_URL`."""
    api_key: str | None = field(default=None, compare=False)
    """Bearer token; falls back to `OPENAI_API_KEY`. Never printed (shown masked)."""
    temperature: float | None = None
    """Sampling temperature in [0, 2]; omitted from requests when None."""
    top_p: float | None = None
    """Nucleus sampling mass in [0, 1]; omitted when None."""
    max_tokens: int | None = None
    """Cap on generated tokens per completion; omitted when None."""
    tool_choice: str | Mapping[str, Any] | None = None
    """`"auto"`, `"none"`, `"required"` or a function choice; only sent with tools."""
    parallel_tool_calls: bool | None = None
    """Whether the model may call several tools in one reply; only sent with tools."""
    response_format: Mapping[str, Any] | None = None
    """For example `{"type": "json_object"}`; omitted when None."""
    seed: int | None = None
    """Sampling seed, for servers that honour it."""
    stop: str | Sequence[str] | None = None
    """Stop sequence(s)."""
    extra_body: Mapping[str, Any] | None = None
    """Extra top-level request fields (server specific, e.g. `{"top_k": 20}`); merged last."""
    stream: bool = False
    """Whether the session loop streams completions (SSE) instead of waiting for whole replies."""
    timeout: float | tuple[float, float] | httpx.Timeout = (
        DEFAULT_CONNECT_TIMEOUT,
        DEFAULT_READ_TIMEOUT,
    )
    """Seconds: one number for every phase, a `(connect, read)` pair, or an `httpx.Timeout`."""
    max_retries: int = 3
    """Retries after the first attempt on 408/429/5xx and connection errors (0 disables)."""
    retry_base_delay: float = 0.5
    """First backoff step in seconds; doubles each retry (full jitter), capped at 8 s."""
    budget_total_tokens: int | None = None
    """Soft token budget of one pass: when a reply first crosses it, `on_budget_exceeded` decides;
    without a callback one warning is logged (logger `treadle`) and the pass runs on. The hard
    stop is `Limits(max_total_tokens=...)` (`stop_reason == "budget"`)."""
    on_budget_exceeded: Callable[..., Any] | None = field(default=None, compare=False)
    """Called once, as `(session, usage)`, when the budget is first crossed: raise
    `BudgetExceededError` to stop the pass (after the round's tools ran), return to let it run
    on. A parameter annotated `ToolContext` also receives the pass's context."""
    max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS
    """Cap on requests in flight to this endpoint from this process."""
    requests_per_minute: int | None = None
    """Cap on requests started per minute to this endpoint (None: no cap)."""
    tokens_per_minute: int | None = None
    """Cap on tokens per minute (estimated from request size, corrected by reported usage)."""
    learn_rate_limits: bool = True
    """Pace requests below the limits the endpoint reports (`x-ratelimit-*` headers, 429s)."""
    rate_limit_share: float = 1.0
    """Part (0-1] of the endpoint's reported limits this process paces at (backends: 1/workers)."""
    first_wave: int = DEFAULT_FIRST_WAVE
    """Requests sent to a new endpoint before its first reply says what its limits are (when
    learning): a fan-out starts at once instead of after one round trip."""
    http_client: httpx.AsyncClient | None = field(default=None, compare=False)
    """A client of your own (transports, hooks); used instead of Treadle's pooled client."""
    proxy: str | None = None
    """A proxy URL (`http://user:pass@host:port`) for every request; wins over the environment."""
    trust_env: bool = True
    """Read `HTTP(S)_PROXY`, `ALL_PROXY`, `NO_PROXY`, `SSL_CERT_FILE`, `SSL_CERT_DIR` (as httpx)."""
    verify: bool | str | ssl.SSLContext = True
    """Server certificate checks: True (default CAs), False (none), a CA file or directory, or an
    `ssl.SSLContext`."""
    cert: str | tuple[str, str] | None = None
    """A client certificate: one PEM file with its key, or `(cert_file, key_file)`."""
    pool_timeout: float | None = DEFAULT_POOL_TIMEOUT
    """Seconds a request waits for a free connection when the pool is full (None: no limit);
    then it fails with `ProviderTimeout`."""

    _resolved: Provider | None = field(default=None, init=False, repr=False, compare=False)
    _cache: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.model is not None and (not isinstance(self.model, str) or not self.model.strip()):
            raise ConfigurationError("Provider.model must be a non-empty string or None.")
        if self.base_url is not None:
            scheme = urlsplit(self.base_url).scheme
            if scheme not in ("http", "https"):
                raise ConfigurationError(
                    f"Provider.base_url must start with http:// or https://, got {self.base_url!r}."
                )
        _check_range("temperature", self.temperature, 0.0, 2.0)
        _check_range("top_p", self.top_p, 0.0, 1.0)
        for name in ("max_tokens", "budget_total_tokens", "requests_per_minute"):
            value = getattr(self, name)
            # A bool is an int to Python, but True is never a meant count of tokens.
            bad = isinstance(value, bool) or not isinstance(value, int) or value <= 0
            if value is not None and bad:
                raise ConfigurationError(
                    f"Provider.{name} must be a positive integer or None, got {value!r}."
                )
        if self.tokens_per_minute is not None and (
            not isinstance(self.tokens_per_minute, int) or self.tokens_per_minute <= 0
        ):
            raise ConfigurationError(
                "Provider.tokens_per_minute must be a positive integer or None."
            )
        if not isinstance(self.max_retries, int) or self.max_retries < 0:
            raise ConfigurationError(
                f"Provider.max_retries must be an integer >= 0, got {self.max_retries!r}."
            )
        if not isinstance(self.max_concurrent_requests, int) or self.max_concurrent_requests < 1:
            raise ConfigurationError("Provider.max_concurrent_requests must be an integer >= 1.")
        if (
            not isinstance(self.first_wave, int)
            or isinstance(self.first_wave, bool)
            or self.first_wave < 1
        ):
            raise ConfigurationError(
                f"Provider.first_wave must be an integer >= 1, got {self.first_wave!r}."
            )
        if not (isinstance(self.rate_limit_share, int | float) and 0 < self.rate_limit_share <= 1):
            raise ConfigurationError(
                f"Provider.rate_limit_share must be in (0, 1], got {self.rate_limit_share!r}."
            )
        if not (self.retry_base_delay >= 0 and math.isfinite(self.retry_base_delay)):
            raise ConfigurationError("Provider.retry_base_delay must be a number >= 0.")
        _check_timeout(self.timeout)  # the shape is checked now, not at the first request
        if self.pool_timeout is not None:
            _check_positive("pool_timeout", self.pool_timeout)
        if self.proxy is not None and urlsplit(self.proxy).scheme not in ("http", "https"):
            raise ConfigurationError(
                "Provider.proxy must be an http:// or https:// proxy URL, got a URL of scheme "
                f"{urlsplit(self.proxy).scheme!r}."
            )
        if self.http_client is not None and (
            self.proxy is not None or self.verify is not True or self.cert is not None
        ):
            raise ConfigurationError(
                "Provider.proxy, verify and cert configure Treadle's own pool; with "
                "http_client=, set them on your httpx.AsyncClient instead."
            )
        if self.on_budget_exceeded is not None and not callable(self.on_budget_exceeded):
            raise ConfigurationError("Provider.on_budget_exceeded must be callable or None.")

    def __repr__(self) -> str:
        shown = []
        for f in dataclasses.fields(self):
            if not f.repr:
                continue
            value = getattr(self, f.name)
            if f.name == "api_key":
                shown.append(f"api_key={mask_secret(value)!s}")
            elif f.name == "proxy" and value is not None:
                shown.append("proxy=***")  # may carry credentials
            elif value is not None and value != f.default:
                shown.append(f"{f.name}={value!r}")
        return f"Provider({', '.join(shown)})"

    __str__ = __repr__

    @classmethod
    def from_env(cls, **overrides: Any) -> Provider:
        """A provider from `OPENAI_API_KEY`, `OPENAI_BASE_URL`, `TREADLE_MODEL` plus overrides."""
        values: dict[str, Any] = {
            "model": os.environ.get("TREADLE_MODEL") or None,
            "base_url": os.environ.get("OPENAI_BASE_URL") or None,
            "api_key": os.environ.get("OPENAI_API_KEY") or None,
        }
        values.update(overrides)
        return cls(**values).resolve()

    def replace(self, **changes: Any) -> Provider:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @property
    def network_options(self) -> NetworkOptions:
        """`proxy`, `trust_env`, `verify` and `cert` as the HTTP layer's options (one value)."""
        cached: NetworkOptions | None = self._cache.get("network_options")
        if cached is None:
            from treadle._http.pool import NetworkOptions

            cached = NetworkOptions(
                proxy=self.proxy, trust_env=self.trust_env, verify=self.verify, cert=self.cert
            )
            self._cache["network_options"] = cached
        return cached

    @property
    def httpx_timeout(self) -> httpx.Timeout:
        """The timeout as an `httpx.Timeout` (write and pool waits take the connect value)."""
        cached = self._cache.get("timeout")
        if cached is not None:
            return cached  # type: ignore[no-any-return]
        import httpx

        t = _check_timeout(self.timeout)
        if isinstance(t, httpx.Timeout):
            result = t
        elif isinstance(t, tuple):
            result = httpx.Timeout(t[1], connect=t[0])
        else:
            result = httpx.Timeout(float(t))
        self._cache["timeout"] = result
        return result

    def body_head(self, *, with_tools: bool) -> tuple[bytes, frozenset[str]]:
        """`{"model":...,<options>` (no closing brace) of every request body, and its keys.

        Encoded once per provider value: request bodies join it with pre-encoded messages.
        """
        key = "body_head_tools" if with_tools else "body_head"
        cached: tuple[bytes, frozenset[str]] | None = self._cache.get(key)
        if cached is None:
            import pydantic_core  # loads with the first request, not with `import treadle`

            opts = self.sampling_options(with_tools=with_tools)
            for name in RESERVED_BODY_KEYS:
                opts.pop(name, None)
            cached = (pydantic_core.to_json(opts)[:-1], frozenset(opts))
            self._cache[key] = cached
        return cached

    def resolve(self) -> Provider:
        """This provider with env fallbacks filled in; raises `ConfigurationError` if unusable.

        The environment is read once per provider value; the result is cached.
        """
        if self._resolved is not None:
            return self._resolved
        model = self.model or os.environ.get("TREADLE_MODEL") or None
        base_url = self.base_url or os.environ.get("OPENAI_BASE_URL") or DEFAULT_BASE_URL
        api_key = self.api_key or os.environ.get("OPENAI_API_KEY") or None
        if model is None:
            raise ConfigurationError(
                "No model configured: pass Provider(model=...) or set TREADLE_MODEL."
            )
        if api_key is None and not is_loopback_url(base_url):
            raise ConfigurationError(
                f"No API key for {base_url}: pass Provider(api_key=...) or set OPENAI_API_KEY."
            )
        if (model, base_url, api_key) == (self.model, self.base_url, self.api_key):
            resolved = self
        else:
            resolved = dataclasses.replace(self, model=model, base_url=base_url, api_key=api_key)
        object.__setattr__(resolved, "_resolved", resolved)
        object.__setattr__(self, "_resolved", resolved)
        return resolved

    def check(self) -> None:
        """Raise `ConfigurationError` now if a request could not be sent (alias of `resolve`)."""
        self.resolve()

    @property
    def endpoint_key(self) -> tuple[str, str]:
        """`(base_url, key fingerprint)`: identifies one connection pool and one limiter."""
        resolved = self.resolve()
        cached = resolved._cache.get("endpoint_key")
        if cached is None:
            key = resolved.api_key or ""
            digest = hashlib.sha256(key.encode()).hexdigest()[:16]
            cached = (str(resolved.base_url).rstrip("/"), digest)
            resolved._cache["endpoint_key"] = cached
        return cached

    @property
    def chat_completions_url(self) -> str:
        """`{base_url}/chat/completions`, appended to the path: a query in the base URL
        (`...?api-version=1`, as Azure's) is kept after it."""
        base = self.endpoint_key[0]
        if "?" not in base and "#" not in base:
            return f"{base}/chat/completions"
        parts = urlsplit(base)
        path = f"{parts.path.rstrip('/')}/chat/completions"
        return urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))

    def request_headers(self) -> dict[str, str]:
        """Headers of every request: JSON content type and the bearer token when there is one."""
        resolved = self.resolve()
        cached = resolved._cache.get("headers")
        if cached is None:
            cached = {"content-type": "application/json", "accept": "application/json"}
            if resolved.api_key:
                cached["authorization"] = f"Bearer {resolved.api_key}"
            resolved._cache["headers"] = cached
        return cached

    def sampling_options(self, *, with_tools: bool) -> dict[str, Any]:
        """Request fields set on this provider, in wire form (tool options only `with_tools`)."""
        opts: dict[str, Any] = {"model": self.resolve().model}
        for name in ("temperature", "top_p", "max_tokens", "response_format", "seed"):
            value = getattr(self, name)
            if value is not None:
                opts[name] = dict(value) if isinstance(value, Mapping) else value
        if self.stop is not None:
            opts["stop"] = self.stop if isinstance(self.stop, str) else list(self.stop)
        if with_tools:
            if self.tool_choice is not None:
                tc = self.tool_choice
                opts["tool_choice"] = dict(tc) if isinstance(tc, Mapping) else tc
            if self.parallel_tool_calls is not None:
                opts["parallel_tool_calls"] = self.parallel_tool_calls
        if self.extra_body:
            opts.update(self.extra_body)
        return opts
