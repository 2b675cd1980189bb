"""A function tool's argument model and JSON schema, from its signature, hints and docstring.

The schema comes from a pydantic model built once per tool. A parameter's description comes, in
order of precedence, from a pydantic `Field(description=...)` (as the default or inside
`Annotated[T, Field(...)]`), an `Annotated[T, "text"]` string, then the docstring; constraints
and required-ness come from the `Field` (a `Field(...)` default without a default value leaves the
parameter required). A callable object or a bound method is read through its `__call__` /
function: that signature, those annotations (string ones resolved in the defining module and
class) and that docstring. `strict_schema` makes a schema fit OpenAI's strict mode, or says why it
cannot.

This module builds values only; it never calls a tool.
"""

from __future__ import annotations

import copy
import functools
import inspect
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import pydantic
from pydantic.fields import FieldInfo
from pydantic.json_schema import GenerateJsonSchema

from treadle.errors import ConfigurationError
from treadle.tools.context import injection_of

__all__ = [
    "ArgumentModel",
    "NotStrict",
    "build_arguments",
    "described_source",
    "docstring_of",
    "resolve_strict",
    "strict_schema",
    "type_hints",
]

Injected = Literal["session", "sandbox", "context"]


class _ToolJsonSchema(GenerateJsonSchema):
    """Pydantic's schema generator without per-field titles (they cost tokens and add nothing)."""

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False


@dataclass(frozen=True, slots=True)
class ArgumentModel:
    """What `build_arguments` found: the validation model and the schema the model sees."""

    model: type[pydantic.BaseModel]
    field_names: Mapping[str, str]
    """Internal model field -> parameter name."""
    injected: Mapping[str, Injected]
    """Parameters the dispatcher fills in, not in the schema."""
    parameters: dict[str, Any]
    """The JSON schema of the arguments object."""


def described_source(fn: Callable[..., Any]) -> tuple[Callable[..., Any], dict[str, Any] | None]:
    """The function whose annotations and docstring describe `fn`, and the class namespace its
    string annotations may name: `__call__` of a callable object, the function of a bound
    method or of a `functools.partial`, else `fn` itself."""
    if isinstance(fn, functools.partial):
        return described_source(fn.func)
    if inspect.ismethod(fn):
        owner = fn.__self__ if isinstance(fn.__self__, type) else type(fn.__self__)
        return fn.__func__, dict(vars(owner))
    if inspect.isroutine(fn) or isinstance(fn, type):
        return fn, None
    call = type(fn).__call__
    return call, dict(vars(type(fn)))


def docstring_of(fn: Callable[..., Any]) -> str | None:
    """`fn`'s docstring; for a callable object, its `__call__`'s (else the class's)."""
    source, _ = described_source(fn)
    return inspect.getdoc(source) or inspect.getdoc(fn)


def type_hints(fn: Callable[..., Any], sig: inspect.Signature) -> dict[str, Any]:
    """Resolved annotations; a name that cannot be resolved is a clear configuration error."""
    source, class_namespace = described_source(fn)
    try:
        return typing.get_type_hints(source, localns=class_namespace, include_extras=True)
    except Exception:
        pass
    namespace = dict(getattr(source, "__globals__", {}))
    namespace.update(class_namespace or {})
    hints: dict[str, Any] = {}
    for param in sig.parameters.values():
        annotation = param.annotation
        if isinstance(annotation, str):
            try:
                annotation = eval(annotation, namespace)  # resolving a forward reference
            except Exception:
                raise ConfigurationError(
                    f"cannot resolve the type hint {annotation!r} of parameter "
                    f"{param.name!r}; import that type at module level (not only under "
                    "TYPE_CHECKING)."
                ) from None
        if annotation is not inspect.Parameter.empty:
            hints[param.name] = annotation
    return hints


def _annotated_docs(annotation: Any) -> tuple[bool, str | None]:
    """(an `Annotated` `Field` already describes it, an `Annotated` string description)."""
    if typing.get_origin(annotation) is not typing.Annotated:
        return False, None
    described = False
    text = None
    for item in typing.get_args(annotation)[1:]:
        if isinstance(item, FieldInfo) and item.description:
            described = True
        elif isinstance(item, str) and text is None:
            text = item
    return described, text


def _field(tool_name: str, param: inspect.Parameter, annotation: Any, doc: str | None) -> FieldInfo:
    """The parameter's field: docstring < `Annotated` string < the user's `Field`; always the
    parameter's name as the alias the model uses."""
    field_described, annotated_text = _annotated_docs(annotation)
    default = param.default
    infos: list[FieldInfo] = []
    description = annotated_text or doc
    if description and not field_described:
        infos.append(pydantic.Field(description=description))
    for given in (default, *getattr(annotation, "__metadata__", ())):
        if isinstance(given, FieldInfo) and (given.alias or given.validation_alias):
            # The model calls a tool by its parameters' names; an alias would be silently lost.
            raise ConfigurationError(
                f"tool {tool_name!r}: parameter {param.name!r} sets Field(alias=...); tools are "
                "called by parameter name, so rename the parameter to the name the model uses."
            )
    if isinstance(default, FieldInfo):
        infos.append(default)
    elif default is not inspect.Parameter.empty:
        infos.append(pydantic.Field(default))
    infos.append(pydantic.Field(alias=param.name))
    return FieldInfo.merge_field_infos(*infos)


def build_arguments(
    fn: Callable[..., Any], tool_name: str, param_docs: Mapping[str, str]
) -> ArgumentModel:
    """The argument model of `fn` as tool `tool_name` (ConfigurationError when it has none)."""
    sig = inspect.signature(fn)
    hints = type_hints(fn, sig)
    fields: dict[str, Any] = {}
    names: dict[str, str] = {}
    injected: dict[str, Injected] = {}
    extra: Literal["allow", "forbid"] = "forbid"
    extra_type: Any = Any
    for i, param in enumerate(sig.parameters.values()):
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            extra = "allow"
            extra_type = hints.get(param.name, Any)  # `**kwargs: int`: each value is an int
            continue
        if param.kind is inspect.Parameter.VAR_POSITIONAL:
            raise ConfigurationError(
                f"tool {tool_name!r}: *{param.name} is not supported, since the model calls "
                "tools with named arguments; declare each argument as its own parameter."
            )
        if param.kind is inspect.Parameter.POSITIONAL_ONLY:
            raise ConfigurationError(
                f"tool {tool_name!r}: parameter {param.name!r} is positional-only; tools are "
                "called with keyword arguments, so drop the `/`."
            )
        annotation = hints.get(param.name, Any)
        what = injection_of(annotation)
        if what is not None:
            injected[param.name] = typing.cast(Injected, what)
            continue
        # Internal names avoid clashes with BaseModel attributes (`json`, `copy`, `_x`).
        internal = f"p{i}"
        names[internal] = param.name
        fields[internal] = (
            annotation,
            _field(tool_name, param, annotation, param_docs.get(param.name)),
        )
    try:
        model: type[pydantic.BaseModel] = pydantic.create_model(
            f"{tool_name}_arguments", __base__=_base(tool_name, extra, extra_type), **fields
        )
        schema = model.model_json_schema(schema_generator=_ToolJsonSchema)
    except (pydantic.PydanticSchemaGenerationError, pydantic.PydanticUserError, TypeError) as e:
        raise ConfigurationError(
            f"tool {tool_name!r}: a parameter type has no JSON schema ({e}); use JSON-friendly "
            "types (str, int, float, bool, list, dict, Literal, Enum, pydantic models)."
        ) from None
    schema.pop("title", None)
    if extra == "forbid":
        schema["additionalProperties"] = False
    schema.setdefault("properties", {})
    return ArgumentModel(model, names, injected, schema)


def _base(
    tool_name: str, extra: Literal["allow", "forbid"], extra_type: Any
) -> type[pydantic.BaseModel]:
    """The argument model's base: its config, and the type of `**kwargs` values when annotated
    (pydantic validates extras against `__pydantic_extra__` and puts it in the schema)."""
    config = pydantic.ConfigDict(extra=extra, arbitrary_types_allowed=False)
    namespace: dict[str, Any] = {"model_config": config}
    if extra == "allow" and extra_type is not Any:
        values: Any = dict[str, extra_type]
        namespace["__annotations__"] = {"__pydantic_extra__": values}
    return type(f"{tool_name}_base", (pydantic.BaseModel,), namespace)


# The JSON-schema keywords OpenAI's strict mode accepts (its structured-outputs subset); a schema
# using any other (minLength, oneOf, allOf, uniqueItems, ...) is refused by the API when strict.
_STRICT_KEYWORDS = frozenset(
    (
        "type", "properties", "required", "additionalProperties", "items", "anyOf", "enum",
        "const", "description", "title", "$ref", "$defs", "pattern", "format", "multipleOf",
        "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minItems", "maxItems",
    )
)  # fmt: skip

# The `format` values strict mode supports (OpenAI's structured-outputs documentation); any other
# (`binary` from `bytes`, `uri`, `path`, ...) is refused by the API when strict.
STRICT_FORMATS = frozenset(
    ("date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid")
)

# A node must say what it holds: strict mode refuses a typeless node (`{}` from `Any`, `object`,
# a bare `list`'s items) with "schema must have a 'type' key".
_TYPED_BY = ("type", "anyOf", "$ref")


class NotStrict(Exception):
    """A schema that OpenAI's strict mode cannot express; the message says where and why."""


def strict_schema(schema: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
    """`schema` in the form strict mode accepts (every object closed, every property required,
    no `default`), and whether that changed its meaning (some property was optional).

    Raises `NotStrict` for an object whose keys are open (a `dict[str, X]`, `**kwargs`, `Any`),
    a node without a type (`Any`, `object`, a bare `list`'s items), a `format` outside
    `STRICT_FORMATS`, or a keyword strict mode does not support (`minLength`, `oneOf`, ...).
    """
    out = copy.deepcopy(dict(schema))
    changed = False

    def visit(node: Any, path: str) -> None:
        nonlocal changed
        if isinstance(node, list):
            for i, value in enumerate(node):
                visit(value, f"{path}[{i}]")
            return
        if not isinstance(node, dict):
            return
        node.pop("default", None)
        unsupported = sorted(set(node) - _STRICT_KEYWORDS)
        if unsupported:
            raise NotStrict(
                f"{path or 'the arguments'} uses {', '.join(unsupported)}, which strict mode "
                "does not support"
            )
        if not any(key in node for key in _TYPED_BY):
            raise NotStrict(
                f"{path or 'the arguments'} has no type (Any, object or a bare list/dict); "
                "strict mode needs every value typed"
            )
        fmt = node.get("format")
        if fmt is not None and fmt not in STRICT_FORMATS:
            raise NotStrict(
                f"{path or 'the arguments'} uses format {fmt!r}, which strict mode does not "
                f"support (only {', '.join(sorted(STRICT_FORMATS))})"
            )
        if node.get("type") == "object":
            extra = node.get("additionalProperties")
            if extra not in (None, False) or "properties" not in node:
                raise NotStrict(
                    f"{path or 'the arguments'} is an object with open keys (a dict, **kwargs "
                    "or Any); strict mode needs every key declared (use a pydantic model)"
                )
            node["additionalProperties"] = False
            properties = node["properties"]
            if set(node.get("required", ())) != set(properties):
                changed = True
            node["required"] = list(properties)
            for name, value in properties.items():
                visit(value, f"{path}.{name}" if path else name)
        for key in ("items", "anyOf"):
            if key in node:
                visit(node[key], path)
        for name, value in (node.get("$defs") or {}).items():
            visit(value, name)

    visit(out, "")
    return out, changed


def resolve_strict(
    what: str, parameters: dict[str, Any], strict: bool | None, *, required_ok: bool = False
) -> tuple[dict[str, Any], bool]:
    """The schema to send for `what` and whether to send it strict.

    `strict=None` is strict when the schema allows it and, unless `required_ok`, when no
    optional property would become required; `strict=True` raises `ConfigurationError` naming
    what cannot be strict.
    """
    if strict is False:
        return parameters, False
    try:
        converted, changed = strict_schema(parameters)
    except NotStrict as why:
        if strict is None:
            return parameters, False
        raise ConfigurationError(f"{what} cannot be strict: {why}; pass strict=False.") from None
    if changed and strict is None and not required_ok:
        return parameters, False  # optional parameters would become required: keep as is
    return converted, True
