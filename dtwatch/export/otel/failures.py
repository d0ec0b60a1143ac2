"""The failure policy of OTLP export: one warning, then quiet, bounded retries.

Exports run in the SDK's threads (BatchSpanProcessor with a bounded queue, periodic reader) with a
short timeout (default 2 s). The first failure logs ONE warning on the ``dtwatch.export.otel`` logger
(with the SDK's reason); then exports are skipped for ``retry_after`` seconds at a time (one probe per
period) and a recovery is logged at info. The SDK's own exporter loggers (``opentelemetry.exporter``,
the batch processor's, the metric reader's) are captured while an exporter lives - logged again at
debug on ``dtwatch.export.otel`` - so a dead collector does not repeat itself in the watchdog's log.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, MetricsData
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

log = logging.getLogger("dtwatch.export.otel")

# SDK loggers captured while an exporter lives (their records are re-logged at debug on dtwatch.export.otel).
SDK_LOGGERS = (
    "opentelemetry.exporter",
    "opentelemetry.sdk._shared_internal",
    "opentelemetry.sdk.trace.export",
    "opentelemetry.sdk.metrics._internal.export",
)


class ExportHealth:
    """Shared by every exporter of one OtelExporter: warns once per outage, skips exports meanwhile."""

    def __init__(self, where: str, retry_after: float) -> None:
        self.where = where
        self.retry_after = retry_after
        self._lock = threading.Lock()
        self._retry_at = 0.0
        self.failing = False
        self.failures = 0
        self.skipped = 0  # batches not even tried while failing
        self.warnings = 0
        self.last_sdk_message = ""

    def allow(self) -> bool:
        """May an export be tried now? While failing: one probe per ``retry_after`` seconds."""
        with self._lock:
            if not self.failing:
                return True
            now = time.monotonic()
            if now >= self._retry_at:
                self._retry_at = now + self.retry_after
                return True
            self.skipped += 1
            return False

    def failed(self, reason: str = "") -> None:
        with self._lock:
            self.failures += 1
            self._retry_at = time.monotonic() + self.retry_after
            if self.failing:
                return
            self.failing = True
            self.warnings += 1
            detail = reason or self.last_sdk_message or "no detail from the SDK"
        log.warning(
            "dtwatch: OpenTelemetry export to %s failed (%s); spans and metrics are dropped while it fails, "
            "retrying every %.0f s without further warnings", self.where, detail, self.retry_after,
        )

    def succeeded(self) -> None:
        with self._lock:
            was_failing, self.failing = self.failing, False
        if was_failing:
            log.info("dtwatch: OpenTelemetry export to %s works again", self.where)


class SdkLogCapture(logging.Handler):
    """Takes the SDK exporters' log records while installed (they stop propagating to the root)."""

    _lock: ClassVar[threading.Lock] = threading.Lock()
    _installed: ClassVar[list[SdkLogCapture]] = []
    _saved: ClassVar[dict[str, bool]] = {}

    def __init__(self, health: ExportHealth) -> None:
        super().__init__(level=logging.DEBUG)
        self.health = health

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001
            message = str(record.msg)
        if record.levelno >= logging.WARNING:
            self.health.last_sdk_message = message[:500]
        log.debug("otel sdk (%s): %s", record.name, message)

    def install(self) -> None:
        with self._lock:
            if not self._installed:
                for name in SDK_LOGGERS:
                    lg = logging.getLogger(name)
                    self._saved[name] = lg.propagate
                    lg.propagate = False
            for name in SDK_LOGGERS:
                logging.getLogger(name).addHandler(self)
            self._installed.append(self)

    def uninstall(self) -> None:
        with self._lock:
            if self not in self._installed:
                return
            self._installed.remove(self)
            for name in SDK_LOGGERS:
                logging.getLogger(name).removeHandler(self)
            if not self._installed:
                for name, propagate in self._saved.items():
                    logging.getLogger(name).propagate = propagate
                self._saved.clear()


class GuardedSpanExporter(SpanExporter):
    """Wraps an OTLP span exporter: skips while the endpoint fails, reports to :class:`ExportHealth`."""

    def __init__(self, inner: SpanExporter, health: ExportHealth) -> None:
        self.inner = inner
        self.health = health
        self.exported = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if not self.health.allow():
            return SpanExportResult.FAILURE
        try:
            result = self.inner.export(spans)
        except Exception as exc:  # noqa: BLE001 - an exporter must not kill the batch thread
            self.health.failed(repr(exc))
            return SpanExportResult.FAILURE
        if result is SpanExportResult.SUCCESS:
            self.exported += len(spans)
            self.health.succeeded()
        else:
            self.health.failed()
        return result

    def shutdown(self) -> None:
        try:
            self.inner.shutdown()
        except Exception:
            log.debug("dtwatch: span exporter shutdown failed", exc_info=True)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


class GuardedMetricExporter(MetricExporter):
    """Wraps an OTLP metric exporter like :class:`GuardedSpanExporter`; ``amend`` may add to each export
    (it runs under the same guard: an exception there is an export failure)."""

    def __init__(
        self, inner: MetricExporter, health: ExportHealth, amend: Callable[[MetricsData | None], MetricsData]
    ) -> None:
        super().__init__(
            preferred_temporality=getattr(inner, "_preferred_temporality", None),
            preferred_aggregation=getattr(inner, "_preferred_aggregation", None),
        )
        self.inner = inner
        self.health = health
        self.amend = amend

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any) -> MetricExportResult:
        if not self.health.allow():
            return MetricExportResult.FAILURE
        try:
            result = self.inner.export(self.amend(metrics_data), timeout_millis=timeout_millis, **kwargs)
        except Exception as exc:  # noqa: BLE001
            self.health.failed(repr(exc))
            return MetricExportResult.FAILURE
        if result is MetricExportResult.SUCCESS:
            self.health.succeeded()
        else:
            self.health.failed()
        return result

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        try:
            self.inner.shutdown(timeout_millis=timeout_millis)
        except Exception:
            log.debug("dtwatch: metric exporter shutdown failed", exc_info=True)
