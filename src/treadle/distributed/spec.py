"""`AgentSpec`: an agent as plain data, so it can cross process and machine boundaries.

A spec names everything a worker needs to rebuild the agent: the model, the endpoint URL, the
instructions, the tools by import path (`package.module:function`), limits and the per-endpoint
rate limits. An agent with parts that are code rather than data (structured output, guardrails,
validators, hooks, handoffs, error handlers) crosses by its own import path instead
(`package.module:agent`, as `treadle eval --agent` names one): each worker imports the module
and gets the same definition, then gives it its own provider.

The API key never travels: the spec carries the *name* of the environment variable
holding it, and each worker reads its own environment. This module must never put a secret into
a spec and never import a tool before a worker builds the agent.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from treadle.errors import ConfigurationError
from treadle.llm.provider import Provider
from treadle.loop import DEFAULT_MAX_TOOL_ROUNDS, Limits

__all__ = [
    "DEFAULT_API_KEY_ENV",
    "AgentSpec",
    "agent_path",
    "import_path",
    "resolve_tool",
    "tool_path",
]

#: The environment variable a worker reads the API key from when the spec names none.
DEFAULT_API_KEY_ENV = "OPENAI_API_KEY"


def tool_path(tool: Any) -> str:
    """The import path `package.module:qualname` of a tool function (or a `@tool` object).

    Raises `ConfigurationError` when the function cannot be imported back by that path (lambdas,
    closures, functions defined in `__main__` or a test body).
    """
    return import_path(tool, "tool")


def import_path(obj: Any, what: str = "function") -> str:
    """The import path `package.module:qualname` of a top-level function (`what` names it in
    errors); a string is checked for the shape and returned as it is."""
    if isinstance(obj, str):
        head, sep, tail = obj.partition(":")
        if not (head and sep and tail):
            raise ConfigurationError(
                f"{what} path {obj!r} must look like 'package.module:function'."
            )
        return obj
    fn = getattr(obj, "fn", obj)
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not module or not qualname or "<" in qualname or module == "__main__":
        raise ConfigurationError(
            f"{what} {getattr(obj, 'name', qualname)!r} cannot cross to a worker: define it at the "
            "top level of an importable module and pass it (or 'package.module:function')."
        )
    path = f"{module}:{qualname}"
    resolved = resolve_tool(path)
    if resolved is not obj and getattr(resolved, "fn", resolved) is not fn:
        raise ConfigurationError(
            f"{what} path {path!r} does not lead back to the same {what}; define it at the "
            "top level of its module."
        )
    return path


def resolve_tool(path: str) -> Any:
    """Import the tool named by `package.module:qualname`."""
    module_name, sep, qualname = path.partition(":")
    if not sep or not module_name or not qualname:
        raise ConfigurationError(f"tool path {path!r} must look like 'package.module:function'.")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as err:
        raise ConfigurationError(
            f"cannot import tool {path!r} on this worker ({err}); install the module that "
            "defines it on every worker."
        ) from None
    return obj


def _code_parts(
    agent: Any, at: str = "agent", seen: set[int] | None = None, tools: bool = False
) -> list[tuple[str, Any]]:
    """The parts of an agent that are code (they cross only with the agent's import path), as
    `(attribute path, object)`: `("agent.handoffs[0].is_enabled", <lambda>)`; handoff targets'
    own parts too (each agent once, so agents handing back to each other end). With `tools`,
    also every tool, an agent tool as its agent's parts and its `output_extractor`."""
    from treadle.agents.agent_tool import AgentTool, DelegateTool

    seen = set() if seen is None else seen
    seen.add(id(agent))
    parts: list[tuple[str, Any]] = []
    for i, t in enumerate(agent.tools if tools else ()):
        inner = getattr(t, "agent", None)
        if not isinstance(t, (AgentTool, DelegateTool)) or inner is None:
            parts.append((f"{at}.tools[{i}]", t))
            continue
        parts.append((f"{at}.tools[{i}].agent", inner))
        if t.extractor is not None:
            parts.append((f"{at}.tools[{i}].output_extractor", t.extractor))
        if id(inner) not in seen:
            parts += _code_parts(inner, f"{at}.tools[{i}].agent", seen, tools)
    for i, g in enumerate(agent.guardrails):
        check = getattr(g, "check", None)
        parts.append(
            (f"{at}.guardrails[{i}].check", check) if check else (f"{at}.guardrails[{i}]", g)
        )
    parts += [(f"{at}.validators[{i}]", fn) for i, (fn, _count) in enumerate(agent.validators)]
    parts += [(f"{at}.error_handlers[{k!r}]", fn) for k, fn in agent.error_handlers.items()]
    for i, target in enumerate(agent.handoffs):
        here = f"{at}.handoffs[{i}]"
        parts.append((f"{here}.agent", target.agent))
        for name in ("on_handoff", "input_filter", "is_enabled"):
            value = getattr(target, name)
            if callable(value):
                parts.append((f"{here}.{name}", value))
        if id(target.agent) not in seen:
            parts += _code_parts(target.agent, f"{here}.agent", seen, tools)
    if agent.hooks is not None:
        parts.append((f"{at}.hooks", agent.hooks))
    if agent.output_type is not None:
        parts.append((f"{at}.output_type", agent.output_type))
    if agent.dynamic_instructions is not None:
        parts.append((f"{at}.dynamic_instructions", agent.dynamic_instructions))
    return parts


def _settings_off_spec(agent: Any) -> list[str]:
    """The `Agent` settings an `AgentSpec`'s data does not carry that differ from their
    defaults: such an agent crosses by its import path, or a worker would run it without them
    (a `tool_use_behavior` of `"stop_on_first_tool"` asked the model again)."""
    from treadle.agents.compaction import DEFAULT_KEEP_LAST

    defaults = {
        "tool_use_behavior": "run_llm_again",
        "reset_tool_choice": True,
        "compact_at_tokens": None,
        "compact_keep_last": DEFAULT_KEEP_LAST,
        "compact_on_overflow": True,
        "compaction_instruction": None,
    }
    return [name for name, value in defaults.items() if getattr(agent, name, value) != value]


def _needs_path(agent: Any) -> bool:
    if _code_parts(agent) or _settings_off_spec(agent):
        return True
    try:
        for t in agent.tools:
            tool_path(t)
    except ConfigurationError:
        return bool(agent.tools)
    return False


def _found_at_top_level(agent: Any) -> str | None:
    """`module:name` of an agent that is a top-level name of an importable module."""
    module_name = getattr(agent, "_defined_in", None)
    module = sys.modules.get(module_name) if isinstance(module_name, str) else None
    if module is not None and module_name != "__main__":
        for attr, value in vars(module).items():
            if value is agent:
                return f"{module_name}:{attr}"
    return None


def _not_importable(obj: Any) -> str | None:
    """Why `obj` (a function, class, instance or Agent) cannot be imported by a worker on its
    own, or None when it can."""
    from treadle.agents import Agent

    if isinstance(obj, Agent):
        if _found_at_top_level(obj) is not None:
            return None
        where = getattr(obj, "_defined_in", None)
        place = "in __main__" if where == "__main__" else "inside a function"
        return f"is Agent {obj.name!r}, built {place}"
    what = "function"
    target = getattr(obj, "fn", obj)  # a @tool object: its function
    if isinstance(target, functools.partial):
        return f"is a functools.partial of {_callable_name(target.func)}, which has no import path"
    if not (isinstance(target, type) or (callable(target) and hasattr(target, "__qualname__"))):
        target, what = type(obj), "instance of class"
    elif isinstance(target, type):
        what = "class"
    qualname = str(getattr(target, "__qualname__", ""))
    module = getattr(target, "__module__", None)
    if qualname == "<lambda>" or qualname.endswith(".<lambda>"):
        return "is a lambda"
    if "<locals>" in qualname:
        outer = qualname.rsplit(".<locals>", 1)[0].rsplit(".", 1)[-1]  # the enclosing function
        return f"is {_a(what)} {qualname.rsplit('.', 1)[-1]!r} defined inside {outer}()"
    if module == "__main__":
        return f"is {_a(what)} {qualname!r} defined in __main__, which workers never run"
    try:
        import_path(target, what)
    except ConfigurationError:
        return f"is {_a(what)} {qualname!r} that {module}:{qualname} does not lead back to"
    return None


def _callable_name(fn: Any) -> str:
    return repr(str(getattr(fn, "__qualname__", type(fn).__name__)))


def _a(what: str) -> str:
    return f"an {what}" if what[0] in "aeiou" else f"a {what}"


def agent_path(agent: Any) -> str:
    """The import path `package.module:name` of an `Agent` defined at the top level of a module.

    Raises `ConfigurationError` naming what cannot cross: where the agent was built (inside a
    function, in `__main__`), and each of its code parts that cannot be imported on its own (a
    lambda, a local function, a class defined in `__main__`), by attribute path
    (`agent.handoffs[0].is_enabled`), with the fix.
    """
    found = _found_at_top_level(agent)
    if found is not None:
        return found
    where = getattr(agent, "_defined_in", None)
    if where == "__main__":
        built = "it is defined in __main__ (your script), which workers never run"
    else:
        built = "it is not a top-level name of an importable module (built inside a function?)"
    named = [
        f"{attr} {why}"
        for attr, obj in _code_parts(agent, tools=True)
        if (why := _not_importable(obj)) is not None
    ]
    parts = f" What cannot be imported: {'; '.join(named)}." if named else ""
    settings = _settings_off_spec(agent)
    if settings:
        parts += f" Settings that cross only with it: {', '.join(settings)}."
    raise ConfigurationError(
        f"Agent {agent.name!r} cannot cross to a worker: workers import an agent with code parts "
        f"(output type, guardrails, validators, hooks, handoffs) or settings beyond the model's "
        f"and its limits (tool_use_behavior, compaction) by its path, and {built}."
        f"{parts} Fix: define the agent and those parts at the top level of an importable "
        "module (e.g. myapp/agents.py), then pass it or 'myapp.agents:agent'."
    )


def _limits_dict(limits: Limits | None) -> dict[str, Any] | None:
    return None if limits is None else dataclasses.asdict(limits)


@dataclass(frozen=True)
class AgentSpec:
    """Everything a worker needs to rebuild an agent, as JSON-able data (no secrets)."""

    model: str
    """Model name sent in each request."""
    instructions: str = ""
    """The system prompt."""
    name: str = "agent"
    """The agent's name (lineage, logs)."""
    base_url: str | None = None
    """Endpoint root; None lets each worker use its own `OPENAI_BASE_URL`."""
    api_key_env: str = DEFAULT_API_KEY_ENV
    """Name of the environment variable each worker reads its API key from."""
    tools: tuple[str, ...] = ()
    """Tools by import path, `package.module:function`."""
    limits: Mapping[str, Any] | None = None
    """`Limits` fields (max_steps, max_total_tokens, deadline_seconds, ...)."""
    max_tool_rounds: int = DEFAULT_MAX_TOOL_ROUNDS
    """Tool rounds per pass before `stop_reason == "max_steps"`."""
    provider_options: Mapping[str, Any] = field(default_factory=dict)
    """Other JSON-able `Provider` fields (temperature, max_tokens, timeout, max_retries, ...)."""
    max_concurrent_requests: int | None = None
    """Concurrent requests to the endpoint, over all workers (split between them)."""
    requests_per_minute: int | None = None
    """Requests per minute to the endpoint, over all workers (split, or one shared bucket)."""
    tokens_per_minute: int | None = None
    """Tokens per minute to the endpoint, over all workers (split between them)."""
    agent_path: str | None = None
    """`package.module:agent`: workers import this `Agent` (its output type, guardrails,
    validators, hooks and handoffs come with it) and give it their own provider."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model.strip():
            raise ConfigurationError(
                "AgentSpec needs a model name, e.g. AgentSpec(model='gpt-4o')."
            )
        object.__setattr__(self, "tools", tuple(tool_path(t) for t in self.tools))
        for key in ("api_key", "http_client", "on_budget_exceeded"):
            if key in self.provider_options:
                raise ConfigurationError(
                    f"provider_options cannot carry {key!r}: it does not cross machines "
                    "(keys come from each worker's environment, see api_key_env)."
                )

    @classmethod
    def from_agent(cls, agent: Any, *, api_key_env: str = DEFAULT_API_KEY_ENV) -> AgentSpec:
        """The spec of an `Agent` (or of the one named `package.module:agent`).

        An agent whose parts are all data (a provider, importable tools, limits) crosses as
        data; one with code parts (output type, guardrails, validators, hooks, handoffs, error
        handlers, or tools that are not importable functions) crosses by its import path.
        A custom executor never crosses.
        """
        if isinstance(agent, AgentSpec):
            return agent
        path: str | None = None
        if isinstance(agent, str):
            path = import_path(agent, "agent")
            agent = resolve_tool(path)
        from treadle.agents import Agent

        if not isinstance(agent, Agent):
            raise ConfigurationError(
                f"a distributed map needs an Agent, an AgentSpec or 'package.module:agent', got "
                f"{type(agent).__name__}."
            )
        provider = getattr(agent, "provider", None)
        if not isinstance(provider, Provider) or getattr(agent, "executor", None) is not None:
            raise ConfigurationError(
                "a distributed map needs an Agent with provider=Provider(...) or an AgentSpec; "
                "custom executors do not cross machines (use backend='local' for them)."
            )
        if path is None and _needs_path(agent):
            path = agent_path(agent)
        if provider.model is None:
            raise ConfigurationError(f"Agent {agent.name!r} needs Provider(model=...).")
        options = {
            f.name: getattr(provider, f.name)
            for f in dataclasses.fields(provider)
            if f.init and f.name in _PLAIN_PROVIDER_FIELDS
        }
        defaults = Provider()
        options = {k: v for k, v in options.items() if v != getattr(defaults, k)}
        return cls(
            model=provider.model,
            instructions=agent.instructions,
            name=agent.name,
            base_url=provider.base_url,
            api_key_env=api_key_env,
            tools=() if path else tuple(tool_path(t) for t in agent.tools),
            limits=_limits_dict(agent.limits),
            max_tool_rounds=agent.max_tool_rounds,
            provider_options=options,
            max_concurrent_requests=provider.max_concurrent_requests,
            requests_per_minute=provider.requests_per_minute,
            tokens_per_minute=provider.tokens_per_minute,
            agent_path=path,
        )

    def to_json(self) -> dict[str, Any]:
        """The spec as a JSON-able dict."""
        data = dataclasses.asdict(self)
        data["tools"] = list(self.tools)
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> AgentSpec:
        """The spec from `to_json` output."""
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - fields
        if unknown:
            raise ConfigurationError(f"unknown AgentSpec fields: {sorted(unknown)}.")
        return cls(**{**data, "tools": tuple(data.get("tools", ()))})

    def build_agent(
        self,
        *,
        share: float = 1.0,
        shared_rate: bool = False,
        guardrails: Sequence[Any] = (),
        api_key: str | None = None,
    ) -> Any:
        """Rebuild the `Agent` on a worker, with `share` (0-1] of the endpoint's limits.

        With `shared_rate=True` the requests-per-minute cap is left to a shared bucket (passed in
        `guardrails`). The API key is `api_key` (handed over the driver's private pipe), else
        this process's `api_key_env` variable.
        """
        from treadle.agents import Agent

        def part(value: int | None) -> int | None:
            return None if value is None else max(1, math.floor(value * share))

        options: dict[str, Any] = dict(self.provider_options)
        if isinstance(options.get("timeout"), list):
            options["timeout"] = tuple(options["timeout"])
        if self.max_concurrent_requests is not None:
            options["max_concurrent_requests"] = part(self.max_concurrent_requests)
        provider = Provider(
            model=self.model,
            base_url=self.base_url,
            api_key=api_key or os.environ.get(self.api_key_env),
            requests_per_minute=None if shared_rate else part(self.requests_per_minute),
            tokens_per_minute=part(self.tokens_per_minute),
            # Each worker learns the endpoint's limits from its own replies and paces at its part.
            rate_limit_share=min(1.0, max(share, 1e-6)),
            **options,
        )
        if self.agent_path is not None:
            defined = resolve_tool(self.agent_path)
            if not isinstance(defined, Agent):
                raise ConfigurationError(
                    f"{self.agent_path!r} is a {type(defined).__name__} on this worker, not an "
                    "Agent; install the same code on every worker."
                )
            return defined.on_worker(provider, guardrails)
        return Agent(
            self.name,
            self.instructions,
            tools=[resolve_tool(path) for path in self.tools],
            provider=provider,
            limits=Limits(**self.limits) if self.limits else None,
            max_tool_rounds=self.max_tool_rounds,
            guardrails=guardrails,
        )

    def with_tools(self, tools: Iterable[Any]) -> AgentSpec:
        """A copy offering `tools` (functions or import paths)."""
        return dataclasses.replace(self, tools=tuple(tool_path(t) for t in tools))


def explicit_key(agent: Any) -> str | None:
    """The `Provider(api_key=...)` an `Agent` was given explicitly (None for a spec or none)."""
    provider = getattr(agent, "provider", None)
    return provider.api_key if isinstance(provider, Provider) else None


def check_key_reaches_workers(name: str, api_key: str | None, api_key_env: str) -> None:
    """Refuse an explicit `Provider(api_key=...)` that Ray workers would not see.

    The key never travels in a spec (specs are logged, written and shipped as JSON). Process
    workers get it over their private pipe; Ray workers read `api_key_env` in the cluster's
    environment, so when the variable here does not hold the explicit key they would call the
    endpoint with another key or none, and every item would fail with 401. Saying so at the call
    beats 10,000 failed passes. The message names the variable, never the key.
    """
    if api_key is None or os.environ.get(api_key_env) == api_key:
        return
    state = "is not set" if os.environ.get(api_key_env) is None else "holds a different key"
    raise ConfigurationError(
        f"Agent {name!r} has an explicit Provider(api_key=...), but Ray workers never receive "
        f"keys: each reads the environment variable {api_key_env}, which here {state}. Set it "
        f"in the cluster's environment and here before the map (os.environ[{api_key_env!r}] = "
        "key), name your variable with api_key_env='...', or use backend='process', whose "
        "workers get the key over a private pipe."
    )


# Provider fields that are plain JSON data and worth carrying (secrets and objects are not).
_PLAIN_PROVIDER_FIELDS = frozenset(
    {
        "temperature",
        "top_p",
        "max_tokens",
        "tool_choice",
        "parallel_tool_calls",
        "response_format",
        "seed",
        "stop",
        "extra_body",
        "stream",
        "timeout",
        "max_retries",
        "retry_base_delay",
        "budget_total_tokens",
        "learn_rate_limits",
        "first_wave",
    }
)
