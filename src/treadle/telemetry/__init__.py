"""OpenTelemetry traces and metrics of passes, in the GenAI semantic conventions (opt-in extra).

Install `treadle[otel]` (or just `opentelemetry-api`) and configure an SDK `TracerProvider` (and
`MeterProvider`) as usual: every pass then emits an `invoke_agent` span, one `chat {model}` span
per model request and one `execute_tool {name}` span per tool call, with token-usage and duration
histograms. Nothing here imports OpenTelemetry: tracing is on only when the application has
already imported and configured it, so a process without it pays one dictionary lookup per pass.

Prompt and completion content is recorded only after `configure(capture_content=True)` (or
`TREADLE_OTEL_CAPTURE_CONTENT=true`); API keys are never recorded.
"""

from treadle.telemetry.context import (
    TraceParent,
    capture_parent,
    flush,
    inject_parent,
    parent_from_carrier,
    use_parent,
)
from treadle.telemetry.hooks import (
    PassTrace,
    capturing_content,
    configure,
    current_pass,
    finish_pass,
    note_limiter_wait,
    note_retry,
    start_pass,
    tool_span,
)

__all__ = [
    "PassTrace",
    "TraceParent",
    "capture_parent",
    "capturing_content",
    "configure",
    "current_pass",
    "finish_pass",
    "flush",
    "inject_parent",
    "note_limiter_wait",
    "note_retry",
    "parent_from_carrier",
    "start_pass",
    "tool_span",
    "use_parent",
]
