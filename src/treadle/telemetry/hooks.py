"""The hooks the pass, the model client and the dispatcher call, and the spans behind them.

Tracing is on when the application has imported OpenTelemetry and installed a real tracer
provider; this module never imports OpenTelemetry itself before that (it looks in `sys.modules`),
so with tracing off every hook is a check of a context variable or of one dictionary. The pass's
`PassTrace` lives in a context variable set on the pass's own task: the model client and the tool
tasks (children of that task) find it there without any argument threading through the layers.

Span names and attributes follow the OpenTelemetry GenAI semantic conventions:
`invoke_agent {name}` (one per pass), `chat {model}` (one per model request, kind CLIENT) and
`execute_tool {name}` (one per tool call), with `gen_ai.client.token.usage` and
`gen_ai.client.operation.duration` histograms. Treadle's own: `treadle.passes.in_flight` and
`treadle.limiter.wait`.
"""

from __future__ import annotations

import contextvars
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from treadle.telemetry.context import TraceParent, trace_api

__all__ = [
    "PassTrace",
    "capturing_content",
    "configure",
    "current_pass",
    "finish_pass",
    "note_limiter_wait",
    "note_retry",
    "start_pass",
    "tool_span",
]

_SCOPE = "treadle"
_PROVIDER_NAME = "openai"  # the wire protocol every Treadle endpoint speaks


@dataclass(slots=True)
class _Settings:
    capture_content: bool


_settings = _Settings(
    capture_content=os.environ.get("TREADLE_OTEL_CAPTURE_CONTENT", "").lower() in ("1", "true")
)

_current: contextvars.ContextVar[PassTrace | None] = contextvars.ContextVar(
    "treadle_pass_trace", default=None
)


def configure(*, capture_content: bool | None = None) -> None:
    """Set telemetry options. `capture_content=True` records prompts, completions, tool
    arguments and results on the spans (off by default: they may hold personal data)."""
    if capture_content is not None:
        _settings.capture_content = bool(capture_content)


def capturing_content() -> bool:
    """Whether spans record prompts, completions and tool payloads."""
    return _settings.capture_content


def current_pass() -> PassTrace | None:
    """The trace of the pass running in this task, if it is traced."""
    return _current.get()


class _Instruments:
    """The metric instruments, created once per meter provider."""

    def __init__(self) -> None:
        from opentelemetry.metrics import get_meter

        meter = get_meter(_SCOPE)
        self.tokens = meter.create_histogram(
            "gen_ai.client.token.usage", unit="{token}", description="Tokens used per request."
        )
        self.duration = meter.create_histogram(
            "gen_ai.client.operation.duration", unit="s", description="GenAI operation duration."
        )
        self.in_flight = meter.create_up_down_counter(
            "treadle.passes.in_flight", unit="{pass}", description="Passes running now."
        )
        self.limiter_wait = meter.create_histogram(
            "treadle.limiter.wait", unit="s", description="Time a request waited for a permit."
        )


_instruments: list[_Instruments] = []


def _metrics() -> _Instruments:
    if not _instruments:
        _instruments.append(_Instruments())
    return _instruments[0]


def _server(url: str | None) -> dict[str, Any]:
    if not url:
        return {}
    parts = urlsplit(url)
    attrs: dict[str, Any] = {}
    if parts.hostname:
        attrs["server.address"] = parts.hostname
    port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    if port:
        attrs["server.port"] = port
    return attrs


_tracers: dict[int, tuple[Any, Any]] = {}


def _tracer(api: Any) -> Any:
    """Treadle's tracer from the current provider (made once per provider: the SDK's
    `get_tracer` costs a sixth of a traced round)."""
    provider = api.get_tracer_provider()
    known = _tracers.get(id(provider))
    if known is None or known[0] is not provider:
        known = (provider, provider.get_tracer(_SCOPE))
        _tracers.clear()  # one provider is current at a time
        _tracers[id(provider)] = known
    return known[1]


class PassTrace:
    """The spans of one pass: the `invoke_agent` span and its children."""

    __slots__ = ("_api", "_base", "_chat", "_chat_start", "_ctx", "_start", "_tracer", "span")

    def __init__(
        self,
        api: Any,
        parent: TraceParent,
        *,
        session_id: str,
        agent_name: str | None,
        model: str | None,
        base_url: str | None,
    ) -> None:
        self._api = api
        self._base: dict[str, Any] = {
            "gen_ai.provider.name": _PROVIDER_NAME,
            "gen_ai.system": _PROVIDER_NAME,
            **_server(base_url),
        }
        if model:
            self._base["gen_ai.request.model"] = model
        attrs = {
            **self._base,
            "gen_ai.operation.name": "invoke_agent",
            "gen_ai.conversation.id": session_id,
        }
        if agent_name:
            attrs["gen_ai.agent.name"] = agent_name
        name = f"invoke_agent {agent_name}" if agent_name else "invoke_agent"
        self._tracer = tracer = _tracer(api)
        self.span = tracer.start_span(name, context=parent.context, attributes=attrs)
        self._ctx = api.set_span_in_context(self.span, parent.context)
        self._chat: Any = None
        self._chat_start = 0.0
        self._start = time.monotonic()
        _metrics().in_flight.add(1, {"gen_ai.provider.name": _PROVIDER_NAME})

    # -- model requests ---------------------------------------------------------------------
    def start_chat(self, model: str | None, messages: Sequence[Mapping[str, Any]] | None) -> None:
        """Open the `chat {model}` span of one request."""
        attrs = {**self._base, "gen_ai.operation.name": "chat"}
        if _settings.capture_content and messages is not None:
            attrs["gen_ai.input.messages"] = _json(messages)
        kind = self._api.SpanKind.CLIENT
        name = f"chat {model}" if model else "chat"
        self._chat = self._tracer.start_span(name, context=self._ctx, kind=kind, attributes=attrs)
        self._chat_start = time.monotonic()

    def end_chat(
        self,
        *,
        response_id: str | None = None,
        response_model: str | None = None,
        finish_reason: str | None = None,
        input_tokens: int | None = None,
        output_tokens: int | None = None,
        output: Mapping[str, Any] | None = None,
        error: BaseException | None = None,
    ) -> None:
        """Close the current `chat` span with what the reply said (or the error)."""
        span, self._chat = self._chat, None
        if span is None:
            return
        attrs: dict[str, Any] = {}
        if response_id:
            attrs["gen_ai.response.id"] = response_id
        if response_model:
            attrs["gen_ai.response.model"] = response_model
        if finish_reason:
            attrs["gen_ai.response.finish_reasons"] = [finish_reason]
        if input_tokens is not None:
            attrs["gen_ai.usage.input_tokens"] = input_tokens
        if output_tokens is not None:
            attrs["gen_ai.usage.output_tokens"] = output_tokens
        if _settings.capture_content and output is not None:
            attrs["gen_ai.output.messages"] = _json([{"role": "assistant", **output}])
        span.set_attributes(attrs)
        metric_attrs = {
            k: v
            for k, v in self._base.items()
            if k in ("gen_ai.provider.name", "gen_ai.request.model", "server.address")
        }
        metric_attrs["gen_ai.operation.name"] = "chat"
        if response_model:
            metric_attrs["gen_ai.response.model"] = response_model
        if error is not None:
            _fail(self._api, span, error)
            metric_attrs["error.type"] = type(error).__name__
        instruments = _metrics()
        instruments.duration.record(time.monotonic() - self._chat_start, metric_attrs)
        if input_tokens is not None:
            instruments.tokens.record(input_tokens, {**metric_attrs, "gen_ai.token.type": "input"})
        if output_tokens is not None:
            instruments.tokens.record(
                output_tokens, {**metric_attrs, "gen_ai.token.type": "output"}
            )
        span.end()

    def note_retry(self, attempt: int, reason: str, delay: float) -> None:
        """An event on the current `chat` span: this request is being retried."""
        span = self._chat
        if span is not None:
            span.add_event(
                "treadle.retry",
                {
                    "treadle.retry.attempt": attempt,
                    "treadle.retry.reason": reason[:500],
                    "treadle.retry.delay_s": delay,
                },
            )
            span.set_attribute("treadle.retries", attempt)

    def note_limiter_wait(self, seconds: float) -> None:
        """Record how long the current request waited for the endpoint limiter."""
        span = self._chat
        if span is not None:
            span.set_attribute("treadle.limiter.wait_s", seconds)
        _metrics().limiter_wait.record(seconds, {"gen_ai.provider.name": _PROVIDER_NAME})

    # -- tools ------------------------------------------------------------------------------
    def start_tool(self, name: str, call_id: str, arguments: str) -> Any:
        """Open the `execute_tool {name}` span of one call."""
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": name,
            "gen_ai.tool.call.id": call_id,
            "gen_ai.tool.type": "function",
        }
        if _settings.capture_content:
            attrs["gen_ai.tool.call.arguments"] = arguments
        return self._tracer.start_span(f"execute_tool {name}", context=self._ctx, attributes=attrs)

    def enter_tool(self, span: Any) -> Any:
        """Make the tool span current while the tool runs (what it traces, a pass it starts,
        hangs under it); returns the token for `leave_tool`, in the same task."""
        from opentelemetry import context

        return context.attach(self._api.set_span_in_context(span, self._ctx))

    def leave_tool(self, token: Any) -> None:
        """Restore the context `enter_tool` replaced."""
        from opentelemetry import context

        context.detach(token)

    def end_tool(self, span: Any, error_kind: str | None, content: str) -> None:
        """Close a tool span; `error_kind` is the tool result's error kind, if it failed."""
        if _settings.capture_content:
            span.set_attribute("gen_ai.tool.call.result", content)
        if error_kind is not None:
            span.set_attribute("error.type", error_kind)
            span.set_status(self._api.Status(self._api.StatusCode.ERROR, error_kind))
        span.end()

    # -- the pass ---------------------------------------------------------------------------
    def end(
        self,
        stop_reason: str | None,
        input_tokens: int,
        output_tokens: int,
        error: BaseException | None = None,
    ) -> None:
        """Close the pass span (and a `chat` span an error left open)."""
        if self._chat is not None:
            self.end_chat(error=error or RuntimeError("the pass ended during the request"))
        attrs: dict[str, Any] = {
            "gen_ai.usage.input_tokens": input_tokens,
            "gen_ai.usage.output_tokens": output_tokens,
        }
        if stop_reason is not None:
            attrs["treadle.stop_reason"] = stop_reason
        self.span.set_attributes(attrs)
        if error is not None:
            _fail(self._api, self.span, error)
        _metrics().in_flight.add(-1, {"gen_ai.provider.name": _PROVIDER_NAME})
        self.span.end()


def _fail(api: Any, span: Any, error: BaseException) -> None:
    span.set_attribute("error.type", type(error).__name__)
    span.record_exception(error)
    span.set_status(api.Status(api.StatusCode.ERROR, str(error)[:500]))


def _json(value: Any) -> str:
    import pydantic_core

    return pydantic_core.to_json(value, fallback=str).decode()


def start_pass(
    parent: TraceParent | None,
    *,
    session_id: str,
    agent_name: str | None,
    model: str | None,
    base_url: str | None,
) -> tuple[PassTrace, contextvars.Token[PassTrace | None]] | None:
    """Open the pass span under `parent` and make it current in this task (None: not traced)."""
    if parent is None:
        return None
    api = trace_api()
    if api is None:
        return None
    trace = PassTrace(
        api,
        parent,
        session_id=session_id,
        agent_name=agent_name,
        model=model,
        base_url=base_url,
    )
    return trace, _current.set(trace)


def finish_pass(
    started: tuple[PassTrace, contextvars.Token[PassTrace | None]],
    stop_reason: str | None,
    input_tokens: int,
    output_tokens: int,
    error: BaseException | None = None,
) -> None:
    """Close the pass span and restore the task's previous trace."""
    trace, token = started
    try:
        trace.end(stop_reason, input_tokens, output_tokens, error)
    finally:
        try:
            _current.reset(token)
        except ValueError:  # reset from another context (a cancelled task's cleanup): clear
            _current.set(None)


def note_retry(attempt: int, reason: str, delay: float) -> None:
    """Tell the current request's span it is being retried (no-op when not traced)."""
    trace = _current.get()
    if trace is not None:
        trace.note_retry(attempt, reason, delay)


def note_limiter_wait(seconds: float) -> None:
    """Tell the current request's span how long it waited for a permit (no-op when not traced)."""
    trace = _current.get()
    if trace is not None:
        trace.note_limiter_wait(seconds)


def tool_span(name: str, call_id: str, arguments: str) -> tuple[PassTrace, Any] | None:
    """Open an `execute_tool` span in the current pass (None when not traced)."""
    trace = _current.get()
    if trace is None:
        return None
    return trace, trace.start_tool(name, call_id, arguments)
