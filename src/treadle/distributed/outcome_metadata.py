"""An output session's metadata as it crosses a map's pipe: `portable_metadata` makes it JSON
data in a worker (a process worker's request usage compact, as tuples), `local_metadata` makes
the driver's values of it again (`Tripwire`, `GuardrailResult`, `RequestUsage`). Split from
`treadle.distributed.outcome`, which uses both. This module must never turn a value it does not
know into something else: what does not fit stays data.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from collections.abc import Mapping
from typing import Any

import pydantic

from treadle.distributed.frozen import positional
from treadle.loop.control import GuardrailResult, Tripwire
from treadle.loop.request_usage import RequestUsage

__all__ = ["expanded_usage", "json_data", "local_metadata", "portable_metadata"]

_PORTABLE = (
    "agent", "handoffs", "handled_error", "cancel_mode", "interrupt_reason", "stopped_at_tool",
)  # fmt: skip


def portable_metadata(metadata: Mapping[str, Any], *, compact: bool = False) -> dict[str, Any]:
    """An output session's metadata as JSON data for an outcome (objects become dicts): what
    `PassOutcome.to_json` would make of it, so a worker's outcome needs no second walk.

    `compact` (a process worker's wire form): each `RequestUsage` entry as the tuple of its
    fields, not a dict (`_public`, `received_session` take it back): fewer objects to pickle
    and unpickle (docs/performance.md, process workers, ninth round)."""
    # The keys it knows, in one pass over the few the metadata has (a membership test per
    # known key, and a `get` per object key, was a third of this function).
    out: dict[str, Any] = {}
    present = metadata.keys() & _KNOWN if type(metadata) is dict else _KNOWN
    for k in _PORTABLE:
        if k in present and k in metadata:
            value = metadata[k]
            out[k] = value if value is None or type(value) in _SCALARS else json_data(value)
    if "output" in present:
        value = metadata.get("output")
        if isinstance(value, pydantic.BaseModel):
            out["output"] = value.model_dump(mode="json")
        elif value is not None:
            out["output"] = json_data(value)
    if "tripwire" in present:
        trip = metadata.get("tripwire")
        if trip is not None and dataclasses.is_dataclass(trip) and not isinstance(trip, type):
            out["tripwire"] = json_data(_plain(trip))
    if "guardrail_results" in present and metadata.get("guardrail_results"):
        results = metadata["guardrail_results"]
        out["guardrail_results"] = [
            json_data({**_plain(r), "tripped": bool(r.tripped)}) for r in results
        ]
    if "request_usage" in present and metadata.get("request_usage"):
        # A `RequestUsage`'s fields are scalars: its plain dict is JSON data as it is, made in
        # C (`attrgetter`, `zip`, `map`): `_plain`'s loop per field was a third of this
        # function, and a comprehension per entry most of the rest.
        names, values, entries = _USAGE_NAMES, _usage_values, metadata["request_usage"]
        if set(map(type, entries)) == _ONLY_REQUEST_USAGE:  # every entry (not a subclass)
            if compact:
                out["request_usage"] = list(map(values, entries))
            else:
                out["request_usage"] = [dict(zip(names, values(v), strict=True)) for v in entries]
        else:  # a mix: every entry as a dict
            out["request_usage"] = [
                dict(zip(names, values(v), strict=True))
                if type(v) is RequestUsage
                else json_data(_plain(v))
                for v in entries
            ]
    return out


_KNOWN = frozenset({*_PORTABLE, "output", "tripwire", "guardrail_results", "request_usage"})
_ONLY_REQUEST_USAGE = {RequestUsage}


_USAGE_NAMES = tuple(f.name for f in dataclasses.fields(RequestUsage))
_usage_values = operator.attrgetter(*_USAGE_NAMES)
_usage_items = operator.itemgetter(*_USAGE_NAMES)
_build_request_usage = positional(RequestUsage)


_SCALARS = frozenset({str, int, float, bool})


def json_data(value: Any) -> Any:
    """`value` with every dataclass in it as a dict (what `dataclasses.asdict` does to fields).

    Plain dicts and lists (nearly all of an outcome's metadata) are told by their exact type
    first: `dataclasses.is_dataclass` on every value was a tenth of a process worker's
    bookkeeping per pass."""
    kind = type(value)
    if value is None or kind in _SCALARS:  # most of it: no dataclass check needed
        return value
    if kind is dict:  # scalars inline: a call per value was most of this walk
        return {
            k: v if v is None or type(v) in _SCALARS else json_data(v) for k, v in value.items()
        }
    if kind is list:
        return [json_data(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, dict):
        return {k: json_data(v) for k, v in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple, as asdict does
        return type(value)(*[json_data(v) for v in value])
    if isinstance(value, list | tuple):
        return type(value)(json_data(v) for v in value)
    return value


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _field_names(kind: type) -> tuple[str, ...]:
    names = _FIELD_NAMES.get(kind)
    if names is None:  # a handful of types (tripwires, guardrail results, request usage)
        names = _FIELD_NAMES[kind] = tuple(
            f.name for f in dataclasses.fields(kind) if f.name != "info"
        )
    return names


def _plain(value: Any) -> dict[str, Any]:
    """A dataclass value as a dict (nested dataclasses too), without its `info` field."""
    out: dict[str, Any] = {}
    for name in _field_names(type(value)):
        v = getattr(value, name)
        if v is None or type(v) in _SCALARS:  # nearly all of them (request usage: all)
            out[name] = v
        else:
            out[name] = _plain(v) if hasattr(type(v), "__dataclass_fields__") else v
    return out


def local_metadata(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of `portable_metadata` for the run's records: the tripwire, guardrail
    results and per-request usage as the `Tripwire`, `GuardrailResult` and `RequestUsage`
    values a local pass holds (what does not fit those types, e.g. a record written by another
    version, stays as data)."""
    out = dict(metadata)
    # A key absent is the common case: `isinstance(None, Mapping)` is an ABC check.
    trip = metadata.get("tripwire")
    if trip is not None and isinstance(trip, Mapping):
        out["tripwire"] = _rebuilt(_tripwire, trip)
    results = metadata.get("guardrail_results")
    if isinstance(results, (list, tuple)):
        out["guardrail_results"] = tuple(_rebuilt(_guardrail_result, r) for r in results)
    entries = metadata.get("request_usage")
    if isinstance(entries, (list, tuple)):
        out["request_usage"] = _request_usages(entries)
    return out


def expanded_usage(metadata: dict[str, Any]) -> dict[str, Any]:
    """A worker's wire metadata with its compact request usage as the dicts `to_json` gives."""
    entries = metadata.get("request_usage") if type(metadata) is dict else None
    if type(entries) is not list or not all(type(e) is tuple for e in entries):
        return metadata
    n, names = len(_USAGE_NAMES), _USAGE_NAMES  # a tuple of another length is left as it is
    expanded = [dict(zip(names, e, strict=True)) if len(e) == n else e for e in entries]
    return {**metadata, "request_usage": expanded}


def _request_usages(entries: list[Any] | tuple[Any, ...]) -> tuple[Any, ...]:
    """`request_usage` entries as `RequestUsage` values: one per completion, so the common case
    (every entry a dict of its fields) is one loop with no call per entry beyond the build."""
    try:
        # Positional, by the field names' order: the entries' keys were unpickled, so they are
        # equal to the parameter names but not the same strings, and `RequestUsage(**e)` then
        # compared each keyword with the names before it (a fifth of the driver's rebuild, in
        # instructions; docs/performance.md). An entry with other keys takes the keyword path.
        n, values = len(_USAGE_NAMES), _usage_items
        build = _build_request_usage  # one per completion: no `__init__` (`frozen.positional`)
        if all(type(e) is tuple and len(e) == n for e in entries):  # a worker's compact form
            return tuple(itertools.starmap(build, entries))  # each built in C's loop
        if all(type(e) is dict and len(e) == n for e in entries):
            return tuple([build(*values(e)) for e in entries])
        if all(type(e) is dict for e in entries):
            return tuple([RequestUsage(**e) for e in entries])
    except (KeyError, TypeError, ValueError):
        pass  # one entry does not fit: each is rebuilt on its own, the misfits stay data
    return tuple(_rebuilt(_request_usage, e) for e in entries)


def _rebuilt(build: Any, data: Any) -> Any:
    if type(data) is not dict and not isinstance(data, Mapping):  # the ABC check is slow
        return data
    try:
        return build(data)
    except (KeyError, TypeError, ValueError):
        return data


def _tripwire(data: Mapping[str, Any]) -> Tripwire:
    return Tripwire(**data)


def _guardrail_result(data: Mapping[str, Any]) -> GuardrailResult:
    trip = data.get("tripwire")
    tripwire = _tripwire(trip) if isinstance(trip, Mapping) else None
    return GuardrailResult(str(data["guardrail"]), str(data["when"]), tripwire)


def _request_usage(data: Mapping[str, Any]) -> RequestUsage:
    return RequestUsage(**data)
