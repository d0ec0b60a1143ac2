"""The dtwatch dashboards' PromQL, ready to run against a real Prometheus.

``dashboards_queries(job_id)`` yields every panel target of every dashboard in ``dashboards/`` as
(dashboard uid, panel title, expr) with Grafana's variables substituted the way Grafana would for
that job (``$node`` and ``$rank`` as "All", i.e. ``.*``). An end-to-end test runs each expr against a
Prometheus that scraped a real run and expects data, except for the panels listed in
``dashboards/expected_empty_when_healthy.json`` (``expected_empty_when_healthy()``), which may be
empty on a healthy job (no stall open, no finding yet, no GPU, no DataLoader)::

    for dashboard, panel, expr in dashboards_queries("my-job", rate_interval="30s"):
        result = prometheus_query(expr)
        if (dashboard, panel) not in expected_empty_when_healthy():
            assert result, f"{dashboard} / {panel}: no data for {expr}"

It also parses the metric contract, the table in ``docs/metrics.md`` (``metric_contract()``).
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parent.parent
DASHBOARD_DIR = REPO / "dashboards"
EXPECTED_EMPTY_FILE = DASHBOARD_DIR / "expected_empty_when_healthy.json"
METRICS_DOC = REPO / "docs" / "metrics.md"

# $var, ${var}, ${var:format}, [[var]], [[var:format]] (Grafana's variable syntaxes).
_VARIABLE = re.compile(r"\$(?P<plain>\w+)|\$\{(?P<braced>\w+)(?::[^}]*)?\}|\[\[(?P<bracket>\w+)(?::[^\]]*)?\]\]")


class DashboardQuery(NamedTuple):
    dashboard: str  # the dashboard's uid
    panel: str  # the panel's title
    expr: str  # PromQL with every variable substituted


def dashboard_paths(directory: Path = DASHBOARD_DIR) -> list[Path]:
    """The Grafana dashboard JSON files in ``directory`` (objects with a ``schemaVersion``)."""
    paths = []
    for path in sorted(directory.glob("*.json")):
        data = json.loads(path.read_text())
        if isinstance(data, dict) and "schemaVersion" in data:
            paths.append(path)
    return paths


def load_dashboards(directory: Path = DASHBOARD_DIR) -> dict[str, dict]:
    """Every dashboard in ``directory`` by uid."""
    dashboards = {}
    for path in dashboard_paths(directory):
        data = json.loads(path.read_text())
        dashboards[data["uid"]] = data
    return dashboards


def iter_panels(dashboard: dict) -> Iterator[dict]:
    """Every panel, including those inside collapsed rows, and the rows themselves, in order."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", []) if panel.get("type") == "row" else ()


def substitute(
    text: str,
    job_id: str,
    node: str = ".*",
    rank: str = ".*",
    rate_interval: str = "1m",
    interval: str = "15s",
    range_: str = "1h",
    datasource: str = "prometheus",
) -> str:
    """``text`` with Grafana's variables replaced; an unknown variable raises ``KeyError``.

    Values go in verbatim, as Grafana interpolates a single-valued variable into ``=~"..."``;
    ``node``/``rank`` default to the "All" value of those variables, ``.*``.
    """
    values = {
        "job_id": job_id, "node": node, "rank": rank, "datasource": datasource,
        "__rate_interval": rate_interval, "__interval": interval, "__range": range_,
    }

    def replace(match: re.Match[str]) -> str:
        name = match["plain"] or match["braced"] or match["bracket"]
        if name not in values:
            raise KeyError(f"unknown Grafana variable {name!r} in {text!r}")
        return values[name]

    return _VARIABLE.sub(replace, text)


def dashboards_queries(job_id: str, directory: Path = DASHBOARD_DIR, **variables: str) -> Iterator[DashboardQuery]:
    """(dashboard uid, panel title, expr) for every target of every panel, variables substituted.

    ``variables`` are passed to :func:`substitute` (``node``, ``rank``, ``rate_interval``,
    ``interval``, ``range_``).
    """
    for uid, dashboard in load_dashboards(directory).items():
        for panel in iter_panels(dashboard):
            for target in panel.get("targets", []):
                if target.get("expr"):
                    yield DashboardQuery(uid, panel["title"], substitute(target["expr"], job_id, **variables))


def expected_empty_when_healthy(path: Path = EXPECTED_EMPTY_FILE) -> set[tuple[str, str]]:
    """(dashboard uid, panel title) of the panels that may show no data on a healthy job."""
    return {(entry["dashboard"], entry["panel"]) for entry in json.loads(path.read_text())}


@dataclass(frozen=True)
class Metric:
    name: str
    type: str  # counter, gauge, histogram
    labels: frozenset[str]


def metric_contract(path: Path = METRICS_DOC) -> dict[str, Metric]:
    """The metric table of ``docs/metrics.md``, keyed by every series name a scrape can hold.

    A histogram ``x`` contributes ``x_bucket`` (with the ``le`` label), ``x_sum`` and ``x_count``.
    """
    row = re.compile(r"^\|\s*`(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)`\s*\|\s*(?P<type>[^|]+?)\s*\|(?P<labels>[^|]*)\|")
    contract: dict[str, Metric] = {}
    for line in path.read_text().splitlines():
        match = row.match(line)
        if not match:
            continue
        kind = match["type"].split()[0]
        labels = frozenset(label.strip() for label in match["labels"].split(",") if label.strip())
        if kind == "histogram":
            contract[match["name"] + "_bucket"] = Metric(match["name"] + "_bucket", kind, labels | {"le"})
            contract[match["name"] + "_sum"] = Metric(match["name"] + "_sum", kind, labels)
            contract[match["name"] + "_count"] = Metric(match["name"] + "_count", kind, labels)
        else:
            contract[match["name"]] = Metric(match["name"], kind, labels)
    return contract
