"""The watchdog's HTTP endpoint: ``/metrics`` (a Prometheus registry), ``/healthz`` and ``/readyz``."""
from __future__ import annotations

import errno as errno_mod
import gzip
import json
import logging
import os
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import CollectorRegistry

log = logging.getLogger("dtwatch.export.prometheus")


class MetricsBindError(OSError):
    """The metrics server could not listen on the address asked for (port taken, bad address...).

    ``errno`` is the socket error's (``errno.EADDRINUSE`` for a taken port). The watchdog catches it,
    logs its message once as a warning, and runs on without ``/metrics``.
    """


class MetricsServer:
    """Serves ``/metrics`` (a registry), ``/healthz`` and ``/readyz`` from a daemon thread.

    ``/healthz`` answers 200 while ``health_fn()`` returns True (503 otherwise, or when it raises);
    ``/readyz`` answers 200 once ``ready`` is True. Port 0 picks a free port; ``.port`` and ``.url``
    say which. With ``url_file``, ``{"url", "addr", "port", "pid", "node"}`` is written there as
    JSON (atomically) and removed again by :meth:`close`::

        server = MetricsServer(exporter.registry, addr="127.0.0.1", port=0, url_file="watchdog-n1.json")
        print(server.url)           # http://127.0.0.1:43817/metrics
        server.ready = True
        ...
        server.close()

    A port that cannot be bound raises :class:`MetricsBindError` (an ``OSError``) from the constructor;
    a port outside 0..65535 raises ``ValueError``. A URL file that cannot be written is one warning.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        addr: str = "0.0.0.0",
        port: int = 9464,
        health_fn: Callable[[], bool] | None = None,
        url_file: str | os.PathLike | None = None,
        node: str = "",
    ) -> None:
        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
            raise ValueError(f"metrics port must be an integer from 0 to 65535, got {port!r}")
        self.registry = registry
        self.health_fn = health_fn or (lambda: True)
        self._ready = threading.Event()
        self.node = node or socket.gethostname()
        self.url_file = os.fspath(url_file) if url_file is not None else None
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        server_cls = type("_Server", (ThreadingHTTPServer,), {"address_family": family, "daemon_threads": True})
        try:
            httpd = server_cls((addr, port), _make_handler(self))
        except OSError as exc:
            hint = ""
            if exc.errno == errno_mod.EADDRINUSE:
                hint = " (another watchdog or exporter uses it; pick another --metrics-port, or 0 for any free port)"
            raise MetricsBindError(
                exc.errno or 0, f"dtwatch: cannot serve metrics on {addr}:{port}: {exc.strerror or exc}{hint}"
            ) from exc
        self._httpd: ThreadingHTTPServer | None = httpd
        self.addr = addr
        self.port = int(httpd.server_address[1])
        host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(addr, addr)
        self.base_url = f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"
        self.url = self.base_url + "/metrics"
        self._scrape_failed = False
        self._thread = threading.Thread(target=httpd.serve_forever, args=(0.1,), name="dtwatch-metrics", daemon=True)
        self._thread.start()
        if self.url_file is not None:
            try:
                self._write_url_file()
            except OSError as exc:
                log.warning("dtwatch: serving metrics on %s but cannot write %s: %s", self.url, self.url_file, exc)

    def _write_url_file(self) -> None:
        assert self.url_file is not None
        info = {"url": self.url, "addr": self.addr, "port": self.port, "pid": os.getpid(), "node": self.node}
        directory = os.path.dirname(os.path.abspath(self.url_file))
        os.makedirs(directory, exist_ok=True)
        tmp = f"{self.url_file}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(info, f)
            f.write("\n")
        os.replace(tmp, self.url_file)

    def close(self) -> None:
        """Stop serving, free the port, and remove the URL file if it is still this server's."""
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        httpd.shutdown()
        httpd.server_close()
        self._thread.join(timeout=5)
        if self.url_file is not None:
            try:
                with open(self.url_file) as f:
                    info = json.load(f)
                if info.get("pid") == os.getpid() and info.get("port") == self.port:
                    os.unlink(self.url_file)
            except (OSError, ValueError):
                pass

    @property
    def ready(self) -> bool:
        """Whether ``/readyz`` answers 200; the watchdog sets it True once its services run."""
        return self._ready.is_set()

    @ready.setter
    def ready(self, value: bool) -> None:
        if value:
            self._ready.set()
        else:
            self._ready.clear()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- request handling (called from the server's threads) ----------------------------------------
    def _metrics(self, query: str, accept: str, accept_encoding: str) -> tuple[int, dict[str, str], bytes]:
        registry: Any = self.registry
        names = parse_qs(query).get("name[]")
        if names:
            registry = registry.restricted_registry(names)
        try:
            encoder, content_type = choose_encoder(accept)
            body = encoder(registry)
        except Exception as exc:
            if not self._scrape_failed:
                self._scrape_failed = True
                log.warning("dtwatch: rendering /metrics failed: %r (further failures are logged at debug)", exc)
            log.debug("dtwatch: rendering /metrics failed", exc_info=True)
            return 500, {"Content-Type": "text/plain; charset=utf-8"}, f"error rendering metrics: {exc!r}\n".encode()
        headers = {"Content-Type": content_type}
        if "gzip" in accept_encoding:
            body = gzip.compress(body)
            headers["Content-Encoding"] = "gzip"
        return 200, headers, body

    def _health(self) -> tuple[int, bytes]:
        try:
            ok = bool(self.health_fn())
        except Exception as exc:  # noqa: BLE001
            return 503, f"unhealthy: health check raised {exc!r}\n".encode()
        return (200, b"ok\n") if ok else (503, b"unhealthy\n")


def _make_handler(server: MetricsServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "dtwatch"

        def do_GET(self) -> None:
            parts = urlsplit(self.path)
            text = {"Content-Type": "text/plain; charset=utf-8"}
            if parts.path == "/metrics":
                status, headers, body = server._metrics(
                    parts.query, self.headers.get("Accept", ""), self.headers.get("Accept-Encoding", "")
                )
            elif parts.path == "/healthz":
                status, body = server._health()
                headers = text
            elif parts.path == "/readyz":
                status, body = (200, b"ready\n") if server.ready else (503, b"not ready\n")
                headers = text
            elif parts.path == "/":
                status, headers = 200, text
                body = b"dtwatch watchdog: /metrics /healthz /readyz\n"
            else:
                status, headers, body = 404, text, b"not found: try /metrics /healthz /readyz\n"
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
            log.debug("metrics server: " + format, *args)

    return Handler


__all__ = ["MetricsBindError", "MetricsServer"]
