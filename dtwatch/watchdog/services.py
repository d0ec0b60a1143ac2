"""What the watchdog serves and sends to: GPU sampling, the Prometheus endpoint, OTLP, the webhook, and the
ready file that tells launchers it serves. Each is optional; one that fails to start is one warning
(and an error counted in the watchdog's health) and diagnosis goes on without it."""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import dtwatch.paths as paths
from dtwatch.config import WatchOptions
from dtwatch.export.view import NodeView

log = logging.getLogger("dtwatch")

_OTLP_VARIABLES = tuple(f"OTEL_EXPORTER_OTLP_{k}ENDPOINT" for k in ("", "TRACES_", "METRICS_"))


class Services:
    """Started once by the watchdog's main thread, closed once at its end. ``on_error(component)`` counts
    a failure in the watchdog's health."""

    def __init__(self, opts: WatchOptions, on_error: Callable[[str], None]) -> None:
        self.opts = opts
        self.on_error = on_error
        self.gpu: Any = None
        self.metrics_server: Any = None
        self.exporters: list[Any] = []
        self.webhook: Any = None

    def start(self, *, healthy: Callable[[], bool], started: float) -> None:
        self._start_gpu()
        self._start_prometheus(healthy)
        self._start_otlp()
        if self.opts.webhook:
            from dtwatch.export.webhook import Webhook

            self.webhook = Webhook(self.opts.webhook, on_error=lambda: self.on_error("webhook"))
        self._write_ready_file(started)
        if self.metrics_server is not None:
            self.metrics_server.ready = True

    def _start_gpu(self) -> None:
        try:
            from dtwatch.export.nvml import GpuSampler

            self.gpu = GpuSampler()
        except Exception as exc:  # noqa: BLE001 - NVML is optional
            log.debug("dtwatch: no GPU metrics: %r", exc)
            self.gpu = None

    def _start_prometheus(self, healthy: Callable[[], bool]) -> None:
        opts = self.opts
        if opts.metrics_port is None:
            return
        try:
            from dtwatch.export.prometheus import MetricsServer, PrometheusExporter

            exporter = PrometheusExporter(job_id=opts.job_id, node=opts.node, gpu=self.gpu)
            self.metrics_server = MetricsServer(
                exporter.registry, addr=opts.metrics_addr, port=opts.metrics_port, health_fn=healthy,
                url_file=paths.watchdog_ready_file(opts.run_dir, opts.node), node=opts.node,
            )
            self.exporters.append(exporter)
        except OSError as exc:
            log.warning("dtwatch: metrics endpoint %s:%s unavailable (%s); diagnosis continues without it",
                        opts.metrics_addr, opts.metrics_port, exc)
            self.on_error("metrics")
        except ImportError as exc:
            log.warning("dtwatch: Prometheus exporter unavailable: %s", exc)

    def _start_otlp(self) -> None:
        opts = self.opts
        if not (opts.otlp_endpoint or any(os.environ.get(k) for k in _OTLP_VARIABLES)):
            return  # the OpenTelemetry SDK is only imported when an endpoint is configured
        try:
            from dtwatch.export.otel import OtelExporter

            otel = OtelExporter.from_env(endpoint=opts.otlp_endpoint or None, job_id=opts.job_id, node=opts.node,
                                         gpu=self.gpu)
            if otel is not None:
                self.exporters.append(otel)
        except ImportError as exc:
            if opts.otlp_endpoint:
                log.warning("dtwatch: OpenTelemetry export unavailable (pip install 'dtwatch[otel]'): %s", exc)
        except Exception as exc:  # noqa: BLE001
            log.warning("dtwatch: OpenTelemetry export unavailable: %s", exc)
            self.on_error("otel")

    def _write_ready_file(self, started: float) -> None:
        """``watchdog-<node>.json`` appears once the watchdog serves (the metrics server wrote its URL there)."""
        path = paths.watchdog_ready_file(self.opts.run_dir, self.opts.node)
        ready: dict[str, Any] = {}
        if self.metrics_server is not None:
            try:
                ready = json.loads(Path(path).read_text())
            except (OSError, ValueError):
                ready = {}
        ready.update({"pid": os.getpid(), "node": self.opts.node, "job_id": self.opts.job_id, "started": started,
                      "url": getattr(self.metrics_server, "url", None)})
        tmp = path + ".tmp"
        Path(tmp).write_text(json.dumps(ready))
        os.replace(tmp, path)

    def publish(self, view: NodeView) -> None:
        """Hand the poll's view to every exporter; one that fails is counted, never raised."""
        for exp in self.exporters:
            try:
                exp.update(view)
            except Exception as exc:  # noqa: BLE001
                self.on_error(type(exp).__name__)
                log.debug("dtwatch: exporter failed: %r", exc)

    def alert(self, payload: dict) -> None:
        if self.webhook is not None:
            self.webhook.send(payload)

    def close(self) -> None:
        for exp in self.exporters:
            try:
                exp.shutdown()
            except Exception:  # noqa: BLE001
                pass
        if self.webhook is not None:
            self.webhook.close()
        if self.metrics_server is not None:
            self.metrics_server.close()
        if self.gpu is not None:
            self.gpu.close()
