"""Fingerprints of what decides an evaluation's results, and the configuration hash over them.

A log records the hash of (agent, model, dataset, scorer); resuming with a different one is
refused, so one log never mixes results of two configurations. The endpoint URL and API key are
deliberately left out (the same model behind another address is the same configuration), and
so are run options that do not change what a sample means (concurrency, backend, retries).
This module must never call a model or open a file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
from collections.abc import Mapping
from typing import Any

from pydantic_core import to_json

from treadle.persist.producer import OUTPUT_OPTIONS, plain_json

__all__ = ["callable_fingerprint", "config_hash", "fingerprint_agent"]

# Provider fields that change what the model answers (the rest are transport and limits): the
# model and the options a transcript's producer records.
_SAMPLING_FIELDS = ("model", *OUTPUT_OPTIONS)


def callable_fingerprint(fn: Any) -> dict[str, Any]:
    """`module:qualname` of a function plus a hash of its source, when the source is readable."""
    target = getattr(fn, "fn", fn)
    module = getattr(target, "__module__", None) or type(target).__module__
    qualname = getattr(target, "__qualname__", None) or type(target).__qualname__
    try:
        source = inspect.getsource(target)
    except (OSError, TypeError):
        source = ""
    digest = hashlib.sha256(source.encode()).hexdigest()[:16] if source else None
    return {"callable": f"{module}:{qualname}", "source_sha256": digest}


def _tool_name(tool: Any) -> str:
    name = getattr(tool, "name", None)
    if isinstance(name, str):
        return name
    return str(getattr(tool, "__name__", type(tool).__name__))


def _schema(output_type: Any) -> Any:
    method = getattr(output_type, "model_json_schema", None)
    return method() if callable(method) else repr(output_type)


def fingerprint_agent(agent: Any) -> dict[str, Any]:
    """What identifies an `Agent` (name, instructions, model and sampling, tools, limits), or a
    plain callable by its import path and source."""
    provider = getattr(agent, "provider", None)
    if provider is None or not hasattr(agent, "instructions"):
        return callable_fingerprint(agent)
    sampling = {f: plain_json(getattr(provider, f, None)) for f in _SAMPLING_FIELDS}
    limits = getattr(agent, "limits", None)
    output_type = getattr(agent, "output_type", None)
    return {
        "name": agent.name,
        "instructions": agent.instructions,
        "provider": sampling,
        "tools": sorted(_tool_name(t) for t in getattr(agent, "tools", ())),
        "output_type": None if output_type is None else _schema(output_type),
        "max_tool_rounds": getattr(agent, "max_tool_rounds", None),
        "limits": None if limits is None else plain_json(dataclasses.asdict(limits)),
    }


def config_hash(config: Mapping[str, Any]) -> str:
    """sha256 of the configuration's canonical JSON (keys sorted)."""
    return hashlib.sha256(to_json(_sorted(config))).hexdigest()


def _sorted(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _sorted(value[k]) for k in sorted(value)}
    if isinstance(value, list | tuple):
        return [_sorted(v) for v in value]
    return value
