"""An MCP server's input schemas: checked once when listed, then used to check arguments in
bounded time.

A server's schema is peer data, and the checks run on the shared runtime loop, so nothing in them
may take unbounded time. `pattern` and `patternProperties` regexes run on RE2 (no backtracking:
linear in the argument, so `^(a+)+$` costs what `^a+$` does) instead of Python's `re`, each
compiled once when the schema is (capped: `treadle.mcp.regex`), and a check over
`patternProperties` looks at its deadline before every match; a regex RE2
cannot express (lookaround, backreferences) is left to the server to check. When the server lists
a tool, its schema is compiled (on a worker thread) and refused with an error naming tool and
server when it is not a valid JSON Schema, points a `$ref` outside itself or nowhere, or has a
`$ref` chain that loops back without descending into the arguments (`RecursionError` on every
call otherwise), or whose `$ref`s fan out without a loop so that one value would be checked
against more than `MAX_EXPANSION` subschemas (N levels of `anyOf` with two refs to the next
level cost 2**N). `$ref`s resolve against the `$id` of the schema resource they sit in, as
jsonschema resolves them, so a loop hidden behind an embedded `$id` is refused too. `uniqueItems`
is checked by hashing each item's canonical form (linear), not pairwise. A check runs under a time
budget (`Compiled.errors`): every keyword checks the deadline, and one past it raises
`BudgetExceeded`. One RE2 call cannot be stopped and costs up to the pattern's size per
character, so a string matched against a `pattern` may have at most `MAX_PATTERN_CHARACTERS`
(longer is a validation error naming the limit). A schema with a pattern or a large `enum` /
`const` is `heavy`: its checks run off the loop whatever the value (`run_check`: on threads of
their server's own, `treadle.mcp.checks`, so runaway checks starve nothing else; the caller
stops waiting at the budget). This module must never run Python's `re` on a server's pattern.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any
from urllib.parse import unquote, urldefrag, urljoin

from jsonschema import exceptions, validators  # type: ignore[import-untyped]

from treadle.mcp.checks import CHECK_THREADS, BudgetExceeded, run_check
from treadle.mcp.regex import (
    MAX_LISTED_PATTERN_CHARACTERS,
    MAX_PATTERN_CHARACTERS,
    MAX_SCHEMA_PATTERN,
    Patterns,
    SchemaRefused,
)

__all__ = [
    "CHECK_THREADS",
    "MAX_EXPANSION",
    "MAX_LISTED_PATTERN_CHARACTERS",
    "MAX_PATTERN_CHARACTERS",
    "MAX_SCHEMA_PATTERN",
    "BudgetExceeded",
    "Compiled",
    "Patterns",
    "SchemaRefused",
    "compile_schema",
    "run_check",
]

# An `enum` longer than this, or a `const` that is an object or array, makes a schema heavy.
_HEAVY_ENUM = 32

#: The most subschemas (counted with multiplicity, following `$ref`s) one value may be checked
#: against; a schema over it is refused when listed, since checking it costs that much per value.
MAX_EXPANSION = 1000

# Keywords whose subschemas apply to the same value as their parent (a `$ref` cycle through only
# these never reaches a smaller value, so it never ends).
_SAME_VALUE_LISTS = ("allOf", "anyOf", "oneOf")
_SAME_VALUE_ONE = ("not", "if", "then", "else")
_SUPPORTED_DIALECTS = ("draft4", "draft6", "draft7", "draft2019", "draft2020")
# Schema keywords whose value is data, not a schema: a "pattern" key inside is no pattern.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
_NAMED_SCHEMAS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
)


# The deadline of the check running on this thread (checks run on the loop or on workers).
_deadline = threading.local()


def _timed(keyword: Callable[..., Any]) -> Callable[..., Any]:
    """`keyword` checking the running check's deadline first: every subschema applied to every
    value passes through a keyword, so no check runs far past its budget."""

    def check(validator: Any, value: Any, instance: Any, schema: Any) -> Any:
        deadline = getattr(_deadline, "at", None)
        if deadline is not None and time.monotonic() > deadline:
            raise BudgetExceeded
        return keyword(validator, value, instance, schema)

    return check


class Compiled:
    """A compiled schema: its validator, and `cost`, the most subschemas one value is checked
    against (at most `MAX_EXPANSION`), to judge whether a check is cheap."""

    __slots__ = ("cost", "heavy", "validator")

    def __init__(self, validator: Any, cost: int, heavy: bool = False) -> None:
        self.validator = validator
        self.cost = cost
        self.heavy = heavy
        """Whether a check may be long whatever the value's size (a pattern, a large enum)."""

    def iter_errors(self, instance: Any) -> Iterator[Any]:
        """The validation errors of `instance`, without a budget."""
        return self.validator.iter_errors(instance)  # type: ignore[no-any-return]

    def best_error(self, instance: Any, budget: float) -> Any:
        """The most relevant validation error of `instance` (None when it is valid), as
        `errors` finds them: `BudgetExceeded` past `budget` seconds."""
        _deadline.at = time.monotonic() + budget
        try:
            return exceptions.best_match(self.validator.iter_errors(instance))
        finally:
            _deadline.at = None

    def errors(self, instance: Any, budget: float) -> list[Any]:
        """All validation errors of `instance`; `BudgetExceeded` once the check has taken more
        than `budget` seconds (`RecursionError` for too deep a value)."""
        _deadline.at = time.monotonic() + budget
        try:
            return list(self.validator.iter_errors(instance))
        finally:
            _deadline.at = None


def _pattern_keyword(patterns: Patterns) -> Callable[..., Any]:
    def _pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Iterator[Any]:
        if not validator.is_type(instance, "string"):
            return
        if len(instance) > MAX_PATTERN_CHARACTERS:
            yield exceptions.ValidationError(
                f"a string of {len(instance):,} characters is over the "
                f"{MAX_PATTERN_CHARACTERS:,}-character limit for matching a pattern"
            )
        elif patterns.matches(pattern, instance) is False:
            yield exceptions.ValidationError(f"{instance!r} does not match {pattern!r}")

    return _pattern


def _in_time() -> None:
    """`BudgetExceeded` once the running check is past its deadline (inside the loops over
    patterns and keys, which are as long as a peer makes them)."""
    deadline = getattr(_deadline, "at", None)
    if deadline is not None and time.monotonic() > deadline:
        raise BudgetExceeded


def _pattern_properties_keyword(patterns: Patterns) -> Callable[..., Any]:
    def _pattern_properties(
        validator: Any, by_pattern: Mapping[str, Any], instance: Any, schema: Any
    ) -> Iterator[Any]:
        if not validator.is_type(instance, "object"):
            return
        for pattern, subschema in by_pattern.items():
            for key, value in instance.items():
                _in_time()
                if patterns.matches(pattern, key):
                    yield from validator.descend(value, subschema, path=key, schema_path=pattern)

    return _pattern_properties


def _additional_properties_keyword(patterns: Patterns) -> Callable[..., Any]:
    def _additional_properties(
        validator: Any, extra: Any, instance: Any, schema: Any
    ) -> Iterator[Any]:
        if not validator.is_type(instance, "object"):
            return
        known = schema.get("properties", {})
        listed = list(schema.get("patternProperties", {}))

        def extra_key(key: Any) -> bool:
            if key in known:
                return False
            for pattern in listed:
                _in_time()
                # A pattern RE2 cannot express counts as matching: the server decides those.
                if patterns.matches(pattern, key) is not False:
                    return False
            return True

        extras = sorted((k for k in instance if extra_key(k)), key=str)
        if validator.is_type(extra, "object"):
            for key in extras:
                yield from validator.descend(instance[key], extra, path=key)
        elif not extra and extras:
            names = ", ".join(repr(k) for k in extras)
            verb = "was" if len(extras) == 1 else "were"
            yield exceptions.ValidationError(
                f"Additional properties are not allowed ({names} {verb} unexpected)"
            )

    return _additional_properties


def _canonical(value: Any) -> Any:
    """A hashable form of a JSON value, equal exactly when JSON Schema calls the values equal
    (1 == 1.0, key order ignored, true != 1)."""
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, dict):
        # sorted pairs, not a frozenset: frozenset hashes of near-alike objects collide badly
        pairs = sorted(value.items(), key=lambda pair: pair[0])
        return ("object", tuple((k, _canonical(v)) for k, v in pairs))
    if isinstance(value, list | tuple):
        return ("array", tuple(_canonical(v) for v in value))
    return value


def _unique_items(validator: Any, unique: Any, instance: Any, schema: Any) -> Iterator[Any]:
    if not unique or not validator.is_type(instance, "array"):
        return
    seen: set[Any] = set()
    for item in instance:
        key = _canonical(item)
        if key in seen:
            yield exceptions.ValidationError(f"{instance!r} has non-unique elements")
            return
        seen.add(key)


def _left_to_the_server(validator: Any, value: Any, instance: Any, schema: Any) -> Iterator[Any]:
    return iter(())


def compile_schema(schema: Mapping[str, Any], patterns: Patterns | None = None) -> Compiled:
    """A validator for `schema` whose regexes run on RE2, each compiled now (into `patterns`,
    those of the whole listing); `SchemaRefused` saying what is wrong.

    Pure Python and proportional to the schema's size: call it off the event loop for a schema
    from a server.
    """
    patterns = patterns if patterns is not None else Patterns()
    for pattern in _schema_patterns(schema):  # before jsonschema runs Python's `re` on them
        patterns.add(pattern)
    try:
        base = validators.validator_for(schema, default=validators.Draft202012Validator)
        dialect = next((d for d in _SUPPORTED_DIALECTS if d in base.__name__.lower()), None)
        if dialect is None:
            raise SchemaRefused(f"its dialect ({schema.get('$schema')}) is not supported")
        base.check_schema(schema)
        cost = _check_refs(schema)
    except exceptions.SchemaError as error:
        raise SchemaRefused(f"it is not a valid JSON Schema ({error.message})") from None
    except RecursionError:
        raise SchemaRefused("it is nested too deeply to check") from None
    overrides: dict[str, Any] = {
        "pattern": _pattern_keyword(patterns),
        "patternProperties": _pattern_properties_keyword(patterns),
        "additionalProperties": _additional_properties_keyword(patterns),
        "uniqueItems": _unique_items,
    }
    if "unevaluatedProperties" in base.VALIDATORS and _has_key(schema, "patternProperties"):
        # jsonschema would match those patterns with `re`; without them the server checks.
        overrides["unevaluatedProperties"] = _left_to_the_server
    keywords = {k: _timed(overrides.get(k, v)) for k, v in base.VALIDATORS.items()}
    return Compiled(validators.extend(base, keywords)(schema), cost, _heavy(schema))


def _schema_patterns(schema: Any) -> Iterator[str]:
    """Every `pattern` and `patternProperties` key of the schema (not those inside data such as
    a `const`, which are no patterns)."""
    for pointer, node in _nodes(schema):
        parts = pointer.split("/")
        if any(
            part in _DATA_KEYWORDS and parts[i - 1] not in _NAMED_SCHEMAS
            for i, part in enumerate(parts)
            if i
        ):
            continue
        if isinstance(node.get("pattern"), str):
            yield node["pattern"]
        if isinstance(node.get("patternProperties"), dict):
            yield from (k for k in node["patternProperties"] if isinstance(k, str))


def _heavy(schema: Any) -> bool:
    for _, node in _nodes(schema):
        enum, const = node.get("enum"), node.get("const")
        if "pattern" in node or "patternProperties" in node:
            return True
        if (isinstance(enum, list) and len(enum) > _HEAVY_ENUM) or isinstance(const, dict | list):
            return True
    return False


def _nodes(schema: Any) -> Iterator[tuple[str, Any]]:
    """Every dict in the schema with its JSON pointer, iteratively (no recursion limit)."""
    stack: list[tuple[str, Any]] = [("", schema)]
    while stack:
        pointer, node = stack.pop()
        if isinstance(node, dict):
            yield pointer, node
            items: Any = node.items()
        elif isinstance(node, list):
            items = enumerate(node)
        else:
            continue
        for key, value in items:
            if isinstance(value, dict | list):
                escaped = str(key).replace("~", "~0").replace("/", "~1")
                stack.append((f"{pointer}/{escaped}", value))


def _has_key(schema: Any, key: str) -> bool:
    return any(key in node for _, node in _nodes(schema))


class _Resources:
    """Where each schema resource (the root and every embedded `$id`) sits, each node's base URI,
    and the anchors of each resource, so a `$ref` resolves as jsonschema resolves it."""

    def __init__(self, schema: Mapping[str, Any]) -> None:
        self.base: dict[str, str] = {}  # node pointer -> its base URI
        self.home: dict[str, str] = {}  # node pointer -> pointer of its resource
        self.ids: dict[str, str] = {}  # resource URI -> its pointer
        self.anchors: dict[tuple[str, str], str] = {}  # (resource pointer, name) -> pointer
        stack: list[tuple[str, Any, str, str]] = [("", schema, "", "")]
        while stack:
            pointer, node, base, home = stack.pop()
            if isinstance(node, dict):
                ident = node.get("$id")
                if isinstance(ident, str) and ident.startswith("#"):  # draft 6/7 anchor form
                    self.anchors[(home, ident[1:])] = pointer
                elif isinstance(ident, str):
                    base, home = urldefrag(urljoin(base, ident))[0], pointer
                    self.ids.setdefault(base, pointer)
                if pointer == "":
                    self.ids.setdefault(base, "")
                    self.ids.setdefault("", "")
                anchor = node.get("$anchor")
                if isinstance(anchor, str):
                    self.anchors[(home, anchor)] = pointer
                self.base[pointer], self.home[pointer] = base, home
                items: Any = node.items()
            elif isinstance(node, list):
                items = enumerate(node)
            else:
                continue
            for key, value in items:
                if isinstance(value, dict | list):
                    escaped = str(key).replace("~", "~0").replace("/", "~1")
                    stack.append((f"{pointer}/{escaped}", value, base, home))

    def target(self, ref: str, at: str, by_pointer: Mapping[str, Any]) -> str:
        """The pointer the `$ref` of node `at` names; `SchemaRefused` when it leaves the schema
        or names nothing."""
        uri, fragment = urldefrag(urljoin(self.base.get(at, ""), ref))
        home = self.ids.get(uri)
        if home is None:
            raise SchemaRefused(f"its $ref {ref!r} points outside the schema")
        fragment = unquote(fragment)
        if fragment.startswith("/") or not fragment:
            pointer: str | None = home + fragment
        else:
            pointer = self.anchors.get((home, fragment))
        if pointer is None or pointer not in by_pointer:
            raise SchemaRefused(f"its $ref {ref!r} points nowhere")
        return pointer


def _check_refs(schema: Mapping[str, Any]) -> int:
    """Refuse `$ref`s that leave the schema or point nowhere, and `$ref` loops that apply to the
    same value forever; the schema's cost (see `Compiled.cost`)."""
    by_pointer = dict(_nodes(schema))
    resources = _Resources(schema)
    edges: dict[str, list[str]] = {}
    for pointer, node in by_pointer.items():
        for keyword in ("$dynamicRef", "$recursiveRef"):
            if keyword in node:
                raise SchemaRefused(f"it uses {keyword}, which Treadle does not check")
        out: list[str] = []
        ref = node.get("$ref")
        if isinstance(ref, str):
            out.append(resources.target(ref, pointer, by_pointer))
        for keyword in _SAME_VALUE_LISTS:
            if isinstance(node.get(keyword), list):
                out.extend(f"{pointer}/{keyword}/{i}" for i in range(len(node[keyword])))
        for keyword in _SAME_VALUE_ONE:
            if isinstance(node.get(keyword), dict):
                out.append(f"{pointer}/{keyword}")
        if isinstance(node.get("dependentSchemas"), dict):
            out.extend(f"{pointer}/dependentSchemas/{k}" for k in node["dependentSchemas"])
        edges[pointer] = [p for p in out if p in by_pointer]
    _refuse_cycles(edges)
    return _refuse_blowup(edges)


def _refuse_blowup(edges: Mapping[str, list[str]]) -> int:
    """`SchemaRefused` when one value would be checked against more than `MAX_EXPANSION`
    subschemas: each node counts itself and, with multiplicity, what its same-value edges reach
    (the graph has no cycle by now; counted iteratively, each node once)."""
    size: dict[str, int] = {}
    for root in edges:
        if root in size:
            continue
        stack = [root]
        while stack:
            node = stack[-1]
            pending = [n for n in edges.get(node, ()) if n not in size]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            if node not in size:
                size[node] = min(1 + sum(size[n] for n in edges.get(node, ())), MAX_EXPANSION + 1)
                if size[node] > MAX_EXPANSION:
                    raise SchemaRefused(
                        f"its $refs fan out so that one value is checked against over "
                        f"{MAX_EXPANSION:,} subschemas (at #{node}); share less, or nest less"
                    )
    return max(size.values(), default=1)


def _refuse_cycles(edges: Mapping[str, list[str]]) -> None:
    """Depth-first search, iteratively; `SchemaRefused` naming the loop when there is one."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in edges:
        if state.get(root):
            continue
        path: list[str] = [root]
        stack: list[Iterator[str]] = [iter(edges[root])]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                stack.pop()
                state[path.pop()] = 2
            elif state.get(nxt) == 1:
                loop = [*path[path.index(nxt) :], nxt]
                shown = " -> ".join(f"#{p}" for p in loop)
                raise SchemaRefused(f"its $ref chain loops without descending ({shown})")
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(edges.get(nxt, ())))
