"""Every exception Treadle raises, in one hierarchy rooted at `TreadleError`.

```
TreadleError
├── ConfigurationError (also ValueError)      bad arguments at a public entry point
│   └── EvalConfigMismatch                    resuming an eval log with another configuration
├── RuntimeLoopError (also RuntimeError)      a blocking read on the runtime's own loop thread
├── SessionFailedError                        reserved: a pass failed (the original error is raised)
│   └── PassFailed                            a distributed pass raised, timed out or was lost
│       └── PassLost (also WorkerLost)        its workers died under it on every attempt
├── ProviderError                             the model endpoint answered with an error
│   ├── AuthenticationError                   401 / 403
│   ├── RateLimitError                        429 after all retries
│   ├── ContextLengthError                    the prompt does not fit the model's context
│   ├── ProviderTimeout (also TimeoutError)   connect or read timed out after all retries
│   ├── ProviderConnectionError               refused / reset / disconnected after all retries
│   │   ├── ProtocolMismatchError             https:// to a plain-HTTP port (or the reverse)
│   │   └── HostNotFoundError                 the endpoint's host name does not exist (not retried)
│   ├── NotOpenAIEndpointError                the URL answers, but not as an OpenAI endpoint
│   ├── ModelNotFoundError                    the endpoint does not serve the requested model
│   ├── InvalidRequestError                   a 5xx saying this request cannot be parsed
│   └── MalformedResponse                     non-JSON body, no choices, torn stream
├── ToolError                                 raised by the tool layer, reported to the model
│   ├── ToolArgumentsError                    arguments do not match the tool's schema
│   ├── ToolTimeoutError
│   └── MCPServerError                        an MCP server cannot start, crashed or hung up
│       └── MCPSchemaError                    a server lists a tool whose input schema is refused
├── SandboxError
│   ├── PathViolation                         a path leaves the workspace
│   └── SandboxUnavailable                    the machine lacks what a backend needs (bwrap)
├── ToolEnabledError                          a tool's is_enabled function raised (fails the pass)
├── BudgetExceededError                       raised by `on_budget_exceeded` to stop a pass
├── PersistenceError                          a session file cannot be read
│   ├── EvalLogDamagedError                   an eval log line is not a valid record (file:line)
│   ├── EvalLogBusyError                      another run holds the eval log's lock
│   └── StoreError                            a conversation store failed (lost, damaged)
│       ├── ConflictError                     another writer moved the conversation first
│       └── WriteOutcomeUnknown               a write's connection ended after its commit was sent
├── StructuredOutputError                     no valid structured output within `output_retries`
├── ModelRefusalError                         the model refused to answer (never retried)
├── HookError                                 a lifecycle hook raised or ran over its timeout
├── GuardrailError                            a guardrail ran over its timeout
├── ModelRetry                                raised by an output validator: ask the model again
└── WorkerLost                                a distributed worker died or stopped answering
```

Error messages say what happened and what to do next, in one sentence. This module must never
import anything heavier than the standard library: every layer imports it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the outcome is a plain dataclass of the distributed layer; never imported here
    from treadle.distributed.outcome import PassOutcome

__all__ = [
    "AuthenticationError",
    "BudgetExceededError",
    "ConfigurationError",
    "ConflictError",
    "ContextLengthError",
    "EvalConfigMismatch",
    "EvalLogBusyError",
    "EvalLogDamagedError",
    "GuardrailError",
    "HookError",
    "HostNotFoundError",
    "InvalidRequestError",
    "MCPSchemaError",
    "MCPServerError",
    "MalformedResponse",
    "ModelNotFoundError",
    "ModelRefusalError",
    "ModelRetry",
    "NotOpenAIEndpointError",
    "PassFailed",
    "PassLost",
    "PathViolation",
    "PersistenceError",
    "ProtocolMismatchError",
    "ProviderConnectionError",
    "ProviderError",
    "ProviderTimeout",
    "RateLimitError",
    "RuntimeLoopError",
    "SandboxError",
    "SandboxUnavailable",
    "SessionFailedError",
    "StoreError",
    "StructuredOutputError",
    "ToolArgumentsError",
    "ToolEnabledError",
    "ToolError",
    "ToolTimeoutError",
    "TreadleError",
    "WorkerLost",
    "WriteOutcomeUnknown",
]


MAX_ID_CHARS = 256
"""Characters of a provider's id (a request id, a completion id) kept where it is shown."""


def clean_id(value: str | None) -> str:
    """A provider's id as Treadle shows and keeps it: cut to `MAX_ID_CHARS`, printable
    characters only (no escape sequences, C1 controls, tabs or bidi overrides), trimmed; `""`
    when nothing is left but spaces and U+FFFD (bytes that were not UTF-8: no id to look up).
    The one rule for `ProviderError.request_id` and `RequestUsage`."""
    if not value:
        return ""
    if len(value) > MAX_ID_CHARS or not value.isprintable():
        value = "".join(c for c in value[:MAX_ID_CHARS] if c.isprintable())
    value = value.strip()
    return value if value.replace("\ufffd", "").strip() else ""


class TreadleError(Exception):
    """Base class of every error Treadle raises on purpose."""


class ConfigurationError(TreadleError, ValueError):
    """A public entry point was called with arguments that cannot work."""


class EvalConfigMismatch(ConfigurationError):
    """An eval log was written by another configuration (agent, model, dataset or scorer).

    `changes` lists what differs as `(what, in the log, in this run)`, `what` a dotted path in
    the configuration (`"scorer"`, `"agent.instructions"`, `"dataset.items"`).
    """

    def __init__(
        self, message: str, *, log: str, changes: Sequence[tuple[str, object, object]] = ()
    ) -> None:
        super().__init__(message)
        self.log = log
        self.changes = list(changes)


class RuntimeLoopError(TreadleError, RuntimeError):
    """A blocking read was made on the runtime's own event-loop thread (it would deadlock)."""


class SessionFailedError(TreadleError):
    """A pass failed; raised only when the original exception cannot be re-raised as it was."""


class PassFailed(SessionFailedError):
    """A distributed pass did not finish: it raised, timed out, or lost every worker it ran on."""

    def __init__(self, outcome: PassOutcome) -> None:
        self.outcome = outcome
        super().__init__(
            f"pass {outcome.index} (session {outcome.session_id}) ended with status "
            f"{outcome.status!r} after {outcome.attempts} attempt(s): {outcome.error}"
        )


class ProviderError(TreadleError):
    """The model endpoint answered with an error (or could not be reached).

    Attributes carry what a user needs to report or fix the problem: the HTTP status (None when no
    response arrived), an excerpt of the body, and the server's request id when it sent one.
    """

    def __init__(
        self,
        message: str,
        *,
        status_code: int | None = None,
        body: str | None = None,
        request_id: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.body = body
        # A server's header, shown in messages and logs: capped and cleaned (`clean_id`).
        self.request_id = clean_id(request_id) or None

    def __str__(self) -> str:
        parts = [self.message]
        if self.status_code is not None:
            parts.append(f"(HTTP {self.status_code})")
        if self.request_id:
            parts.append(f"[request id {self.request_id}]")
        return " ".join(parts)


class AuthenticationError(ProviderError):
    """The endpoint rejected the API key (401/403)."""


class RateLimitError(ProviderError):
    """The endpoint kept answering 429 after every retry."""


class ContextLengthError(ProviderError):
    """The request does not fit the model's context window."""


class ProviderTimeout(ProviderError, TimeoutError):
    """Connecting to or reading from the endpoint timed out after every retry."""


class ProviderConnectionError(ProviderError):
    """The endpoint could not be reached or dropped the connection after every retry."""


class MalformedResponse(ProviderError):
    """The endpoint's reply is not a valid chat completion (bad JSON, no choices, torn stream)."""


class ProtocolMismatchError(ProviderConnectionError):
    """The base URL's scheme does not match the server: `https://` to a plain-HTTP port.

    Never retried: the same URL fails the same way every time.
    """


class HostNotFoundError(ProviderConnectionError):
    """The endpoint's host name does not exist (the DNS said so): not retried, as a retry
    would fail the same way; check the spelling of `base_url`."""


class NotOpenAIEndpointError(ProviderError):
    """The base URL answers HTTP, but not as an OpenAI-compatible chat-completions endpoint.

    A web page, a 404/405/501 without an OpenAI error body, or a path the server does not know
    (often a base URL without its `/v1`). Never retried.
    """


class ModelNotFoundError(ProviderError):
    """The endpoint does not serve the requested model (404 naming the model). Never retried."""


class InvalidRequestError(ProviderError):
    """A server error (5xx) that says this request could not be parsed or processed as it is
    (llama.cpp's "Failed to parse tool call"). The same request fails the same way again, so it
    is never retried. (A plain 400 stays a `ProviderError` with `status_code` 400.)
    """


class ToolError(TreadleError):
    """A tool failed in a way the tool layer reports to the model with an `error_kind`."""

    error_kind: str = "tool_execution_exception"

    def __init__(self, message: str, *, detail: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.detail = detail


class ToolArgumentsError(ToolError):
    """The arguments of a tool call do not match the tool's schema (field paths in the message)."""

    error_kind = "invalid_tool_arguments"


class ToolEnabledError(TreadleError):
    """A tool's `is_enabled` function raised; the pass fails with this error (its `__cause__` is
    the function's exception), since whether the tool may be offered is unknown."""


class ToolTimeoutError(ToolError):
    """A tool ran past its timeout and was cancelled or killed."""

    error_kind = "timeout"


class MCPServerError(ToolError):
    """An MCP server could not be started or reached, or it closed the connection mid-call.

    Reported to the model as a tool error; the server is started again on the next call.
    """


class MCPSchemaError(MCPServerError):
    """An MCP server lists a tool whose input schema Treadle refuses (not valid JSON Schema, a
    `$ref` leaving the schema or looping without end); the message names tool and server."""


class SandboxError(TreadleError):
    """The sandbox could not be opened or used."""


class PathViolation(SandboxError, ToolError):
    """A path given to a workspace operation leaves the workspace."""

    error_kind = "path_violation"


class SandboxUnavailable(SandboxError):
    """The machine lacks what a sandbox backend needs (the isolated backend's `bwrap`)."""


class BudgetExceededError(TreadleError):
    """Raise from `on_budget_exceeded` to stop a pass with `stop_reason == "budget"`."""


class PersistenceError(TreadleError):
    """A persisted session file is missing, unreadable or not a Treadle session."""


class EvalLogDamagedError(PersistenceError):
    """A line of an evaluation log is not a valid record; raised before a resume spends anything."""

    def __init__(self, message: str, *, path: str = "", line: int = 0) -> None:
        super().__init__(message)
        self.path = path
        """The log's path."""
        self.line = line
        """The 1-based number of the damaged line."""


class EvalLogBusyError(PersistenceError):
    """Another run (named in the message: pid, host, start time) is writing the evaluation log."""


class StoreError(PersistenceError):
    """A conversation store could not be read or written (connection lost, disk full, damage).

    Raised by a pass that uses `store=`: the pass fails and the conversation keeps its last
    committed version (a pass's rows are committed in one transaction, or not at all).
    """


class ConflictError(StoreError):
    """Another writer appended to the conversation after this one read it (optimistic
    versioning): nothing of this write was committed.

    `key` names the conversation, `expected` is the version this writer read and `actual` the
    version it found; `rows` are the rows that were not written (a pass's new rows), so the
    caller can run the turn again on the latest version.
    """

    def __init__(
        self,
        message: str,
        *,
        key: str = "",
        expected: int = 0,
        actual: int = 0,
        rows: tuple[object, ...] = (),
    ) -> None:
        super().__init__(message)
        self.key = key
        self.expected = expected
        self.actual = actual
        self.rows = rows


class WriteOutcomeUnknown(StoreError):
    """A write whose outcome the store cannot know: its connection ended (or the server never
    answered a close's request to cancel it) after its commit was sent, so the server may have
    committed it or not. Read the conversation before writing the turn again (a retry on a
    write that landed writes it twice); a failure before the commit was sent is a plain
    `StoreError` (nothing was written).
    """


class StructuredOutputError(TreadleError):
    """The model did not produce a valid structured output within `output_retries` retries."""


class WorkerLost(TreadleError):
    """The worker running a distributed pass died or stopped answering (the pass may be retried)."""


class PassLost(PassFailed, WorkerLost):
    """A distributed pass whose worker died (or stopped answering) under it on every attempt:
    `except WorkerLost` catches it as well as `except PassFailed`."""


class ModelRefusalError(TreadleError):
    """The model refused (its reply carried `refusal`); refusals are not retried."""

    def __init__(self, message: str, *, refusal: str = "") -> None:
        super().__init__(message)
        self.refusal = refusal
        """The model's refusal text."""


class HookError(TreadleError):
    """A lifecycle hook (`Hooks`) raised or ran past its timeout; only its pass fails."""


class GuardrailError(TreadleError):
    """A guardrail ran past its timeout (`Guardrail.timeout`); only its pass fails."""


class ModelRetry(TreadleError):
    """Raise from an output validator: the message goes back to the model, which tries again
    (at most `output_retries` times, then `StructuredOutputError`)."""
