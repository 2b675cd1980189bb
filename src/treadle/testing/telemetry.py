"""`in_memory_telemetry`: OpenTelemetry SDK providers that keep spans and metrics in memory.

For tests and examples of traced passes (needs `opentelemetry-sdk`). OpenTelemetry lets a process
set its global providers once, so call this once, at start-up of a test process or a script.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

__all__ = ["in_memory_telemetry"]


def in_memory_telemetry() -> tuple[InMemorySpanExporter, InMemoryMetricReader]:
    """Install global tracer and meter providers that record in memory; return their stores.

    Spans are exported as each ends (`exporter.get_finished_spans()`); metrics are collected on
    `reader.get_metrics_data()`.
    """
    from opentelemetry import metrics, trace
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(tracer_provider)
    reader = InMemoryMetricReader()
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
    return exporter, reader
