"""The observability content: Grafana dashboards, Prometheus rules and their runbook.

Dashboards are type-checked against Grafana 11.6's own TypeScript types (``tsc`` +
``@grafana/schema``, installed by ``.ci/tools/grafana-schema.sh``); every query is parsed as PromQL
and checked against the metric contract in ``docs/metrics.md``; the rules go through
``promtool check rules`` and their unit tests through ``promtool test rules``.
"""
from __future__ import annotations

import copy
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import promql_parser
import pytest
import yaml

from tests.dashboard_queries import (
    EXPECTED_EMPTY_FILE,
    dashboard_paths,
    dashboards_queries,
    expected_empty_when_healthy,
    iter_panels,
    load_dashboards,
    metric_contract,
    substitute,
)
from tests.tools import ON_CI, REPO, TOOLS_DIR, require_tool

_spec = importlib.util.spec_from_file_location("check_schema", REPO / "dashboards" / "check_schema.py")
assert _spec and _spec.loader
check_schema = importlib.util.module_from_spec(_spec)
sys.modules["check_schema"] = check_schema  # dataclasses resolve their module by name
_spec.loader.exec_module(check_schema)

RULES = REPO / "dashboards" / "dtwatch.rules.yaml"
RULES_TEST = REPO / "dashboards" / "tests" / "rules_test.yaml"
RUNBOOK = REPO / "docs" / "runbook.md"
RUNBOOK_URL = "https://github.com/dtwatch/dtwatch/blob/main/docs/runbook.md#"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
UIDS = {"dtwatch-overview", "dtwatch-drift"}
# Labels every scraped series has besides its own.
SCRAPE_LABELS = {"job", "instance"}
# Series that are not dtwatch's but that the rules may use: Prometheus's own scrape health.
PROMETHEUS_SERIES = {"up": frozenset(SCRAPE_LABELS)}
# Sentinels substituted for the variables, to see which selectors use them.
JOB, NODE, RANK = "JOBSENTINEL", "NODESENTINEL", "RANKSENTINEL"

DASHBOARDS = load_dashboards()
CONTRACT = metric_contract()
RULE_GROUPS = yaml.safe_load(RULES.read_text())["groups"]
ALERTS = [rule for group in RULE_GROUPS for rule in group["rules"] if "alert" in rule]
RECORDS = {rule["record"] for group in RULE_GROUPS for rule in group["rules"] if "record" in rule}


def panels(dashboard: dict) -> list[dict]:
    """The panels of ``dashboard`` that show data (rows excluded)."""
    return [p for p in iter_panels(dashboard) if p.get("type") != "row"]


def all_targets() -> list[tuple[str, str, str, str]]:
    """(uid, panel title, refId, raw expr) of every target."""
    return [(uid, p["title"], t.get("refId", "?"), t.get("expr", ""))
            for uid, d in DASHBOARDS.items() for p in panels(d) for t in p.get("targets", [])]


TARGETS = all_targets()


def query_annotations(dashboard: dict) -> list[dict]:
    """The dashboard's annotations that run a Prometheus query (the built-in Grafana one excluded)."""
    return [a for a in dashboard["annotations"]["list"] if a.get("datasource", {}).get("type") == "prometheus"]


ANNOTATIONS = [(uid, a["name"], a["target"]["expr"]) for uid, d in DASHBOARDS.items() for a in query_annotations(d)]
TARGET_IDS = [f"{uid}/{title}/{ref}" for uid, title, ref, _ in TARGETS]


def selectors(expr: str | promql_parser.Expr) -> list[promql_parser.VectorSelector]:
    """The series selectors of ``expr`` (a PromQL string or a parsed node), leftmost first."""
    found: list[promql_parser.VectorSelector] = []

    def visit(node: object) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            found.append(node)

    promql_parser.walk(promql_parser.parse(expr) if isinstance(expr, str) else expr, visit)
    return found


def metric_name(selector: promql_parser.VectorSelector) -> str | None:
    if selector.name:
        return selector.name
    return next((m.value for m in selector.matchers.matchers if m.name == "__name__"), None)


def matchers(selector: promql_parser.VectorSelector) -> dict[str, str]:
    return {m.name: m.value for m in selector.matchers.matchers if m.name != "__name__"}


def known_labels(name: str) -> frozenset[str]:
    if name in CONTRACT:
        return CONTRACT[name].labels | SCRAPE_LABELS
    return PROMETHEUS_SERIES[name]


def label_values_selector(query: str) -> str:
    """The series selector inside a ``label_values(selector, label)`` variable query."""
    match = re.fullmatch(r"label_values\((?P<selector>.+),\s*(?P<label>\w+)\)", query.strip())
    assert match, f"not a label_values(selector, label) query: {query!r}"
    return match["selector"]


def rule_exprs() -> list[tuple[str, str]]:
    return [(rule.get("alert") or rule["record"], rule["expr"])
            for group in RULE_GROUPS for rule in group["rules"]]


def dashboard_exprs() -> list[tuple[str, str]]:
    """(where, expr with variables substituted) for every panel target and variable query."""
    exprs = [(f"{uid}/{title}/{ref}", substitute(expr, JOB, node=NODE, rank=RANK))
             for uid, title, ref, expr in TARGETS]
    for uid, dashboard in DASHBOARDS.items():
        for var in dashboard["templating"]["list"]:
            if var["type"] == "query":
                exprs.append((f"{uid}/${var['name']}",
                              substitute(label_values_selector(var["query"]), JOB, node=NODE, rank=RANK)))
    exprs += [(f"{uid}/annotation {name}", substitute(expr, JOB, node=NODE, rank=RANK))
              for uid, name, expr in ANNOTATIONS]
    return exprs


# --- files, uids, layout ------------------------------------------------------------------------

def test_the_two_dashboards_exist_with_fixed_uids_matching_their_file_names() -> None:
    assert set(DASHBOARDS) == UIDS
    for path in dashboard_paths():
        assert json.loads(path.read_text())["uid"] == path.stem
    for dashboard in DASHBOARDS.values():
        assert dashboard["schemaVersion"] == 41, "Grafana 11.6 writes schemaVersion 41"
        assert "dtwatch" in dashboard["tags"]
        assert dashboard["title"].startswith("dtwatch / ")
        assert dashboard.get("id") is None, "an exported id makes provisioning collide"


def test_panel_ids_are_unique_and_titles_unique_within_each_dashboard() -> None:
    for uid, dashboard in DASHBOARDS.items():
        ids = [p["id"] for p in iter_panels(dashboard)]
        assert len(ids) == len(set(ids)), f"{uid}: duplicate panel ids"
        titles = [p["title"] for p in panels(dashboard)]
        assert len(titles) == len(set(titles)), f"{uid}: duplicate panel titles {titles}"


def test_overview_row_is_open_and_detail_rows_are_collapsed() -> None:
    for uid, dashboard in DASHBOARDS.items():
        top = dashboard["panels"]
        rows = [p for p in top if p["type"] == "row"]
        assert top[0]["type"] == "row" and top[0]["collapsed"] is False and top[0]["panels"] == [], uid
        assert len(rows) >= 3, f"{uid}: expected an overview row and detail rows"
        # The open row's panels follow it at the top level, up to the first collapsed row.
        first_collapsed = top.index(rows[1])
        assert all(p["type"] != "row" for p in top[1:first_collapsed]) and first_collapsed > 1, uid
        for detail in rows[1:]:
            assert detail["collapsed"] is True, f"{uid}: row {detail['title']!r} should be collapsed"
            assert detail["panels"], f"{uid}: collapsed row {detail['title']!r} is empty"
        assert all(p["type"] == "row" for p in top[first_collapsed:]), \
            f"{uid}: panels after the collapsed rows would be outside any row"


def _overlaps(a: dict, b: dict) -> bool:
    return (a["x"] < b["x"] + b["w"] and b["x"] < a["x"] + a["w"]
            and a["y"] < b["y"] + b["h"] and b["y"] < a["y"] + a["h"])


def test_panels_fit_the_grid_without_overlapping() -> None:
    for uid, dashboard in DASHBOARDS.items():
        groups = [[p for p in dashboard["panels"]]]  # as laid out with every row collapsed
        groups += [[row] + row["panels"] for row in dashboard["panels"] if row["type"] == "row" and row["panels"]]
        for group in groups:
            boxes = [(p["title"], p["gridPos"]) for p in group]
            for title, box in boxes:
                assert box["x"] >= 0 and box["w"] > 0 and box["x"] + box["w"] <= 24, f"{uid}/{title}: {box}"
            for i, (t1, b1) in enumerate(boxes):
                for t2, b2 in boxes[i + 1:]:
                    assert not _overlaps(b1, b2), f"{uid}: {t1!r} {b1} overlaps {t2!r} {b2}"


# --- panels: unit, description, datasource ------------------------------------------------------

@pytest.mark.parametrize("uid", sorted(UIDS))
def test_every_panel_has_unit_description_and_uses_the_datasource_variable(uid: str) -> None:
    dashboard = DASHBOARDS[uid]
    for panel in panels(dashboard):
        where = f"{uid}/{panel['title']}"
        assert len(panel.get("description", "")) >= 40, f"{where}: description missing or too short"
        assert panel["fieldConfig"]["defaults"].get("unit"), f"{where}: no unit"
        assert panel.get("datasource") == DATASOURCE, f"{where}: panel datasource {panel.get('datasource')}"
        assert panel.get("targets"), f"{where}: no targets"
        for target in panel["targets"]:
            assert target.get("datasource") == DATASOURCE, f"{where}/{target.get('refId')}: target datasource"
            assert target.get("expr", "").strip(), f"{where}/{target.get('refId')}: empty expr"
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), f"{where}: duplicate refIds"


def test_variables_datasource_then_job_node_rank_chained() -> None:
    for uid, dashboard in DASHBOARDS.items():
        variables = dashboard["templating"]["list"]
        assert [v["name"] for v in variables] == ["datasource", "job_id", "node", "rank"], uid
        ds, job, node, rank = variables
        assert ds["type"] == "datasource" and ds["query"] == "prometheus"
        for var in (job, node, rank):
            assert var["type"] == "query" and var["datasource"] == DATASOURCE, f"{uid}/${var['name']}"
            assert var["refresh"] == 2, f"{uid}/${var['name']}: refresh on time range change"
        assert job["query"] == "label_values(dtwatch_watchdog_info, job_id)"
        assert node["query"] == 'label_values(dtwatch_rank_up{job_id=~"$job_id"}, node)'
        assert rank["query"] == 'label_values(dtwatch_rank_up{job_id=~"$job_id", node=~"$node"}, rank)'
        for var in (node, rank):
            assert var["multi"] is True and var["includeAll"] is True and var["allValue"] == ".*"


def test_dashboards_link_to_each_other_keeping_time_and_variables() -> None:
    for uid, other in (("dtwatch-overview", "dtwatch-drift"), ("dtwatch-drift", "dtwatch-overview")):
        links = DASHBOARDS[uid]["links"]
        direct = [link for link in links if link["type"] == "link" and link["url"] == f"/d/{other}"]
        assert direct, f"{uid} has no link to {other}"
        assert direct[0]["keepTime"] and direct[0]["includeVars"]
        assert any(link["type"] == "dashboards" and link["tags"] == ["dtwatch"] for link in links)
        data_links = [link["url"] for p in panels(DASHBOARDS[uid])
                      for link in p["fieldConfig"]["defaults"].get("links", [])]
        assert any(url.startswith(f"/d/{other}?") and "var-rank=${__field.labels.rank}" in url
                   for url in data_links), f"{uid}: no per-rank drill-down to {other}"


# --- Grafana schema -----------------------------------------------------------------------------

def schema_dir() -> Path:
    require_tool("tsc", "grafana-schema.sh")
    directory = TOOLS_DIR / "grafana-schema"
    if not (directory / "node_modules" / "@grafana" / "schema" / "package.json").exists():
        message = f"@grafana/schema not installed in {directory}: run .ci/tools/grafana-schema.sh"
        if ON_CI:
            pytest.fail(message)
        pytest.skip(message)
    return directory


def test_every_dashboard_type_checks_as_a_grafana_11_dashboard() -> None:
    paths = dashboard_paths()
    assert len(paths) == len(UIDS)
    errors = check_schema.check_dashboards(paths, schema_dir())
    assert errors == [], "\n".join(map(str, errors))


def _broken(dashboard: dict, how: str) -> dict:
    broken = copy.deepcopy(dashboard)
    first = broken["panels"][1]  # a stat panel of the open overview row
    nested = next(p for p in broken["panels"] if p["type"] == "row" and p["panels"])["panels"][0]
    if how == "gridpos-string":
        first["gridPos"] = "oops"
    elif how == "nested-gridpos-width-string":
        nested["gridPos"]["w"] = "12"
    elif how == "unknown-enum-value":
        first["fieldConfig"]["defaults"]["thresholds"]["mode"] = "absolutely"
    elif how == "misspelt-panel-option":
        first["options"]["textMod"] = first["options"].pop("textMode")
    elif how == "unknown-panel-type":
        nested["type"] = "timeserie"
    elif how == "missing-schema-version":
        del broken["schemaVersion"]
    elif how == "unknown-dashboard-field":
        broken["titel"] = broken.pop("title")
    elif how == "misspelt-annotation-field":
        annotation = query_annotations(broken)[0]
        annotation["titelFormat"] = annotation.pop("titleFormat")
    elif how == "annotation-without-expr":
        del query_annotations(broken)[0]["target"]["expr"]
    return broken


BROKEN = {
    "gridpos-string": '"gridPos": "oops"',
    "nested-gridpos-width-string": '"w": "12"',
    "unknown-enum-value": '"absolutely"',
    "misspelt-panel-option": "textMod",
    "unknown-panel-type": "timeserie",
    "missing-schema-version": "schemaVersion",
    "unknown-dashboard-field": "titel",
    "misspelt-annotation-field": "titelFormat",
    "annotation-without-expr": "'expr' is missing",
}


def test_schema_check_rejects_invalid_dashboards(tmp_path: Path) -> None:
    directory = schema_dir()
    original = DASHBOARDS["dtwatch-overview"]
    paths = []
    for how in BROKEN:
        path = tmp_path / f"{how}.json"
        path.write_text(json.dumps(_broken(original, how), indent=2))
        paths.append(path)
    valid = tmp_path / "valid.json"
    valid.write_text(json.dumps(original))
    errors = check_schema.check_dashboards([*paths, valid], directory)
    by_file: dict[str, list[str]] = {}
    for error in errors:
        by_file.setdefault(Path(error.dashboard).stem, []).append(str(error))
    for how, evidence in BROKEN.items():
        assert how in by_file, f"the schema check accepted a dashboard with {how}"
        assert any(evidence in e for e in by_file[how]), f"{how}: errors do not point at it: {by_file[how]}"
    assert "valid" not in by_file, by_file.get("valid")


def test_schema_check_cli_exit_codes(tmp_path: Path) -> None:
    directory = schema_dir()
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(_broken(DASHBOARDS["dtwatch-drift"], "gridpos-string")))
    script = REPO / "dashboards" / "check_schema.py"
    bad = subprocess.run([sys.executable, str(script), "--schema-dir", str(directory), str(broken)],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and "gridPos" in bad.stdout, bad.stdout + bad.stderr
    good = subprocess.run([sys.executable, str(script), "--schema-dir", str(directory)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert good.returncode == 0 and "2 dashboard(s) valid" in good.stdout, good.stdout + good.stderr


# --- PromQL -------------------------------------------------------------------------------------

@pytest.mark.parametrize(("uid", "title", "ref", "expr"), TARGETS, ids=TARGET_IDS)
def test_every_panel_query_parses_as_promql(uid: str, title: str, ref: str, expr: str) -> None:
    substituted = substitute(expr, "job-1")
    assert "$" not in substituted and "[[" not in substituted, substituted
    promql_parser.parse(substituted)  # raises on a syntax error


def test_substitution_handles_every_grafana_syntax_and_rejects_unknown_variables() -> None:
    expr = 'rate(x{job_id=~"$job_id", node=~"${node}", rank=~"${rank:regex}", a="[[job_id]]"}[$__rate_interval])'
    assert substitute(expr, "j", node="n", rank="3", rate_interval="2m") == \
        'rate(x{job_id=~"j", node=~"n", rank=~"3", a="j"}[2m])'
    with pytest.raises(KeyError, match="jobid"):
        substitute('x{job_id=~"$jobid"}', "j")


def test_ranges_use_rate_interval_or_the_dashboard_range() -> None:
    for uid, title, ref, expr in TARGETS:
        for window in re.findall(r"\[([^\]]*)\]", expr):
            assert window in ("$__rate_interval", "$__range"), f"{uid}/{title}/{ref}: [{window}]"
        if re.search(r"\b(rate|irate|increase)\(", expr):
            assert "$__rate_interval" in expr or "$__range" in expr, f"{uid}/{title}/{ref}"


@pytest.mark.parametrize(("uid", "title", "ref", "expr"), TARGETS, ids=TARGET_IDS)
def test_every_query_is_scoped_to_the_selected_job_and_ranks(uid: str, title: str, ref: str, expr: str) -> None:
    found = selectors(substitute(expr, JOB, node=NODE, rank=RANK))
    assert found, f"{title}: no series selector"
    for selector in found:
        assert matchers(selector).get("job_id") == JOB, f"{title}/{ref}: {selector} is not scoped by $job_id"
    # Every metric with a node (rank) label is filtered by $node ($rank) somewhere in the query;
    # the leader side of a "behind the leader" query deliberately spans all nodes and ranks.
    for label, sentinel in (("node", NODE), ("rank", RANK)):
        with_label = [s for s in found if label in CONTRACT[metric_name(s)].labels]
        if with_label:
            assert any(matchers(s).get(label) == sentinel for s in with_label), \
                f"{title}/{ref}: ignores ${label}"


def test_every_metric_in_dashboards_and_rules_is_in_the_metric_contract() -> None:
    assert len(CONTRACT) >= 30, "docs/metrics.md table not parsed"
    allowed = set(CONTRACT) | RECORDS | set(PROMETHEUS_SERIES)
    used: dict[str, str] = {}
    for where, expr in dashboard_exprs() + rule_exprs():
        for selector in selectors(expr):
            name = metric_name(selector)
            assert name, f"{where}: selector without a metric name: {selector}"
            used.setdefault(name, where)
    unknown = {name: where for name, where in used.items() if name not in allowed}
    assert not unknown, f"metrics not in docs/metrics.md: {unknown}"
    # Queries inside alert annotations (templates, not parseable as PromQL as they stand).
    for alert in ALERTS:
        for text in alert["annotations"].values():
            for name in re.findall(r"\b(dtwatch_[a-z_]+)\b", text):
                assert name in CONTRACT, f"{alert['alert']} annotation uses {name}, not in docs/metrics.md"


def test_label_matchers_and_groupings_exist_on_the_metrics() -> None:
    def check(where: str, expr: str) -> None:
        tree = promql_parser.parse(expr)

        def visit(node: object) -> None:
            if isinstance(node, promql_parser.VectorSelector) and metric_name(node) not in RECORDS:
                name = metric_name(node)
                extra = set(matchers(node)) - known_labels(name)
                assert not extra, f"{where}: {name} has no label(s) {sorted(extra)}"
            if isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None \
                    and node.modifier.type == promql_parser.AggModifierType.By:
                inner = [metric_name(s) for s in selectors(node.expr)]
                for name in inner:
                    missing = set(node.modifier.labels) - known_labels(name)
                    assert not missing, f"{where}: by ({', '.join(node.modifier.labels)}) over {name}: " \
                                        f"{name} has no {sorted(missing)}"

        promql_parser.walk(tree, visit)

    for where, expr in dashboard_exprs() + rule_exprs():
        check(where, expr)


def test_every_contract_metric_is_shown_on_some_dashboard() -> None:
    shown = {metric_name(s) for _, expr in dashboard_exprs() for s in selectors(expr)}
    histograms = {name.removesuffix("_bucket") for name, m in CONTRACT.items() if name.endswith("_bucket")}
    for name, metric in CONTRACT.items():
        if metric.type == "histogram":
            base = next(h for h in histograms if name.startswith(h))
            assert any(s.startswith(base) for s in shown), f"histogram {base} is on no dashboard"
        else:
            assert name in shown, f"{name} (docs/metrics.md) is on no dashboard"


def test_dashboards_queries_helper_yields_every_target_for_a_job() -> None:
    queries = list(dashboards_queries("job-42", rate_interval="30s"))
    assert len(queries) == len(TARGETS)
    for dashboard, panel, expr in queries:
        assert dashboard in UIDS and panel
        assert 'job_id=~"job-42"' in expr and "$" not in expr
        assert "[$__rate_interval]" not in expr
    assert any("[30s]" in q.expr for q in queries)


# --- annotations ----------------------------------------------------------------------------------

SILENT_DESYNC = {"kind": "desync|mismatch", "severity": "warning"}  # the alert's and the annotation's series


def test_both_dashboards_mark_silent_desyncs_with_the_alerts_series() -> None:
    alert = next(a for a in ALERTS if a["alert"] == "DtwatchSilentDesync")
    assert [matchers(s) for s in selectors(alert["expr"])] == [SILENT_DESYNC]
    for uid, dashboard in DASHBOARDS.items():
        annotations = {a["name"]: a for a in query_annotations(dashboard)}
        assert "Silent desync" in annotations, f"{uid}: no silent desync annotation"
        annotation = annotations["Silent desync"]
        assert annotation["enable"] is True and annotation["hide"] is False, uid
        assert annotation["datasource"] == DATASOURCE and annotation["target"]["datasource"] == DATASOURCE, uid
        assert set(annotation["tagKeys"].split(",")) == {"kind", "node"}, uid
        for selector in selectors(substitute(annotation["target"]["expr"], JOB)):
            assert metric_name(selector) == "dtwatch_findings_total"
            assert matchers(selector) == {"job_id": JOB, **SILENT_DESYNC}, f"{uid}: {selector}"


def test_every_query_annotation_is_scoped_to_the_job_and_uses_the_rate_interval() -> None:
    assert ANNOTATIONS
    for uid, name, expr in ANNOTATIONS:
        for selector in selectors(substitute(expr, JOB)):
            assert matchers(selector).get("job_id") == JOB, f"{uid}/{name}: {selector} is not scoped by $job_id"
        windows = [w or o for w, o in re.findall(r"\[([^\]]*)\]|offset\s+([$\w]+)", expr)]
        assert windows, f"{uid}/{name}: no range or offset"
        for window in windows:
            assert window == "$__rate_interval", f"{uid}/{name}: window {window!r} is not $__rate_interval"


def test_silent_desync_annotation_marks_the_first_and_every_later_desync(tmp_path: Path) -> None:
    """The annotation's query, run by promtool's PromQL engine: it marks the minutes in which a watchdog's
    count of silent desyncs appeared (already at 1) or grew, and nothing else."""
    promtool = require_tool("promtool", "prometheus.sh")
    exprs = {expr for uid, name, expr in ANNOTATIONS if name == "Silent desync"}
    assert len(exprs) == 1, "the dashboards' silent desync annotations differ"
    expr = substitute(exprs.pop(), "j8", rate_interval="1m")
    series = ('dtwatch_findings_total{{job="dtwatch",instance="n:9464",job_id="{job}",node="n",'
              'kind="{kind}",severity="{severity}"}}')
    # node n: first desync at 3m (the series appears at 1), a second at 6m; a stall's desync finding and
    # another job's silent desync are not marked.
    inputs = [
        (series.format(job="j8", kind="desync", severity="warning"), "_ _ _ 1 1 1 2x4"),
        (series.format(job="j8", kind="desync", severity="stall"), "_ 1x9"),
        (series.format(job="j9", kind="mismatch", severity="warning"), "_ 1x9"),
    ]
    marked_at = {3, 6}
    # One marked series per minute, with the labels the annotation's title and tags use.
    marked = f"count by (job_id, node, kind) ({expr})"
    cases = [{"expr": marked, "eval_time": f"{m}m",
              "exp_samples": [{"labels": '{job_id="j8",node="n",kind="desync"}', "value": 1}] if m in marked_at else []}
             for m in range(0, 10)]
    test_file = tmp_path / "annotation_test.yaml"
    test_file.write_text(yaml.safe_dump({"tests": [{
        "interval": "1m",
        "input_series": [{"series": name, "values": values} for name, values in inputs],
        "promql_expr_test": cases,
    }]}))
    result = subprocess.run([promtool, "test", "rules", str(test_file)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_expected_empty_list_names_real_panels_that_say_so() -> None:
    entries = json.loads(EXPECTED_EMPTY_FILE.read_text())
    assert entries and all(set(e) == {"dashboard", "panel", "why"} for e in entries)
    titles = {(uid, p["title"]): p for uid, d in DASHBOARDS.items() for p in panels(d)}
    for key in expected_empty_when_healthy():
        assert key in titles, f"{EXPECTED_EMPTY_FILE.name}: no panel {key}"
        assert "empty" in titles[key]["description"].lower(), f"{key}: description should say when it is empty"
    # The stat panels a person reads first must have data on a healthy job.
    must_have_data = {("dtwatch-overview", t) for t in ("Ranks up", "Ranks stalled", "Open incident",
                                                        "Stall window", "Step rate per rank",
                                                        "Seconds since progress per rank")}
    assert not must_have_data & expected_empty_when_healthy()


# --- Prometheus rules ---------------------------------------------------------------------------

def test_promtool_check_rules() -> None:
    promtool = require_tool("promtool", "prometheus.sh")
    result = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(ALERTS) + len(RECORDS)} rules found" in result.stdout + result.stderr


def test_promtool_rule_unit_tests_pass() -> None:
    promtool = require_tool("promtool", "prometheus.sh")
    result = subprocess.run([promtool, "test", "rules", str(RULES_TEST)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr


def test_promtool_rule_unit_tests_can_fail(tmp_path: Path) -> None:
    """A rules file whose stall alert names the wrong thing must fail the same unit tests."""
    promtool = require_tool("promtool", "prometheus.sh")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "rules_test.yaml").write_text(RULES_TEST.read_text())
    broken = RULES.read_text().replace("the watchdog names\n", "the watchdog blames\n")
    assert broken != RULES.read_text()
    (tmp_path / "dtwatch.rules.yaml").write_text(broken)
    result = subprocess.run([promtool, "test", "rules", str(tmp_path / "tests" / "rules_test.yaml")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "DtwatchRankStalled" in result.stdout + result.stderr


EXPECTED_ALERTS = {
    "DtwatchRankStalled", "DtwatchCollectiveDesync", "DtwatchStraggler", "DtwatchWatchdogDown",
    "DtwatchWatchdogAbsent", "DtwatchNewIncident", "DtwatchRankExited", "DtwatchSilentDesync",
    "DtwatchSetupMistake",
}


def test_the_alerts_are_the_documented_ones_with_severity_and_annotations() -> None:
    assert {a["alert"] for a in ALERTS} == EXPECTED_ALERTS
    for alert in ALERTS:
        name = alert["alert"]
        assert alert["labels"]["severity"] in ("critical", "warning"), name
        annotations = alert["annotations"]
        assert {"summary", "description", "runbook_url"} <= set(annotations), name
        assert annotations["runbook_url"] == RUNBOOK_URL + name.lower(), name
    severities = {a["alert"]: a["labels"]["severity"] for a in ALERTS}
    assert severities["DtwatchStraggler"] == "warning"
    assert severities["DtwatchRankStalled"] == "critical"
    assert severities["DtwatchSilentDesync"] == "critical"
    assert severities["DtwatchSetupMistake"] == "warning"  # the job runs: degraded, not stuck


def test_alert_descriptions_name_the_labels_of_what_they_are_about() -> None:
    for alert in ALERTS:
        first = selectors(alert["expr"])[0]  # the leftmost selector: the series the alert is about
        name = metric_name(first)
        labels = CONTRACT[name].labels if name in CONTRACT else PROMETHEUS_SERIES[name]
        wanted = [label for label in ("rank", "node", "job_id", "group", "instance") if label in labels]
        if alert["expr"].strip().startswith("absent("):
            wanted = []  # absent() has no labels to name
        description = alert["annotations"]["description"]
        for label in wanted:
            assert f"$labels.{label}" in description, f"{alert['alert']}: description does not name {label}"
    stalled = next(a for a in ALERTS if a["alert"] == "DtwatchRankStalled")
    assert "dtwatch_rank_culprit" in stalled["annotations"]["description"]
    assert stalled["expr"].strip() == "dtwatch_rank_stalled == 1"
    assert next(a for a in ALERTS if a["alert"] == "DtwatchWatchdogDown")["expr"].strip() \
        == 'up{job=~".*dtwatch.*"} == 0'


def github_anchors(markdown: str) -> set[str]:
    anchors = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*$", markdown, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(slug)
    return anchors


def test_runbook_has_a_section_for_every_alert_and_none_stale() -> None:
    text = RUNBOOK.read_text()
    anchors = github_anchors(text)
    for alert in ALERTS:
        anchor = alert["annotations"]["runbook_url"].split("#", 1)[1]
        assert anchor in anchors, f"docs/runbook.md has no section #{anchor}"
    sections = re.findall(r"^## (Dtwatch\w+)\s*$", text, flags=re.M)
    assert set(sections) == EXPECTED_ALERTS
    for section in re.split(r"^## ", text, flags=re.M)[1:]:
        title = section.splitlines()[0].strip()
        if title in EXPECTED_ALERTS:
            for part in ("**What it means.**", "**Confirm.**", "**What to do.**"):
                assert part in section, f"runbook {title}: missing {part}"
            assert "dtwatch analyze <run dir>" in section or "Targets" in section, title
    assert "<run dir>/incidents/<id>/" in text


def test_rule_unit_tests_cover_every_alert_firing_and_not_firing() -> None:
    tests = yaml.safe_load(RULES_TEST.read_text())
    assert tests["rule_files"] == ["../dtwatch.rules.yaml"]
    firing: set[str] = set()
    quiet: set[str] = set()
    annotated: set[str] = set()
    stall_annotations: list[dict] = []
    for case in tests["tests"]:
        for check in case.get("alert_rule_test", []):
            (firing if check.get("exp_alerts") else quiet).add(check["alertname"])
            for alert in check.get("exp_alerts") or []:
                if alert.get("exp_annotations"):
                    annotated.add(check["alertname"])
                    if check["alertname"] == "DtwatchRankStalled":
                        stall_annotations.append(alert)
    assert firing == EXPECTED_ALERTS, f"never tested firing: {EXPECTED_ALERTS - firing}"
    assert quiet == EXPECTED_ALERTS, f"never tested not firing: {EXPECTED_ALERTS - quiet}"
    assert annotated == EXPECTED_ALERTS, f"annotations unchecked: {EXPECTED_ALERTS - annotated}"
    # The stall alert's text names its rank, and says culprit or waiting.
    assert stall_annotations
    for alert in stall_annotations:
        rank = alert["exp_labels"]["rank"]
        assert f"Rank {rank} " in alert["exp_annotations"]["description"]
    assert any("culprit" in a["exp_annotations"]["summary"] for a in stall_annotations)
    assert any("names rank 1 on node-a" in a["exp_annotations"]["description"] for a in stall_annotations)
    # Recording rules are tested too.
    tested_records = {t["expr"] for case in tests["tests"] for t in case.get("promql_expr_test", [])}
    assert RECORDS <= tested_records, f"untested recording rules: {RECORDS - tested_records}"
