"""Who exports: the OpenTelemetry resource and instrumentation scope dtwatch's providers carry."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.version import __version__ as sdk_version

from dtwatch.export.otel.otel_config import OtlpConfig

SCOPE = "dtwatch"  # instrumentation scope of every tracer and meter


def dtwatch_version() -> str:
    from dtwatch.version import __version__

    return __version__


def make_resource(config: OtlpConfig, job_id: str, node: str, extra: Mapping[str, Any]) -> Resource:
    """The SDK's telemetry attributes, then ``OTEL_RESOURCE_ATTRIBUTES``, then dtwatch's own, then ``extra``."""
    attrs: dict[str, Any] = {
        "telemetry.sdk.language": "python", "telemetry.sdk.name": "opentelemetry",
        "telemetry.sdk.version": sdk_version,
    }
    attrs.update(config.resource_attributes)
    attrs.update({
        "service.name": config.service_name, "service.version": dtwatch_version(),
        "dtwatch.job_id": job_id, "host.name": node, "dtwatch.node": node,
    })
    attrs.update(extra)
    return Resource(attrs)
