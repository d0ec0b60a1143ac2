"""A real hang reaches a person: watchdog → Prometheus → Alertmanager → webhook, naming the rank.

A real 2-rank torchrun job hangs on a rank-conditional collective (tests/scripts/hang_worker.py
``rank_conditional``: rank 0 is in ``all_reduce`` inside ``validate``, rank 1 waits in ``barrier``).
A real watchdog serves /metrics; a real ``prometheus`` scrapes it every second and evaluates
dashboards/dtwatch.rules.yaml; a real ``prometheus-alertmanager`` routes the alerts to an HTTP server
in this test. The notifications must say which rank is stalled and which one is the culprit.
"""
from __future__ import annotations

import re
import socket
from pathlib import Path

import yaml

from tests.harness import launch
from tests.prom_servers import Alertmanager, Prometheus, WebhookReceiver, until, watchdog_metrics_target
from tests.tools import require_tool

RULES = Path(__file__).resolve().parent.parent / "dashboards" / "dtwatch.rules.yaml"
FOR_LINE = re.compile(r"^(\s+)for:\s*\S+\s*$", re.MULTILINE)


def rules_with_short_for(dest: Path, duration: str = "2s") -> Path:
    """A copy of the real rules file in which ONLY every alert's ``for:`` is shortened to ``duration``.

    The real durations (1m, 2m, 10m) would make this test take minutes; every expression, label and
    annotation stays exactly as shipped, which the comparison below checks.
    """
    text = RULES.read_text()
    shortened, n = FOR_LINE.subn(rf"\1for: {duration}", text)
    original, copy = yaml.safe_load(text), yaml.safe_load(shortened)
    alerts = [r for g in original["groups"] for r in g["rules"] if "for" in r]
    assert n == len(alerts) > 0, f"replaced {n} `for:` lines for {len(alerts)} alerts with a `for`"
    for group in copy["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                assert rule["for"] == duration
                rule.pop("for")
    for group in original["groups"]:
        for rule in group["rules"]:
            rule.pop("for", None)
    assert copy == original, "the copy differs from dashboards/dtwatch.rules.yaml in more than `for:`"
    dest.write_text(shortened)
    return dest


def test_a_real_hang_reaches_the_webhook_naming_the_culprit_rank(tmp_path: Path) -> None:
    prometheus_bin = require_tool("prometheus", "prometheus.sh")
    alertmanager_bin = require_tool("prometheus-alertmanager", "prometheus.sh")
    node = socket.gethostname()
    rules = rules_with_short_for(tmp_path / "dtwatch.rules.yaml")
    receiver = WebhookReceiver()
    alertmanager = prometheus = job = None
    try:
        alertmanager = Alertmanager(alertmanager_bin, tmp_path / "alertmanager", receiver.url)
        alertmanager.wait_ready()
        # --idle-exit 60: the watchdog keeps serving metrics while the rules are evaluated
        job = launch(tmp_path / "dtwatch", "rank_conditional", 2, window=4,
                     watch_args=["--metrics-addr", "127.0.0.1", "--metrics-port", "0", "--idle-exit", "60"])
        prometheus = Prometheus(prometheus_bin, tmp_path / "prometheus", [watchdog_metrics_target(job.run_dir)],
                                rule_files=[rules], alertmanager=alertmanager.address)
        prometheus.wait_target_up()
        groups = prometheus.wait_rules_loaded()
        loaded = {r["name"] for g in groups for r in g["rules"]}
        assert {"DtwatchRankStalled", "DtwatchNewIncident"} <= loaded, loaded

        def firing(name: str, **labels: str) -> dict | None:
            for alert in receiver.alerts():
                if alert["labels"].get("alertname") == name and alert["status"] == "firing" and \
                        all(alert["labels"].get(k) == v for k, v in labels.items()):
                    return alert
            return None

        try:
            until("DtwatchRankStalled for ranks 0 and 1 and DtwatchNewIncident at the webhook", lambda: (
                firing("DtwatchRankStalled", rank="0") and firing("DtwatchRankStalled", rank="1")
                and firing("DtwatchNewIncident")), timeout=90, interval=0.5)
        except TimeoutError as exc:
            raise AssertionError(
                f"{exc}\nreceived: {receiver.alerts()}\nwatchdog log:\n{job.watchdog_log()}\n"
                f"prometheus log:\n{prometheus.log_tail()}\nalertmanager log:\n{alertmanager.log_tail()}"
            ) from None

        # the watchdog's own diagnosis, to compare the alerts with
        index = job.wait_incident(30, complete=False)
        assert index["findings"][0]["ranks"] == [0], index["findings"][0]

        culprit = firing("DtwatchRankStalled", rank="0")
        assert culprit["labels"]["job_id"] == job.job_id
        assert culprit["labels"]["node"] == node and culprit["labels"]["local_rank"] == "0"
        assert culprit["labels"]["severity"] == "critical"
        summary, description = culprit["annotations"]["summary"], culprit["annotations"]["description"]
        assert summary == f"Rank 0 of job {job.job_id} is stalled and is the culprit.", summary
        assert description.startswith(f"Rank 0 (local rank 0 on node {node}) of job {job.job_id} is part of an open "
                                      "stall incident and has made no progress for "), description
        assert "The watchdog names this rank as the culprit: the other ranks are waiting for it." in description
        assert "It is waiting" not in description
        assert "dtwatch analyze" in description
        assert culprit["annotations"]["runbook_url"].endswith("docs/runbook.md#dtwatchrankstalled")

        waiting = firing("DtwatchRankStalled", rank="1")
        assert waiting["labels"]["job_id"] == job.job_id and waiting["labels"]["severity"] == "critical"
        assert waiting["annotations"]["summary"] == f"Rank 1 of job {job.job_id} is stalled.", waiting["annotations"]
        w_description = waiting["annotations"]["description"]
        assert f"It is waiting; the watchdog names rank 0 on {node} as the culprit." in w_description, w_description
        assert "names this rank as the culprit" not in w_description

        incident = firing("DtwatchNewIncident")
        assert incident["labels"]["job_id"] == job.job_id and incident["labels"]["node"] == node
        assert incident["labels"]["severity"] == "warning"
        assert f"opened 1 stall incident(s) for job {job.job_id}" in incident["annotations"]["description"], \
            incident["annotations"]

        # no false alarm about the same hang: the ranks are alive and at the same sequence number
        active = {a["labels"]["alertname"] for a in prometheus.alerts()}
        assert not active & {"DtwatchRankExited", "DtwatchCollectiveDesync", "DtwatchStraggler",
                             "DtwatchWatchdogDown", "DtwatchSilentDesync"}, active
    finally:
        if job is not None:
            job.stop()
        if prometheus is not None:
            prometheus.stop()
        if alertmanager is not None:
            alertmanager.stop()
        receiver.stop()
