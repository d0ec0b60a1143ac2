"""Real OTLP receivers for tests: gRPC (the collector's services from opentelemetry-proto) and HTTP.

Both listen on 127.0.0.1 with a free port, decode what they receive into the protobuf request
messages and keep them, with the request headers/metadata::

    with GrpcReceiver() as rx:                      # or HttpReceiver()
        exporter = OtelExporter(endpoint=rx.endpoint, protocol=rx.protocol)
        ...
        rx.wait_for(lambda: rx.spans())             # decoded spans with their resource attributes
"""
from __future__ import annotations

import gzip
import threading
import time
import zlib
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


def any_value(v: AnyValue) -> Any:
    """The Python value of an OTLP AnyValue."""
    kind = v.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [any_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return attributes(v.kvlist_value.values)
    return getattr(v, kind)


def attributes(kvs: Any) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in kvs}


@dataclass
class ReceivedSpan:
    """One span as received, flattened with its resource."""

    name: str
    trace_id: bytes
    span_id: bytes
    parent_span_id: bytes
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    resource: dict[str, Any]
    status_code: int
    scope: str


@dataclass
class ReceivedPoint:
    """One metric data point as received: kind is gauge, sum or histogram."""

    name: str
    kind: str
    attributes: dict[str, Any]
    value: float | None
    resource: dict[str, Any]
    monotonic: bool = False
    bucket_counts: list[int] | None = None
    explicit_bounds: list[float] | None = None
    count: int | None = None
    sum: float | None = None
    unit: str = ""


class _Store:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.trace_requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.metric_requests: list[metrics_service_pb2.ExportMetricsServiceRequest] = []
        self.headers: list[dict[str, str]] = []

    def spans(self) -> list[ReceivedSpan]:
        with self.lock:
            requests = list(self.trace_requests)
        out = []
        for req in requests:
            for rs in req.resource_spans:
                res = attributes(rs.resource.attributes)
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        out.append(ReceivedSpan(
                            s.name, s.trace_id, s.span_id, s.parent_span_id, s.start_time_unix_nano,
                            s.end_time_unix_nano, attributes(s.attributes), res, s.status.code, ss.scope.name,
                        ))
        return out

    def points(self) -> list[ReceivedPoint]:
        with self.lock:
            requests = list(self.metric_requests)
        out = []
        for req in requests:
            for rm in req.resource_metrics:
                res = attributes(rm.resource.attributes)
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        kind = m.WhichOneof("data")
                        if kind in ("gauge", "sum"):
                            data = getattr(m, kind)
                            for p in data.data_points:
                                value = p.as_double if p.WhichOneof("value") == "as_double" else float(p.as_int)
                                out.append(ReceivedPoint(m.name, kind, attributes(p.attributes), value, res,
                                                         monotonic=kind == "sum" and data.is_monotonic, unit=m.unit))
                        elif kind == "histogram":
                            for p in m.histogram.data_points:
                                out.append(ReceivedPoint(
                                    m.name, kind, attributes(p.attributes), None, res,
                                    bucket_counts=list(p.bucket_counts), explicit_bounds=list(p.explicit_bounds),
                                    count=p.count, sum=p.sum, unit=m.unit,
                                ))
        return out

    def latest(self, name: str) -> dict[tuple, ReceivedPoint]:
        """The newest point of metric ``name`` per attribute set."""
        return {tuple(sorted(p.attributes.items())): p for p in self.points() if p.name == name}

    def wait_for(self, predicate: Callable[[], Any], timeout: float = 20.0) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            result = predicate()
            if result:
                return result
            time.sleep(0.05)
        raise TimeoutError("the receiver did not get the expected data in time")


class GrpcReceiver(_Store):
    """An OTLP/gRPC receiver (TraceService + MetricsService) on 127.0.0.1:<free port>."""

    protocol = "grpc"

    def __init__(self) -> None:
        super().__init__()
        store = self

        class Traces(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC naming
                with store.lock:
                    store.trace_requests.append(request)
                    store.headers.append(dict(context.invocation_metadata()))
                return trace_service_pb2.ExportTraceServiceResponse()

        class Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:  # noqa: N802
                with store.lock:
                    store.metric_requests.append(request)
                    store.headers.append(dict(context.invocation_metadata()))
                return metrics_service_pb2.ExportMetricsServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), self.server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Metrics(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.server.stop(grace=0).wait(5)

    def __enter__(self) -> GrpcReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class HttpReceiver(_Store):
    """An OTLP/HTTP receiver (POST /v1/traces, /v1/metrics; protobuf; gzip/deflate aware)."""

    protocol = "http/protobuf"

    def __init__(self) -> None:
        super().__init__()
        store = self
        self.encodings: list[str] = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                encoding = self.headers.get("Content-Encoding", "")
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                if self.path == "/v1/traces":
                    req: Any = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
                    reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                elif self.path == "/v1/metrics":
                    req = metrics_service_pb2.ExportMetricsServiceRequest.FromString(body)
                    reply = metrics_service_pb2.ExportMetricsServiceResponse().SerializeToString()
                else:
                    self.send_error(404)
                    return
                with store.lock:
                    (store.trace_requests if self.path == "/v1/traces" else store.metric_requests).append(req)
                    store.headers.append({k.lower(): v for k, v in self.headers.items()})
                    store.encodings.append(encoding)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)

    def __enter__(self) -> HttpReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["GrpcReceiver", "HttpReceiver", "ReceivedPoint", "ReceivedSpan", "any_value", "attributes"]
