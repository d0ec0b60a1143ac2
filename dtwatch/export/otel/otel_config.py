"""OTLP configuration: arguments over the standard ``OTEL_*`` variables over defaults.

Read: ``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_{TRACES,METRICS}_ENDPOINT``,
``OTEL_EXPORTER_OTLP[_{TRACES,METRICS}]_PROTOCOL`` (``grpc``, the default as in the Python SDK, or
``http/protobuf``), ``..._HEADERS``, ``..._COMPRESSION`` (``gzip``/``none``), ``..._TIMEOUT``
(milliseconds, as the specification says), ``OTEL_EXPORTER_OTLP_INSECURE``, ``OTEL_SERVICE_NAME``,
``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_SDK_DISABLED``, and ``OTEL_TRACES_EXPORTER``/``OTEL_METRICS_EXPORTER``
= ``none`` to turn one signal off. A malformed environment value is refused with a warning (the default
is used); a bad argument raises :class:`OtelConfigError`. A base endpoint gets ``/v1/traces`` and
``/v1/metrics`` appended for OTLP/HTTP; a per-signal endpoint is used as given.

:func:`resolve_config` only decides; :func:`make_otlp_exporter` turns one resolved signal into the SDK's
exporter without any further environment lookup.
"""
from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal
from urllib.parse import unquote

from opentelemetry.sdk.metrics.export import MetricExporter
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.util.re import parse_env_headers

if TYPE_CHECKING:  # the transports are imported when a signal is set up, for its protocol only
    import grpc
    from opentelemetry.exporter.otlp.proto.http import Compression

log = logging.getLogger("dtwatch.export.otel")

PROTOCOLS = ("grpc", "http/protobuf")
DEFAULT_PROTOCOL = "grpc"
DEFAULT_TIMEOUT = 2.0  # seconds per export, retries included
SIGNAL_PATHS = {"traces": "v1/traces", "metrics": "v1/metrics"}
Signal = Literal["traces", "metrics"]


class OtelConfigError(ValueError):
    """An OpenTelemetry export option has a value dtwatch does not accept (or no endpoint is set)."""


@dataclass(frozen=True)
class SignalTarget:
    """Where and how one signal (traces or metrics) is sent."""

    endpoint: str
    protocol: str
    headers: dict[str, str]
    compression: str | None  # "gzip" or None
    insecure: bool | None  # gRPC only; None: the URL scheme decides (http = plaintext)


@dataclass(frozen=True)
class OtlpConfig:
    """OTLP settings resolved from arguments over ``OTEL_*`` variables; a signal is None when off."""

    traces: SignalTarget | None
    metrics: SignalTarget | None
    timeout: float  # seconds per export, retries included
    service_name: str
    resource_attributes: dict[str, str]


def _env_choice(env: Mapping[str, str], names: Sequence[str], allowed: Sequence[str], warned: set[str]) -> str | None:
    for name in names:
        raw = env.get(name, "").strip()
        if not raw:
            continue
        if raw.lower() in allowed:
            return raw.lower()
        if name not in warned:  # the generic variable is read once per signal: warn once
            warned.add(name)
            log.warning("dtwatch: ignoring %s=%r: allowed %s; using the default", name, raw, ", ".join(allowed))
        return None
    return None


def _env_headers(env: Mapping[str, str], names: Sequence[str]) -> dict[str, str]:
    headers: dict[str, str] = {}
    for name in reversed(names):  # generic first, then the signal's own override it
        raw = env.get(name, "").strip()
        if raw:
            headers.update(parse_env_headers(raw, liberal=True))
    return headers


def _env_timeout(env: Mapping[str, str], names: Sequence[str]) -> float | None:
    for name in names:
        raw = env.get(name, "").strip()
        if not raw:
            continue
        try:
            value = float(raw) / 1000.0
            if value > 0 and math.isfinite(value):
                return value
        except ValueError:
            pass
        log.warning("dtwatch: ignoring %s=%r: allowed a positive number of milliseconds", name, raw)
        return None
    return None


def parse_resource_attributes(text: str) -> dict[str, str]:
    """``OTEL_RESOURCE_ATTRIBUTES`` syntax: ``k1=v1,k2=v2`` with percent-encoded values."""
    attrs: dict[str, str] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            log.warning("dtwatch: ignoring malformed OTEL_RESOURCE_ATTRIBUTES entry %r (expected key=value)", item)
            continue
        attrs[key.strip()] = unquote(value.strip())
    return attrs


def resolve_config(
    *,
    endpoint: str | None = None,
    protocol: str | None = None,
    traces_endpoint: str | None = None,
    metrics_endpoint: str | None = None,
    headers: Mapping[str, str] | None = None,
    compression: str | None = None,
    timeout: float | None = None,
    service_name: str | None = None,
    resource_attributes: Mapping[str, str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> OtlpConfig:
    """Resolve OTLP settings: argument > ``OTEL_*`` environment > default. Raises on a bad argument."""
    env = os.environ if environ is None else environ
    if protocol is not None and protocol not in PROTOCOLS:
        raise OtelConfigError(f"OTLP protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
    if compression is not None and compression not in ("gzip", "none"):
        raise OtelConfigError(f"OTLP compression must be 'gzip' or 'none', got {compression!r}")
    if timeout is not None and (not isinstance(timeout, (int, float)) or not timeout > 0):
        raise OtelConfigError(f"OTLP timeout must be a positive number of seconds, got {timeout!r}")
    warned: set[str] = set()
    insecure_raw = env.get("OTEL_EXPORTER_OTLP_INSECURE", "").strip().lower()
    insecure = True if insecure_raw == "true" else False if insecure_raw == "false" else None

    def target(signal: Signal, explicit: str | None) -> SignalTarget | None:
        up = signal.upper()
        if env.get(f"OTEL_{up}_EXPORTER", "").strip().lower() == "none":
            return None
        proto = protocol or _env_choice(
            env, (f"OTEL_EXPORTER_OTLP_{up}_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"), PROTOCOLS, warned
        ) or DEFAULT_PROTOCOL
        url: str | None
        if explicit:
            url = explicit
        elif endpoint:
            url = _signal_url(endpoint, signal, proto)
        elif env.get(f"OTEL_EXPORTER_OTLP_{up}_ENDPOINT", "").strip():
            url = env[f"OTEL_EXPORTER_OTLP_{up}_ENDPOINT"].strip()
        elif env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip():
            url = _signal_url(env["OTEL_EXPORTER_OTLP_ENDPOINT"].strip(), signal, proto)
        else:
            return None
        hdrs = _env_headers(env, (f"OTEL_EXPORTER_OTLP_{up}_HEADERS", "OTEL_EXPORTER_OTLP_HEADERS"))
        hdrs.update(headers or {})
        comp = compression or _env_choice(
            env, (f"OTEL_EXPORTER_OTLP_{up}_COMPRESSION", "OTEL_EXPORTER_OTLP_COMPRESSION"), ("gzip", "none"), warned
        )
        lowered = {k.lower(): v for k, v in hdrs.items()}
        return SignalTarget(url, proto, lowered, comp if comp == "gzip" else None, insecure)

    attrs = parse_resource_attributes(env.get("OTEL_RESOURCE_ATTRIBUTES", ""))
    attrs.update(resource_attributes or {})
    name = service_name or env.get("OTEL_SERVICE_NAME", "").strip() or attrs.pop("service.name", "") or "dtwatch"
    attrs.pop("service.name", None)
    resolved_timeout = timeout or _env_timeout(env, ("OTEL_EXPORTER_OTLP_TIMEOUT",)) or DEFAULT_TIMEOUT
    return OtlpConfig(
        traces=target("traces", traces_endpoint), metrics=target("metrics", metrics_endpoint),
        timeout=float(resolved_timeout), service_name=name, resource_attributes=attrs,
    )


def _signal_url(base: str, signal: Signal, protocol: str) -> str:
    if protocol == "grpc":
        return base
    return base.rstrip("/") + "/" + SIGNAL_PATHS[signal]


def otlp_configured(endpoint: str | None = None, environ: Mapping[str, str] | None = None) -> bool:
    """True when OTLP export should run: an endpoint is given or set, and the SDK is not disabled."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return bool(endpoint) or any(
        env.get(f"OTEL_EXPORTER_OTLP{s}_ENDPOINT", "").strip() for s in ("", "_TRACES", "_METRICS")
    )


def make_span_exporter(target: SignalTarget, timeout: float) -> SpanExporter:
    """The SDK's OTLP span exporter, configured entirely from ``target`` (no environment lookups)."""
    if target.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpans

        return GrpcSpans(
            endpoint=target.endpoint, insecure=target.insecure, headers=dict(target.headers) or None,
            timeout=timeout, compression=_grpc_compression(target),
        )
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpans

    return HttpSpans(
        endpoint=target.endpoint, headers=dict(target.headers), timeout=timeout, compression=_http_compression(target),
    )


def make_metric_exporter(target: SignalTarget, timeout: float) -> MetricExporter:
    """The SDK's OTLP metric exporter, configured entirely from ``target`` (no environment lookups)."""
    if target.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as GrpcMetrics

        return GrpcMetrics(
            endpoint=target.endpoint, insecure=target.insecure, headers=dict(target.headers) or None,
            timeout=timeout, compression=_grpc_compression(target),
        )
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HttpMetrics

    return HttpMetrics(
        endpoint=target.endpoint, headers=dict(target.headers), timeout=timeout, compression=_http_compression(target),
    )


def _grpc_compression(target: SignalTarget) -> grpc.Compression:
    import grpc

    return grpc.Compression.Gzip if target.compression == "gzip" else grpc.Compression.NoCompression


def _http_compression(target: SignalTarget) -> Compression:
    from opentelemetry.exporter.otlp.proto.http import Compression

    return Compression.Gzip if target.compression == "gzip" else Compression.NoCompression
