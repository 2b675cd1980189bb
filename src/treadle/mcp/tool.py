"""`MCPTool`: one tool of an MCP server as a Treadle `Tool`, and its results as tool results.

The server's input schema is passed to the model as it is, and the model's arguments are checked
against it (JSON Schema, through the `jsonschema` package the SDK depends on, its regexes on RE2:
see `treadle.mcp.schema`) before the call, so a bad call is answered with the field paths at fault
without a round trip. Small arguments against a cheap schema are checked at once, on the loop;
larger ones, or any against a schema whose `$ref`s fan out or that has a pattern or a large enum,
are checked on a check thread (`treadle.mcp.schema.run_check`) just before the call. Either
way a check has `CHECK_BUDGET_SECONDS`; one that runs past it fails that call (a tool error
naming tool and server), never the pass. Results become the JSON body the model reads:
structured content under `structured` when the server sent any (its text twin is then left
out, as the MCP spec makes that text a copy), otherwise the text blocks under `content`;
images, audio and binary resources become a marker naming their type and size, never their
bytes. A result flagged `isError` is reported to the model as a tool error.

This module must never block the event loop and never talk to the server except through the
`Link` of the server the tool came from.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping
from typing import Any, Protocol

import mcp_types as types

from treadle.errors import MCPSchemaError, ToolArgumentsError, ToolError
from treadle.mcp.schema import (
    BudgetExceeded,
    Compiled,
    Patterns,
    SchemaRefused,
    compile_schema,
    run_check,
)
from treadle.runtime.threads import run_internal_io
from treadle.tools import Tool, ToolContext
from treadle.tools.results import EncodedResult

__all__ = [
    "CHECK_BUDGET_SECONDS",
    "MAX_REPORTED_ERRORS",
    "MCPTool",
    "checked_validator",
    "object_schema",
    "result_body",
    "small_value",
    "tool_name",
]

#: Schema violations listed in one `invalid_tool_arguments` message (the rest are counted).
MAX_REPORTED_ERRORS = 5

#: Seconds one check of a call's arguments may take before that call fails as a tool error.
CHECK_BUDGET_SECONDS = 2.0
#: Arguments checked on the loop have at most this many JSON values and string characters, and
#: their schema checks a value against at most `CHEAP_SCHEMA_COST` subschemas; all others are
#: checked on a worker thread (a check costs about values x subschemas keyword steps).
ON_LOOP_VALUES = 1000
ON_LOOP_CHARACTERS = 64 * 1024
CHEAP_SCHEMA_COST = 50

_INVALID = re.compile(r"[^A-Za-z0-9_-]")


def small_value(value: Any) -> bool:
    """Whether `value` has at most `ON_LOOP_VALUES` JSON values and `ON_LOOP_CHARACTERS`
    characters of strings and keys (the walk stops as soon as it knows: bounded on the loop)."""
    stack = [value]
    values = characters = 0
    while stack:
        item = stack.pop()
        values += 1
        if values > ON_LOOP_VALUES or characters > ON_LOOP_CHARACTERS:
            return False
        if isinstance(item, dict | list | tuple) and len(item) > ON_LOOP_VALUES:
            return False
        if isinstance(item, str):
            characters += len(item)
        elif isinstance(item, dict):
            characters += sum(len(k) for k in item if isinstance(k, str))
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return characters <= ON_LOOP_CHARACTERS


def _small_result(result: types.CallToolResult) -> bool:
    """Whether `result` is cheap to turn into the model's text on the loop: a few content
    blocks of short text, and structured content `small_value` says is small (bounded checks)."""
    content = result.content
    if len(content) > ON_LOOP_VALUES // 10:
        return False
    characters = sum(len(getattr(block, "text", "") or "") for block in content)
    if characters > ON_LOOP_CHARACTERS:
        return False
    structured = result.structured_content
    return structured is None or small_value(structured)


class _Caller(Protocol):
    label: str

    async def call(self, name: str, arguments: dict[str, Any]) -> types.CallToolResult: ...


def tool_name(remote: str, prefix: str | None) -> str:
    """The name the model sees: `prefix_remote`, other characters than letters, digits, `_` and
    `-` replaced by `_`, cut to 64 characters."""
    name = f"{prefix}_{remote}" if prefix else remote
    return (_INVALID.sub("_", name) or "_")[:64]


def object_schema(schema: Mapping[str, Any] | None) -> dict[str, Any]:
    """The input schema as sent, made an object schema when a server leaves that implicit."""
    result = dict(schema or {})
    result.setdefault("type", "object")
    if result["type"] == "object":
        result.setdefault("properties", {})
    return result


class MCPTool(Tool):
    """A tool listed by an MCP server; calling it calls the server (see `treadle.mcp.MCPServer`).

    Its `parameters` are the server's input schema; `remote_name` is the name on the server (the
    model sees `name`, which carries the server's prefix). `timeout` is None here because the
    server connection enforces its own call timeout (and health check) inside the call.
    """

    def __init__(
        self,
        server: _Caller,
        remote: types.Tool,
        *,
        prefix: str | None = None,
        validator: Any = None,
    ) -> None:
        """Wrap `remote`; `validator` is its compiled input schema when the listing made it
        (compiled here otherwise; `MCPSchemaError` when the schema is refused)."""
        self.server = server
        """The server connection calls go to."""
        self.remote_name = remote.name
        """The tool's name on the server."""
        self.name = tool_name(remote.name, prefix)
        self.description = (
            remote.description or remote.title or f"{remote.name} (a tool of {server.label})"
        )
        self.parameters = object_schema(remote.input_schema)
        self.output_schema = remote.output_schema
        """The server's output schema (the SDK checks structured results against it)."""
        self._validator = validator or checked_validator(self.parameters, remote.name, server.label)

    def validate(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """Check small `arguments` against a cheap input schema now (the rest are checked by
        `invoke`, off the loop); `ToolArgumentsError` naming the paths at fault."""
        values = dict(arguments)
        if self._on_loop(values):
            self._report(self._errors(values))
        return values

    def _on_loop(self, values: dict[str, Any]) -> bool:
        validator = self._validator
        return validator.cost <= CHEAP_SCHEMA_COST and not validator.heavy and small_value(values)

    def _overrun(self) -> ToolError:
        return ToolError(
            f"checking the arguments for tool {self.name!r} against the schema of MCP server "
            f"{self.server.label} took over {CHECK_BUDGET_SECONDS:g} s and was stopped; the "
            "tool was not called",
            detail="send smaller arguments, or ask the server's owner for a simpler schema",
        )

    def _errors(self, values: dict[str, Any]) -> list[Any]:
        """The schema's complaints about `values`, within the budget (run on any thread)."""
        try:
            return self._validator.errors(values, CHECK_BUDGET_SECONDS)
        except BudgetExceeded:
            raise self._overrun() from None
        except RecursionError:
            raise ToolArgumentsError(
                f"invalid arguments for tool {self.name!r}: they are nested too deeply to check",
                detail="send flatter arguments",
            ) from None
        except Exception as failure:  # the schema is the server's: its surprises are a tool error
            raise ToolError(
                f"the arguments for tool {self.name!r} could not be checked against its schema "
                f"from {self.server.label} ({type(failure).__name__}: {failure})"
            ) from None

    def _report(self, errors: list[Any]) -> None:
        if not errors:
            return
        errors.sort(key=lambda e: [str(p) for p in e.absolute_path])
        parts = []
        for error in errors[:MAX_REPORTED_ERRORS]:
            path = ".".join(str(p) for p in error.absolute_path) or "(arguments)"
            parts.append(f"{path}: {error.message}")
        if len(errors) > MAX_REPORTED_ERRORS:
            parts.append(f"and {len(errors) - MAX_REPORTED_ERRORS} more")
        raise ToolArgumentsError(
            f"invalid arguments for tool {self.name!r}: " + "; ".join(parts),
            detail="fix these fields and call the tool again",
        )

    async def invoke(self, arguments: Mapping[str, Any], *, context: ToolContext) -> Any:
        """Check arguments `validate` left (on a worker thread), call the server's tool and turn
        its result into the body the model reads."""
        values = dict(arguments)
        if not self._on_loop(values):
            try:
                errors = await run_check(
                    self._errors,
                    values,
                    budget=CHECK_BUDGET_SECONDS,
                    threads=getattr(self.server, "checks", None),
                )
            except BudgetExceeded:  # still running (one RE2 call cannot be stopped)
                raise self._overrun() from None
            self._report(errors)
        result = await self.server.call(self.remote_name, values)
        if _small_result(result):
            return result_body(result, self.name)
        # Turning a bulky result into the capped text the model reads walks all of it in Python
        # (seconds for 200,000 entries): on a worker thread, where the loop gets the GIL back
        # every few milliseconds, and only the capped text comes back.
        return await run_internal_io(self._encoded, result)

    def _encoded(self, result: types.CallToolResult) -> EncodedResult:
        return EncodedResult.of(result_body(result, self.name), max_chars=self.max_result_chars)


def checked_validator(
    schema: dict[str, Any],
    tool: str,
    server: str,
    which: str = "input",
    patterns: Patterns | None = None,
) -> Compiled:
    """The compiled validator of a tool's `which` ("input" or "output") schema, its regexes
    compiled into `patterns` (those of its listing); `MCPSchemaError` naming tool and server
    when the schema is refused."""
    try:
        return compile_schema(schema, patterns)
    except SchemaRefused as error:
        raise MCPSchemaError(
            f"MCP server {server} lists tool {tool!r} with an {which} schema Treadle refuses: "
            f"{error}; fix the tool's schema on the server."
        ) from None


def _size(data: str) -> str:
    try:
        n = len(base64.b64decode(data, validate=False))
    except (binascii.Error, ValueError):
        n = len(data)
    return f"{n:,} bytes"


def _block_text(block: Any) -> str:
    """A content block as text: text as it is, anything binary as a marker."""
    if isinstance(block, types.TextContent):
        return block.text
    if isinstance(block, types.ImageContent):
        return f"[image: {block.mime_type}, {_size(block.data)}, not shown]"
    if isinstance(block, types.AudioContent):
        return f"[audio: {block.mime_type}, {_size(block.data)}, not shown]"
    if isinstance(block, types.ResourceLink):
        return f"[resource link: {block.uri} ({block.name})]"
    if isinstance(block, types.EmbeddedResource):
        resource = block.resource
        if isinstance(resource, types.TextResourceContents):
            return f"[resource {resource.uri}]\n{resource.text}"
        mime = getattr(resource, "mime_type", None) or "binary"
        return (
            f"[resource {resource.uri}: {mime}, {_size(getattr(resource, 'blob', ''))}, not shown]"
        )
    kind = getattr(block, "type", type(block).__name__)
    return f"[{kind} content, not shown]"


def result_body(result: types.CallToolResult, name: str) -> dict[str, Any]:
    """The body of a tool result (`{"content": ...}` and/or `{"structured": ...}`); raises
    `ToolError` when the server flagged the result as an error."""
    texts = [_block_text(block) for block in result.content]
    if result.is_error:
        message = "\n".join(t for t in texts if t) or "no message"
        raise ToolError(f"MCP tool {name!r} reported an error: {message}")
    body: dict[str, Any] = {}
    if result.structured_content is not None:
        body["structured"] = result.structured_content
        markers = [
            t
            for block, t in zip(result.content, texts, strict=True)
            if not isinstance(block, types.TextContent)
        ]
        if markers:
            body["content"] = "\n".join(markers)
    else:
        body["content"] = "\n".join(texts)
    return body
