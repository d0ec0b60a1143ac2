"""OpenTelemetry export of the watchdog over OTLP: spans per collective, grouped by step, and metrics.

Enabled only when an OTLP endpoint is configured: ``--otlp-endpoint`` (the ``endpoint`` argument) or
the standard variables ``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_{TRACES,METRICS}_ENDPOINT``;
the other ``OTEL_*`` variables honoured are listed in :mod:`.config`. An argument beats the
environment; a malformed environment value is refused with a warning (the default is used), a bad
argument raises :class:`OtelConfigError`::

    from dtwatch.export.otel import OtelExporter

    otel = OtelExporter.from_env(endpoint=args.otlp_endpoint, gpu=gpu)   # None: not configured
    while running:
        if otel: otel.update(view)                                        # every poll
    if otel: otel.shutdown()                                              # bounded by its timeout

One concern per module:

- :mod:`.config` - OTLP settings (argument > ``OTEL_*`` environment > default) and the SDK exporters
  they configure;
- :mod:`.sampling` - which collectives become spans (step stride, hard cap, always-kept calls);
- :mod:`.spans` - spans per collective under one span per step, per rank, with job-wide trace ids;
- :mod:`.meters` - the metric set of ``docs/metrics.md`` over OTLP, exact histograms included;
- :mod:`.failures` - failure is quiet and bounded: one warning per outage, then one probe per
  ``retry_after`` seconds, the SDK's own loggers captured;
- :mod:`.resource` - the resource and scope every provider carries;
- :mod:`.exporter` - :class:`OtelExporter`, which wires them to the watchdog's views.
  :meth:`OtelExporter.update` and :meth:`OtelExporter.shutdown` never raise; shutdown returns within
  its timeout.
"""
from __future__ import annotations

import importlib

try:
    for _module in ("opentelemetry.sdk.trace", "opentelemetry.sdk.metrics", "opentelemetry.util.re"):
        importlib.import_module(_module)
except ImportError as _exc:  # pragma: no cover - depends on the installation
    raise ImportError(
        f"dtwatch.export.otel needs the OpenTelemetry SDK and OTLP exporters ({_exc}): pip install 'dtwatch[otel]'"
    ) from _exc

from dtwatch.export.otel.exporter import OtelExporter
from dtwatch.export.otel.otel_config import (
    OtelConfigError,
    OtlpConfig,
    SignalTarget,
    otlp_configured,
    parse_resource_attributes,
    resolve_config,
)
from dtwatch.export.otel.sampling import SpanSampling
from dtwatch.export.otel.spans import step_trace_id

__all__ = [
    "OtelConfigError",
    "OtelExporter",
    "OtlpConfig",
    "SignalTarget",
    "SpanSampling",
    "otlp_configured",
    "parse_resource_attributes",
    "resolve_config",
    "step_trace_id",
]
