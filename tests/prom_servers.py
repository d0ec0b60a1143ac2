"""Real Prometheus / Alertmanager servers for the end-to-end tests, and a webhook receiver.

Every server is started on 127.0.0.1 and a free port, with its data in a test's tmp directory; the
caller stops each (``.stop()``, by its PID) in a ``finally``. Used by tests/test_prometheus_e2e.py,
tests/test_alerting_e2e.py and tests/test_dashboards_live.py.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tests.harness import free_port


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def until(what: str, fn, timeout: float = 60.0, interval: float = 0.25):
    """Poll ``fn()`` until it returns something truthy (returned); ``TimeoutError`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = fn()
            if last:
                return last
        except OSError as exc:  # not listening yet
            last = exc
        time.sleep(interval)
    raise TimeoutError(f"{what}: still {last!r} after {timeout} s")


def stop(proc: subprocess.Popen | None, group: bool = False) -> None:
    """End ``proc`` (and with ``group``, its process group, which it leads): SIGTERM, then SIGKILL."""
    if proc is None or proc.poll() is not None:
        return
    try:
        if group:
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.terminate()
        proc.wait(timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        try:
            if group:
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.kill()
        except OSError:
            pass
        proc.wait(timeout=10)


def watchdog_metrics_target(run_dir: Path, node: str | None = None) -> str:
    """``host:port`` of the watchdog's /metrics, from ``<run dir>/watchdog-<node>.json`` (``--metrics-port 0``)."""
    info = json.loads((run_dir / f"watchdog-{node or socket.gethostname()}.json").read_text())
    if not info.get("url"):
        raise AssertionError(f"the watchdog serves no metrics: {info}")
    return urllib.parse.urlsplit(info["url"]).netloc


class Prometheus:
    """A real ``prometheus`` scraping ``targets`` every second as scrape job ``dtwatch``.

    ``rule_files`` are loaded and evaluated every second; alerts go to ``alertmanager`` (``host:port``);
    ``extra_args`` are added to the command line.
    """

    def __init__(self, binary: str, workdir: Path, targets: list[str], *, rule_files: list[Path] = (),
                 alertmanager: str | None = None, extra_args: list[str] = ()) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.api = f"http://127.0.0.1:{self.port}/api/v1"
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / "prometheus.log"
        lines = ["global:", "  scrape_interval: 1s", "  scrape_timeout: 1s", "  evaluation_interval: 1s"]
        if rule_files:
            lines += ["rule_files:"] + [f"  - {json.dumps(str(p))}" for p in rule_files]
        if alertmanager:
            lines += ["alerting:", "  alertmanagers:", "    - static_configs:",
                      f"        - targets: ['{alertmanager}']"]
        lines += ["scrape_configs:", "  - job_name: dtwatch", "    static_configs:",
                  f"      - targets: {json.dumps(targets)}"]
        self.config = workdir / "prometheus.yml"
        self.config.write_text("\n".join(lines) + "\n")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={self.config}", f"--storage.tsdb.path={workdir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", *extra_args],
            stdout=self.log.open("wb"), stderr=subprocess.STDOUT,
        )

    def wait_target_up(self, timeout: float = 60.0) -> None:
        def up() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited {self.proc.returncode}:\n{self.log_tail()}")
            targets = get_json(f"{self.api}/targets")["data"]["activeTargets"]
            return bool(targets) and all(t["health"] == "up" for t in targets)

        until("the scrape targets' health", up, timeout=timeout)

    def wait_rules_loaded(self, timeout: float = 30.0) -> list[dict]:
        return until("the rule groups", lambda: get_json(f"{self.api}/rules")["data"]["groups"], timeout=timeout)

    def _api(self, path: str, **params: str) -> dict:
        url = f"{self.api}/{path}?" + urllib.parse.urlencode(params)
        try:
            body = get_json(url)
        except urllib.error.HTTPError as exc:  # 400/422: a bad query; the body says why
            body = json.loads(exc.read() or b"{}")
            raise AssertionError(f"{path} {params}: HTTP {exc.code}: {body.get('error', body)}") from None
        if body.get("status") != "success":
            raise AssertionError(f"{path} {params}: {body}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        """``/api/v1/query``: the instant vector (or scalar, as one sample) of ``expr``."""
        params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
        data = self._api("query", **params)
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def query_range(self, expr: str, start: float, end: float, step: float = 1.0) -> list[dict]:
        """``/api/v1/query_range``: what a Grafana time-series panel shows over [start, end]."""
        return self._api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=str(step))["result"]

    def alerts(self) -> list[dict]:
        """``/api/v1/alerts``: the alerts pending or firing now."""
        return self._api("alerts")["alerts"]

    def log_tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def stop(self) -> None:
        stop(self.proc)


class Alertmanager:
    """A real ``prometheus-alertmanager`` (no clustering) routing every alert to ``webhook_url``.

    Groups by [alertname, job_id] (as dashboards/dtwatch.rules.yaml advises), waiting 1 s.
    """

    def __init__(self, binary: str, workdir: Path, webhook_url: str) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log = workdir / "alertmanager.log"
        self.config = workdir / "alertmanager.yml"
        self.config.write_text(
            "route:\n"
            "  receiver: test\n"
            "  group_by: [alertname, job_id]\n"
            "  group_wait: 1s\n"
            "  group_interval: 1s\n"
            "  repeat_interval: 1h\n"
            "receivers:\n"
            "  - name: test\n"
            "    webhook_configs:\n"
            f"      - url: {json.dumps(webhook_url)}\n"
            "        send_resolved: false\n"
        )
        cmd = [binary, f"--config.file={self.config}", f"--storage.path={workdir / 'data'}",
               f"--web.listen-address={self.address}", "--cluster.listen-address="]
        self.proc = subprocess.Popen(_with_debian_templates(binary, cmd), stdout=self.log.open("wb"),
                                     stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 30.0) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"alertmanager exited {self.proc.returncode}:\n{self.log_tail()}")
            with urllib.request.urlopen(f"http://{self.address}/-/ready", timeout=5) as r:
                return r.status == 200

        until("alertmanager /-/ready", ready, timeout=timeout)

    def alerts(self) -> list[dict]:
        return get_json(f"http://{self.address}/api/v2/alerts")

    def log_tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def stop(self) -> None:
        stop(self.proc)


DEBIAN_TEMPLATES = Path("/usr/share/prometheus/alertmanager")


def _with_debian_templates(binary: str, cmd: list[str]) -> list[str]:
    """``cmd``, run so that the Debian build of Alertmanager finds its templates.

    Debian's ``prometheus-alertmanager`` reads ``default.tmpl`` from the fixed path
    ``/usr/share/prometheus/alertmanager/`` and exits at start-up without it. .ci/tools/prometheus.sh
    unpacks the package under ``.tools/root`` instead of installing it, so the templates are at
    ``.tools/root/usr/share/prometheus/alertmanager/``: then the server runs in a private mount namespace
    (``unshare``; a user namespace too when not root) where that directory is overlaid onto
    ``/usr/share``. Nothing outside that namespace changes, and the process keeps its PID (``exec``).
    """
    if (DEBIAN_TEMPLATES / "default.tmpl").exists():
        return cmd
    share = Path(os.path.realpath(binary)).parent.parent / "share"
    if not (share / "prometheus" / "alertmanager" / "default.tmpl").exists():
        return cmd  # not the Debian layout: let the server say what it misses
    unshare = ["unshare", "--mount"] if os.geteuid() == 0 else ["unshare", "--user", "--map-root-user", "--mount"]
    script = 'mount -t overlay overlay -o "lowerdir=$0:/usr/share" /usr/share && exec "$@"'
    return [*unshare, "--", "sh", "-c", script, str(share), *cmd]


class WebhookReceiver:
    """A local HTTP server (in a thread) that keeps every JSON body POSTed to it."""

    def __init__(self) -> None:
        self.payloads: list[dict] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with receiver._lock:
                    receiver.payloads.append(json.loads(body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/alerts"
        self.thread = threading.Thread(target=self.server.serve_forever, name="webhook-receiver", daemon=True)
        self.thread.start()

    def alerts(self) -> list[dict]:
        """Every alert of every notification received so far."""
        with self._lock:
            return [a for p in self.payloads for a in p.get("alerts", [])]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
