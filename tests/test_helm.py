"""The Helm chart (helm/dtwatch) rendered by the real helm, checked by kubernetes-validate, and the pod
mechanics it relies on (a shared PID namespace, ptrace rights) reproduced with unshare and py-spy.

No cluster exists here: manifests are validated against the Kubernetes OpenAPI schemas offline
(``kubernetes-validate --strict``), the Prometheus Operator objects (CRDs it has no schema for) are
checked structurally and against the pods and Services they must select, and the pod's shared PID
namespace is simulated with ``unshare --pid --fork --mount-proc``.

Install helm with ``.ci/tools/helm.sh`` (promtool, for one test, with ``.ci/tools/prometheus.sh``).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from functools import cache
from pathlib import Path

import pytest
import yaml

from tests.tools import ON_CI, REPO, require_tool

CHART = REPO / "helm" / "dtwatch"
CI_DIR = CHART / "ci"
CI_VALUES = sorted(CI_DIR.glob("*-values.yaml"))
RULES_FILE = REPO / "dashboards" / "dtwatch.rules.yaml"
SCRIPTS = Path(__file__).resolve().parent / "scripts"
RELEASE = "dtw"
NAMESPACE = "ml"
# Oldest Kubernetes with native sidecars on by default, and a current one.
K8S_VERSIONS = ("1.30.0", "1.33.0")
CRD_KINDS = {"PodMonitor", "ServiceMonitor", "PrometheusRule"}
KNOWN_FUNCTION = "dtwatch_pidns_blocked_in_collective"


# --------------------------------------------------------------------------------------------------
# helpers


def _missing(message: str) -> None:
    if ON_CI:
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="module")
def helm() -> str:
    return require_tool("helm", "helm.sh")


def helm_run(helm: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run([helm, *args], capture_output=True, text=True, timeout=60)
    if check and done.returncode != 0:
        pytest.fail(f"helm {' '.join(args)} failed ({done.returncode}):\n{done.stderr}")
    return done


@cache
def _template(helm: str, chart: str, release: str, args: tuple[str, ...]) -> str:
    return helm_run(helm, "template", release, chart, "--namespace", NAMESPACE, *args).stdout


def render(helm: str, *args: str, release: str = RELEASE, chart: Path = CHART) -> list[dict]:
    """`helm template` the chart; the manifests as dicts (cached per argument list)."""
    return [d for d in yaml.safe_load_all(_template(helm, str(chart), release, args)) if d]


def render_ci(helm: str, name: str) -> list[dict]:
    return render(helm, "-f", str(CI_DIR / f"{name}-values.yaml"))


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, got {[d['metadata']['name'] for d in found]}"
    return found[0]


def pod_parts(docs: list[dict]) -> tuple[dict, dict, dict]:
    """(pod spec, trainer container, watchdog container) of the training Job."""
    spec = one(docs, "Job")["spec"]["template"]["spec"]
    containers = spec.get("initContainers", []) + spec["containers"]
    trainer = next(c for c in containers if c["name"] == "trainer")
    watchdog = next(c for c in containers if c["name"] == "dtwatch")
    return spec, trainer, watchdog


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def mounts_of(container: dict) -> dict[str, str]:
    return {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}


def arg_value(args: list[str], flag: str) -> str | None:
    for a in args:
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def copy_chart(dest: Path) -> Path:
    """A copy of the chart with the symlinked files dereferenced (what `helm package` ships)."""
    shutil.copytree(CHART, dest, symlinks=False)
    return dest


# --------------------------------------------------------------------------------------------------
# lint and schema validation


def test_ci_values_cover_the_feature_combinations():
    names = {p.name.removesuffix("-values.yaml") for p in CI_VALUES}
    assert {"default", "monitors-on", "rules-on", "dashboards-on", "plain-sidecar", "everything-on",
            "multi-node"} <= names, names


def test_every_values_key_is_commented():
    """Every key of values.yaml has a comment line right above it, except the Kubernetes fields inside
    pass-through objects (securityContext, resources, probe timings)."""
    passthrough = {"securityContext", "podSecurityContext", "resources", "requests", "limits", "capabilities",
                   "seccompProfile", "livenessProbe", "readinessProbe", "startupProbe"}
    lines = (CHART / "values.yaml").read_text().splitlines()
    stack: list[tuple[int, str]] = []
    undocumented = []
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)([A-Za-z_][\w.-]*):", line)
        if not m:
            continue
        indent, key = len(m.group(1)), m.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        parent = stack[-1][1] if stack else None
        stack.append((indent, key))
        if parent in passthrough and key != "enabled":
            continue
        if i == 0 or not lines[i - 1].strip().startswith("#"):
            undocumented.append(f"line {i + 1}: {line.strip()}")
    assert not undocumented, undocumented
    documented = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert set(documented) <= set(schema["properties"]), set(documented) - set(schema["properties"])


@pytest.mark.parametrize("values", CI_VALUES, ids=lambda p: p.name)
def test_helm_lint_strict(helm, values):
    done = helm_run(helm, "lint", "--strict", str(CHART), "-f", str(values), check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in done.stdout
    assert "[ERROR]" not in done.stdout and "[WARNING]" not in done.stdout, done.stdout


def test_core_resources_pass_kubernetes_validate_strict(helm, tmp_path):
    """Every non-CRD manifest of every ci values file is valid for Kubernetes 1.30 and 1.33 with
    unknown fields rejected."""
    files, expected = [], {}
    for values in CI_VALUES:
        core = [d for d in render(helm, "-f", str(values)) if d["kind"] not in CRD_KINDS]
        path = tmp_path / values.name
        path.write_text(yaml.safe_dump_all(core))
        files.append(str(path))
        expected[str(path)] = {f"{d['kind'].lower()}/{d['metadata']['name']}" for d in core}
    for version in K8S_VERSIONS:
        done = subprocess.run(
            [sys.executable, "-m", "kubernetes_validate", "--strict", "-k", version, *files],
            capture_output=True, text=True, timeout=120)
        out = done.stdout + done.stderr
        assert done.returncode == 0, out
        assert "Couldn't find schema" not in out, out
        for path, resources in expected.items():
            passed = set(re.findall(rf"^INFO {re.escape(path)} passed for resource (\S+) against", out, re.M))
            assert passed == resources, (version, path, resources - passed)


def test_kubernetes_validate_strict_catches_a_misspelt_field(helm, tmp_path):
    """Control for the test above: strict validation does reject an unknown pod field."""
    job = one(render_ci(helm, "default"), "Job")
    job["spec"]["template"]["spec"]["shareProcessNamespaces"] = True
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(job))
    done = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "-k", K8S_VERSIONS[0], str(path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "shareProcessNamespaces" in done.stdout + done.stderr


# Fields of the Prometheus Operator CRDs (monitoring.coreos.com/v1) the chart may render.
RELABEL_KEYS = {"sourceLabels", "separator", "targetLabel", "regex", "modulus", "replacement", "action"}
ENDPOINT_KEYS = {"port", "portNumber", "targetPort", "path", "scheme", "params", "interval", "scrapeTimeout",
                 "honorLabels", "honorTimestamps", "relabelings", "metricRelabelings", "tlsConfig",
                 "bearerTokenSecret", "basicAuth", "authorization", "oauth2", "proxyUrl", "followRedirects",
                 "enableHttp2", "filterRunning", "trackTimestampsStaleness"}
CRD_SPEC_KEYS = {
    "PodMonitor": {"jobLabel", "podTargetLabels", "podMetricsEndpoints", "selector", "namespaceSelector",
                   "sampleLimit", "targetLimit", "labelLimit", "attachMetadata", "scrapeProtocols"},
    "ServiceMonitor": {"jobLabel", "targetLabels", "podTargetLabels", "endpoints", "selector",
                       "namespaceSelector", "sampleLimit", "targetLimit", "labelLimit", "attachMetadata",
                       "scrapeProtocols"},
    "PrometheusRule": {"groups"},
}


def check_crd(doc: dict, docs: list[dict]) -> None:
    """Structure of one Prometheus Operator object, and that it selects what it must."""
    kind = doc["kind"]
    assert doc["apiVersion"] == "monitoring.coreos.com/v1"
    meta = doc["metadata"]
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", meta["name"]) and len(meta["name"]) <= 63
    assert meta["namespace"] and all(isinstance(v, str) for v in meta["labels"].values())
    spec = doc["spec"]
    assert set(spec) <= CRD_SPEC_KEYS[kind], set(spec) - CRD_SPEC_KEYS[kind]
    if kind == "PrometheusRule":
        assert spec["groups"]
        for group in spec["groups"]:
            assert group["name"] and group["rules"]
            for rule in group["rules"]:
                assert ("record" in rule) != ("alert" in rule) and isinstance(rule["expr"], (str, int, float))
        return
    endpoints = spec["podMetricsEndpoints" if kind == "PodMonitor" else "endpoints"]
    assert endpoints
    for ep in endpoints:
        assert set(ep) <= ENDPOINT_KEYS, set(ep) - ENDPOINT_KEYS
        assert ep["path"] == "/metrics" and ep["scheme"] == "http"
        for relabel in ep.get("relabelings", []) + ep.get("metricRelabelings", []):
            assert set(relabel) <= RELABEL_KEYS, set(relabel) - RELABEL_KEYS
    selector = spec["selector"]["matchLabels"]
    assert spec["namespaceSelector"]["matchNames"] == [NAMESPACE]
    if kind == "PodMonitor":
        # It must find the training pods, and their watchdog's port named like the endpoint's.
        for job in (d for d in docs if d["kind"] == "Job"):
            template = job["spec"]["template"]
            assert selects(selector, template["metadata"]["labels"])
            ports = {p["name"] for c in template["spec"].get("initContainers", []) + template["spec"]["containers"]
                     if c["name"] == "dtwatch" for p in c["ports"]}
            assert {ep["port"] for ep in endpoints} <= ports
    else:
        services = [d for d in docs if d["kind"] == "Service" and selects(selector, d["metadata"]["labels"])]
        assert [s["metadata"]["name"] for s in services] == [f"{RELEASE}-dtwatch"], "selects the metrics Service only"
        assert {ep["port"] for ep in endpoints} <= {p["name"] for p in services[0]["spec"]["ports"]}


@pytest.mark.parametrize("values", CI_VALUES, ids=lambda p: p.name)
def test_crd_documents_are_well_formed(helm, values):
    docs = render(helm, "-f", str(values))
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            check_crd(doc, docs)


@pytest.mark.parametrize(("args", "message"), [
    (("--set-string", "watchdog.metricsPort=9464"),
     "watchdog.metricsPort: Invalid type. Expected: integer, given: string"),
    (("--set", "watchdog.metricsPort=70000"), "watchdog.metricsPort: Must be less than or equal to 65535"),
    (("--set", "sidecar.mode=sidecar"), "sidecar.mode: sidecar.mode must be one of the following"),
    (("--set", "training.nnodes=0"), "training.nnodes: Must be greater than or equal to 1"),
    (("--set-json", "watchdog.stallWindow=0.1"), "watchdog.stallWindow: Must be greater than or equal to 0.5"),
    (("--set", "watchdog.metricsPrt=9464"), "Additional property metricsPrt is not allowed"),
    (("--set", "dashboards.labelValue=1"), "dashboards.labelValue: Invalid type. Expected: string, given: integer"),
])
def test_values_schema_rejects_bad_values(helm, args, message):
    done = helm_run(helm, "template", RELEASE, str(CHART), *args, check=False)
    assert done.returncode != 0
    assert "values don't meet the specifications of the schema" in done.stderr
    assert message in done.stderr, done.stderr


# --------------------------------------------------------------------------------------------------
# the pod


def test_default_pod_runs_the_watchdog_as_a_native_sidecar_sharing_the_pid_namespace(helm):
    docs = render_ci(helm, "default")
    spec, trainer, watchdog = pod_parts(docs)
    assert spec["shareProcessNamespace"] is True
    assert [c["name"] for c in spec["initContainers"]] == ["dtwatch"]
    assert watchdog["restartPolicy"] == "Always"
    assert [c["name"] for c in spec["containers"]] == ["trainer"]
    assert spec["restartPolicy"] == "Never"
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert spec["automountServiceAccountToken"] is False


def test_watchdog_security_context_is_strict_with_sys_ptrace_only(helm):
    _, trainer, watchdog = pod_parts(render_ci(helm, "default"))
    sc = watchdog["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["SYS_PTRACE"]}
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False and sc["privileged"] is False
    assert sc["runAsNonRoot"] is True
    # A non-root process keeps no added capability across exec: ptrace works only within one UID.
    assert (sc["runAsUser"], sc["runAsGroup"]) == (trainer["securityContext"]["runAsUser"],
                                                 trainer["securityContext"]["runAsGroup"]) == (1000, 1000)
    assert trainer["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert watchdog["resources"]["requests"] == {"cpu": "50m", "memory": "128Mi"}
    assert set(watchdog["resources"]["limits"]) == {"cpu", "memory"}


def test_run_dir_and_dev_shm_are_shared_and_tmp_is_writable(helm):
    spec, trainer, watchdog = pod_parts(render_ci(helm, "default"))
    volumes = {v["name"]: v for v in spec["volumes"]}
    t_mounts, w_mounts = mounts_of(trainer), mounts_of(watchdog)
    run_dir = env_of(trainer)["DTWATCH_DIR"]["value"]
    assert run_dir == env_of(watchdog)["DTWATCH_DIR"]["value"] == "/run/dtwatch"
    for path in (run_dir, "/dev/shm"):
        assert t_mounts[path] == w_mounts[path], path  # the same volume in both containers
        assert "emptyDir" in volumes[t_mounts[path]]
    assert volumes[t_mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    # The watchdog's root filesystem is read-only: /tmp is its own emptyDir, not the trainer's.
    assert "emptyDir" in volumes[w_mounts["/tmp"]] and "/tmp" not in t_mounts
    assert not any(m.get("readOnly") for m in watchdog["volumeMounts"])


def test_probes_hit_healthz_and_readyz_on_the_metrics_port(helm):
    _, _, watchdog = pod_parts(render_ci(helm, "default"))
    port = {p["name"]: p["containerPort"] for p in watchdog["ports"]}["metrics"]
    assert port == 9464 == int(arg_value(watchdog["args"], "--metrics-port"))
    assert arg_value(watchdog["args"], "--metrics-addr") == "0.0.0.0"
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz"), ("startupProbe", "/readyz")):
        assert watchdog[probe]["httpGet"] == {"path": path, "port": "metrics", "scheme": "HTTP"}, probe


def test_trainer_env_turns_the_in_process_watchdog_off_and_shares_the_job_id(helm):
    for name in ("default", "multi-node"):
        _, trainer, watchdog = pod_parts(render_ci(helm, name))
        t_env, w_env = env_of(trainer), env_of(watchdog)
        assert t_env["DTWATCH_WATCHDOG"]["value"] == "off"
        assert "DTWATCH_WATCHDOG" not in w_env
        assert t_env["DTWATCH_JOB_ID"]["value"] == w_env["DTWATCH_JOB_ID"]["value"]
    assert env_of(pod_parts(render_ci(helm, "default"))[1])["DTWATCH_JOB_ID"]["value"] == f"{RELEASE}-dtwatch"
    assert env_of(pod_parts(render_ci(helm, "multi-node"))[2])["DTWATCH_JOB_ID"]["value"] == "llama-pretrain-7"


def test_indexed_job_and_headless_service_wire_the_torchrun_rendezvous(helm):
    docs = render_ci(helm, "default")
    job = one(docs, "Job")
    rdzv = one(docs, "Service", f"{RELEASE}-dtwatch-rdzv")
    spec, trainer, watchdog = pod_parts(docs)
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 1
    assert rdzv["spec"]["clusterIP"] == "None" and rdzv["spec"]["publishNotReadyAddresses"] is True
    assert spec["subdomain"] == rdzv["metadata"]["name"]
    assert selects(rdzv["spec"]["selector"], job["spec"]["template"]["metadata"]["labels"])
    master = f"{job['metadata']['name']}-0.{rdzv['metadata']['name']}"
    assert trainer["command"] == ["torchrun"]
    assert trainer["args"] == ["--nnodes=1", "--nproc-per-node=1", "--node-rank=$(JOB_COMPLETION_INDEX)",
                               f"--master-addr={master}", "--master-port=29500", "train.py"]
    assert arg_value(watchdog["args"], "--store") == f"{master}:29500"
    assert arg_value(watchdog["args"], "--idle-exit") == "0"  # kubelet stops a native sidecar


def test_multi_node_job_two_pods_times_four_processes(helm):
    docs = render_ci(helm, "multi-node")
    job = one(docs, "Job")
    _, trainer, watchdog = pod_parts(docs)
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 2
    master = f"{RELEASE}-dtwatch-0.{RELEASE}-dtwatch-rdzv"
    assert trainer["command"] == ["dtwatch", "run", "--", "torchrun"]
    assert trainer["args"] == [
        "--nnodes=2", "--nproc-per-node=4", "--node-rank=$(JOB_COMPLETION_INDEX)", f"--master-addr={master}",
        "--master-port=29400", "--max-restarts=0", "/workspace/train.py", "--config", "/workspace/configs/7b.yaml"]
    assert trainer["image"] == "registry.example.com/ml/trainer:2026.11"
    assert trainer["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert one(docs, "Service", f"{RELEASE}-dtwatch-rdzv")["spec"]["ports"][0]["port"] == 29400
    assert arg_value(watchdog["args"], "--store") == f"{master}:29400"
    assert arg_value(watchdog["args"], "--stall-window") == "300"
    shm = next(v for v in pod_parts(docs)[0]["volumes"] if v["name"] == "dtwatch-shm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Gi"}


def test_plain_sidecar_is_a_regular_container_that_exits_when_idle(helm):
    for args, idle in ((("-f", str(CI_DIR / "plain-sidecar-values.yaml")), "120"),
                       (("--set", "sidecar.mode=plain"), "60")):
        spec, _, watchdog = pod_parts(render(helm, *args))
        assert "initContainers" not in spec
        assert [c["name"] for c in spec["containers"]] == ["trainer", "dtwatch"]
        assert "restartPolicy" not in watchdog
        assert arg_value(watchdog["args"], "--idle-exit") == idle
        assert spec["shareProcessNamespace"] is True


def test_native_sidecar_needs_kubernetes_1_29_and_plain_works_before(helm):
    done = helm_run(helm, "template", RELEASE, str(CHART), "--kube-version", "1.28.9", check=False)
    assert done.returncode != 0 and "sidecar.mode=native needs Kubernetes >= 1.29" in done.stderr
    docs = render(helm, "--kube-version", "1.28.9", "--set", "sidecar.mode=plain")
    assert "initContainers" not in pod_parts(docs)[0]


def test_watchdog_options_render_as_flags_and_env(helm):
    spec, trainer, watchdog = pod_parts(render_ci(helm, "watchdog-options"))
    args = watchdog["args"]
    assert args[0] == "watch" and watchdog["command"] == ["dtwatch"]
    assert arg_value(args, "--stall-window") == "120.5"
    assert arg_value(args, "--idle-exit") == "30"
    assert arg_value(args, "--store") == "rendezvous.example.svc:29500"
    assert "--fail-fast" in args and args[-2:] == ["--window-ceiling=900", "--poll-interval=1"]
    env = env_of(watchdog)
    assert env["DTWATCH_WEBHOOK"]["valueFrom"]["secretKeyRef"] == {"name": "dtwatch-webhook", "key": "slack-url"}
    assert env["DTWATCH_NODE"]["value"] == "node-a"
    assert env["DTWATCH_SAMPLE_INTERVAL"]["value"] == "0.5"
    assert "startupProbe" not in watchdog
    assert watchdog["image"].endswith("@sha256:" + "0123456789abcdef" * 4)
    assert mounts_of(watchdog)["/dumps"] == mounts_of(trainer)["/dumps"] == "dumps"
    assert {v["name"] for v in spec["volumes"]} == {"dtwatch-run", "dtwatch-shm", "dtwatch-tmp", "dumps"}
    assert spec["serviceAccountName"] == "training"
    assert spec["imagePullSecrets"] == [{"name": "registry-credentials"}]


# --------------------------------------------------------------------------------------------------
# optional resources, rules, dashboards


def kinds(docs: list[dict]) -> list[str]:
    return sorted(d["kind"] for d in docs)


def test_optional_resources_are_off_by_default_and_on_when_enabled(helm):
    base = ["Job", "Service", "Service", "ServiceAccount"]
    assert kinds(render_ci(helm, "default")) == base
    assert kinds(render_ci(helm, "monitors-on")) == sorted(base + ["PodMonitor", "ServiceMonitor"])
    assert kinds(render_ci(helm, "rules-on")) == sorted(base + ["PrometheusRule"])
    assert kinds(render_ci(helm, "dashboards-on")) == sorted(base + ["ConfigMap"])
    assert kinds(render_ci(helm, "everything-on")) == sorted(
        base + ["ConfigMap", "PodMonitor", "PrometheusRule", "ServiceMonitor"])
    assert kinds(render_ci(helm, "sidecar-only")) == ["ConfigMap", "PodMonitor", "PrometheusRule", "Service"]
    monitors = render_ci(helm, "monitors-on")
    assert one(monitors, "ServiceMonitor")["metadata"]["namespace"] == "monitoring"
    assert one(monitors, "PodMonitor")["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_service_monitor_requires_the_metrics_service(helm):
    done = helm_run(helm, "template", RELEASE, str(CHART), "--set", "serviceMonitor.enabled=true",
                    "--set", "service.enabled=false", check=False)
    assert done.returncode != 0 and "serviceMonitor.enabled needs service.enabled" in done.stderr


def test_prometheus_rule_carries_the_rules_file(helm):
    rule = one(render_ci(helm, "rules-on"), "PrometheusRule")
    assert rule["spec"]["groups"] == yaml.safe_load(RULES_FILE.read_text())["groups"]
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_prometheus_rule_spec_passes_promtool(helm, tmp_path):
    promtool = require_tool("promtool", "prometheus.sh")
    rule = one(render_ci(helm, "rules-on"), "PrometheusRule")
    path = tmp_path / "rendered.rules.yaml"
    path.write_text(yaml.safe_dump(rule["spec"]))
    done = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def repo_dashboards() -> list[Path]:
    """Grafana dashboards among dashboards/*.json (other JSON there is test data)."""
    out = []
    for path in sorted((REPO / "dashboards").glob("*.json")):
        data = json.loads(path.read_text())
        if isinstance(data, dict) and "panels" in data and "uid" in data:
            out.append(path)
    return out


def test_chart_files_are_symlinks_to_the_repository_files():
    links = sorted((CHART / "files" / "dashboards").glob("*.json"))
    assert links
    for link in links:
        assert link.is_symlink(), f"{link} must be a symlink, not a copy"
        assert link.resolve().parent == REPO / "dashboards"
    assert {p.resolve() for p in links} == {p.resolve() for p in repo_dashboards()}, \
        "every dashboard in dashboards/ needs a symlink in helm/dtwatch/files/dashboards/ (and no more)"
    rules = CHART / "files" / "dtwatch.rules.yaml"
    assert rules.is_symlink() and rules.resolve() == RULES_FILE.resolve()


def test_dashboards_configmap_ships_the_dashboards(helm):
    cm = one(render_ci(helm, "everything-on"), "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    expected = {p.name: json.loads(p.read_text()) for p in repo_dashboards()}
    assert {k: json.loads(v) for k, v in cm["data"].items()} == expected
    custom = one(render_ci(helm, "dashboards-on"), "ConfigMap")
    assert custom["metadata"]["labels"]["grafana_dashboard"] == "dtwatch"
    assert custom["metadata"]["namespace"] == "grafana"
    assert custom["metadata"]["annotations"] == {"grafana_folder": "Training"}


def test_helm_package_follows_the_symlinks(helm, tmp_path):
    """The packaged chart holds the linked files' content as regular files."""
    out = helm_run(helm, "package", str(CHART), "--destination", str(tmp_path))
    assert "found symbolic link" in out.stderr  # helm says it followed them
    (tgz,) = tmp_path.glob("dtwatch-*.tgz")
    with tarfile.open(tgz) as tar:
        members = {m.name: m for m in tar.getmembers()}
        shipped = {"dtwatch/files/dtwatch.rules.yaml": RULES_FILE}
        shipped.update({f"dtwatch/files/dashboards/{p.name}": p for p in repo_dashboards()})
        for name, source in shipped.items():
            assert members[name].isfile(), name
            assert tar.extractfile(members[name]).read() == source.read_bytes(), name
        assert not any(n.startswith("dtwatch/ci/") for n in members), ".helmignore keeps ci/ out"


# --------------------------------------------------------------------------------------------------
# names, NOTES.txt, embedding in another chart


def test_names_fit_63_characters_with_a_long_release_name(helm):
    release = "r" * 53  # helm's limit for release names
    docs = render(helm, "-f", str(CI_DIR / "everything-on-values.yaml"), "--set", "training.nnodes=12",
                  "--set", "nameOverride=dtwatch-with-a-long-name-override", release=release)
    metrics = [d for d in docs if d["kind"] == "Service" and d["spec"].get("clusterIP") != "None"]
    fullname = metrics[0]["metadata"]["name"]
    assert len(fullname) == 63 and fullname == f"{release}-dtwatch-with-a-long-name-override"[:63].rstrip("-")
    for doc in docs:
        name = doc["metadata"]["name"]
        assert len(name) <= 63 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name), name
        for value in doc["metadata"].get("labels", {}).values():
            assert len(value) <= 63, value
    job = one(docs, "Job")
    assert len(f"{job['metadata']['name']}-11") <= 63  # the hostname of the last pod
    _, trainer, _ = pod_parts(docs)
    master = arg_value(trainer["args"], "--master-addr")
    assert all(len(label) <= 63 for label in master.split("."))
    assert master.split(".")[1].endswith("-rdzv")
    assert render(helm, release="my-dtwatch")[0]["metadata"]["name"].startswith("my-dtwatch")
    assert one(render(helm, release="my-dtwatch"), "Job")["metadata"]["name"] == "my-dtwatch"


def test_notes_print_the_port_forward_command(helm, tmp_path):
    """NOTES.txt rendered by helm: `helm template` skips it, so a copy of the chart renders it into a
    ConfigMap (helm install --dry-run would need a cluster)."""
    chart = copy_chart(tmp_path / "dtwatch")
    notes = (chart / "templates" / "NOTES.txt").read_text()
    (chart / "templates" / "NOTES.txt").unlink()
    (chart / "templates" / "zz-notes.yaml").write_text(
        '{{- define "test.notes" }}' + notes + "{{- end }}\n"
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\ndata:\n"
        '  notes: {{ include "test.notes" . | quote }}\n')

    def notes_for(*args: str) -> str:
        return one(render(helm, *args, chart=chart), "ConfigMap", "notes")["data"]["notes"]

    text = notes_for()
    assert f"kubectl --namespace {NAMESPACE} port-forward svc/{RELEASE}-dtwatch 9464:9464" in text
    assert "curl -s http://127.0.0.1:9464/metrics" in text
    assert (f"kubectl --namespace {NAMESPACE} port-forward $(kubectl --namespace {NAMESPACE} get pods "
            f"-l batch.kubernetes.io/job-name={RELEASE}-dtwatch,batch.kubernetes.io/job-completion-index=0 "
            f"-o name) 9464:9464") in text
    assert "WARNING" not in text and "No training Job" not in text
    text = notes_for("--set", "training.enabled=false")
    assert f"dtwatch/watchdog: {RELEASE}-dtwatch" in text and "port-forward svc/" in text
    text = notes_for("--set", "watchdog.metricsPort=9500", "--set", "watchdog.securityContext.runAsUser=2000")
    assert "port-forward svc/dtw-dtwatch 9500:9464" in text and "http://127.0.0.1:9500/metrics" in text
    assert "WARNING: watchdog.securityContext.runAsUser (2000) differs" in text


PARENT_POD = """\
apiVersion: apps/v1
kind: StatefulSet
metadata:
  name: trainer
spec:
  serviceName: trainer
  replicas: 2
  selector:
    matchLabels: {app: trainer}
  template:
    metadata:
      labels:
        app: trainer
        {{- include "dtwatch.podLabels" .Subcharts.dtwatch | nindent 8 }}
    spec:
      shareProcessNamespace: true
      initContainers:
        {{- include "dtwatch.sidecarContainer" .Subcharts.dtwatch | nindent 8 }}
      containers:
        - name: trainer
          image: registry.example.com/trainer:1
          command: ["torchrun", "--nnodes=2", "train.py"]
          env:
            {{- include "dtwatch.trainerEnv" .Subcharts.dtwatch | nindent 12 }}
          volumeMounts:
            {{- include "dtwatch.trainerVolumeMounts" .Subcharts.dtwatch | nindent 12 }}
      volumes:
        {{- include "dtwatch.volumes" .Subcharts.dtwatch | nindent 8 }}
"""


def test_named_templates_embed_the_sidecar_in_another_chart(helm, tmp_path):
    parent = tmp_path / "parent"
    (parent / "templates").mkdir(parents=True)
    (parent / "Chart.yaml").write_text("apiVersion: v2\nname: parent\nversion: 1.0.0\n")
    (parent / "values.yaml").write_text(yaml.safe_dump({"dtwatch": {
        "jobId": "parent-job", "training": {"enabled": False}, "podMonitor": {"enabled": True},
        "watchdog": {"store": "trainer-0.trainer:29500"}}}))
    (parent / "templates" / "statefulset.yaml").write_text(PARENT_POD)
    copy_chart(parent / "charts" / "dtwatch")
    docs = render(helm, chart=parent)
    assert "Job" not in kinds(docs)
    sts = one(docs, "StatefulSet")
    pod = sts["spec"]["template"]
    (watchdog,) = pod["spec"]["initContainers"]
    trainer = pod["spec"]["containers"][0]
    assert watchdog["restartPolicy"] == "Always"
    assert watchdog["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["SYS_PTRACE"]}
    assert arg_value(watchdog["args"], "--store") == "trainer-0.trainer:29500"
    assert env_of(trainer)["DTWATCH_WATCHDOG"]["value"] == "off"
    assert env_of(trainer)["DTWATCH_JOB_ID"] == env_of(watchdog)["DTWATCH_JOB_ID"] == {
        "name": "DTWATCH_JOB_ID", "value": "parent-job"}
    for path in ("/run/dtwatch", "/dev/shm"):
        assert mounts_of(trainer)[path] == mounts_of(watchdog)[path]
    assert {v["name"] for v in pod["spec"]["volumes"]} == {"dtwatch-run", "dtwatch-shm", "dtwatch-tmp"}
    podmonitor = one(docs, "PodMonitor")
    assert selects(podmonitor["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])
    assert selects(one(docs, "Service")["spec"]["selector"], pod["metadata"]["labels"])
    path = tmp_path / "parent.yaml"
    path.write_text(yaml.safe_dump_all([d for d in docs if d["kind"] not in CRD_KINDS]))
    done = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "-k", K8S_VERSIONS[0], str(path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_dockerfile_matches_the_chart_defaults():
    dockerfile = (REPO / "Dockerfile").read_text()
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert re.search(r"^FROM python:3\.11-slim$", dockerfile, re.M)
    assert re.search(r"^USER 1000:1000$", dockerfile, re.M)
    uids = (values["watchdog"]["securityContext"]["runAsUser"], values["training"]["securityContext"]["runAsUser"])
    assert uids == (1000, 1000)
    assert re.search(rf"^EXPOSE {values['watchdog']['metricsPort']}$", dockerfile, re.M)
    assert re.search(r'^ENTRYPOINT \["dtwatch"\]$', dockerfile, re.M) and values["watchdog"]["command"] == ["dtwatch"]
    assert re.search(r'^CMD \["watch"\]$', dockerfile, re.M)
    assert "HEALTHCHECK" not in dockerfile.replace("No HEALTHCHECK", "")
    assert 'pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"' in dockerfile
    assert re.search(r"^ARG TORCH_VERSION=2\.13\.0$", dockerfile, re.M)


# --------------------------------------------------------------------------------------------------
# the shared PID namespace, simulated


def pyspy_path() -> str:
    for candidate in (Path(sys.executable).parent / "py-spy", shutil.which("py-spy")):
        if candidate and os.access(candidate, os.X_OK):
            return str(candidate)
    _missing("py-spy not installed: pip install py-spy (a dependency of dtwatch)")


@pytest.fixture(scope="module")
def unshare() -> str:
    path = shutil.which("unshare")
    if not path:
        _missing("unshare (util-linux) not installed")
    done = subprocess.run([path, "--pid", "--fork", "--mount-proc", "true"], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        _missing(f"unshare --pid --fork --mount-proc is not permitted here (needs root or user namespaces): "
                 f"{done.stderr.strip()}")
    return path


class Pod:
    """pidns_pod.py as PID 1 of a new PID namespace (with its own /proc), like a pod with
    shareProcessNamespace: true."""

    def __init__(self, unshare: str, workdir: Path, trainers: dict, probes: list, *, python: str, hold: bool):
        workdir.mkdir(parents=True, exist_ok=True)
        workdir.chmod(0o755)
        self.workdir = workdir
        spec = {"workdir": str(workdir), "python": python, "trainer": str(SCRIPTS / "pidns_trainer.py"),
                "trainers": trainers, "probes": probes, "hold": hold}
        (workdir / "spec.json").write_text(json.dumps(spec))
        self.proc = subprocess.Popen(
            [unshare, "--pid", "--fork", "--mount-proc", "--kill-child", sys.executable,
             str(SCRIPTS / "pidns_pod.py"), str(workdir / "spec.json")],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def result(self, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        while not (self.workdir / "pod.done").exists():
            if self.proc.poll() is not None and not (self.workdir / "pod.done").exists():
                pytest.fail(f"pod exited {self.proc.returncode}: {self.proc.stdout.read()}")
            if time.monotonic() > deadline:
                pytest.fail("pod did not finish its probes in time")
            time.sleep(0.05)
        result = json.loads((self.workdir / "pod.json").read_text())
        assert "error" not in result, result["error"]
        return result

    def close(self) -> None:
        (self.workdir / "release").touch()
        try:
            self.output = self.proc.communicate(timeout=20)[0]
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.output = self.proc.communicate()[0]


def dump_functions(stdout: str) -> set[str]:
    return {frame["name"] for thread in json.loads(stdout) for frame in thread["frames"]}


def host_pid_of(token: str, inner_pid: int) -> tuple[int, list[int]]:
    """Find, from outside, the process whose command line holds token; its PID and NSpid chain."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            status = (entry / "status").read_text()
        except OSError:
            continue
        if token.encode() in cmdline and b"pidns_trainer.py" in cmdline:
            nspid = [int(x) for x in re.search(r"^NSpid:\s+(.*)$", status, re.M).group(1).split()]
            if nspid[-1] == inner_pid:
                return int(entry.name), nspid
    raise AssertionError(f"no process with {token} in its command line")


def test_py_spy_reads_the_trainer_only_from_inside_its_pid_namespace(unshare, tmp_path):
    """Why the chart sets shareProcessNamespace: true.

    Inside the namespace the trainer's PID addresses the trainer, and py-spy dumps its stack. A
    sibling PID namespace (a container of a pod *without* shareProcessNamespace) has no process with
    that PID at all; in the parent namespace the same number is some unrelated process (on a VM,
    PID 2 is kthreadd). The rings record the ranks' PIDs as their own namespace numbers them, so a
    watchdog outside that namespace cannot even name the process it should dump.
    """
    pyspy = pyspy_path()
    pod = Pod(unshare, tmp_path / "pod", {"trainer": {}},
              [{"name": "inside", "trainer": "trainer", "argv": [pyspy, "dump", "--pid", "{pid}", "--json"]}],
              python=sys.executable, hold=True)
    try:
        result = pod.result()
        trainer = result["trainers"]["trainer"]
        pid = trainer["pid"]
        assert result["self_pid"] == 1 and pid > 1  # pidns_pod.py is the namespace's init, like a pod's pause
        assert trainer["nspid"] == str(pid)  # as the namespace sees it: one level
        inside = result["probes"]["inside"]
        assert inside["returncode"] == 0, inside["stderr"]
        assert KNOWN_FUNCTION in dump_functions(inside["stdout"])

        # The same process from the parent namespace has another PID; NSpid lists both.
        outer, nspid = host_pid_of(str(tmp_path / "pod"), pid)
        assert nspid == [outer, pid] and outer != pid

        # A sibling PID namespace (no shareProcessNamespace): nothing answers to that PID.
        sibling = subprocess.run(
            [unshare, "--pid", "--fork", "--mount-proc", pyspy, "dump", "--pid", str(pid), "--json"],
            capture_output=True, text=True, timeout=30)
        assert sibling.returncode != 0
        assert KNOWN_FUNCTION not in sibling.stdout + sibling.stderr

        # The parent namespace: that number is another process, or none.
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            cmdline = b""
        assert b"pidns_trainer.py" not in cmdline
        outside = subprocess.run([pyspy, "dump", "--pid", str(pid), "--json"],
                                 capture_output=True, text=True, timeout=30)
        assert KNOWN_FUNCTION not in outside.stdout
    finally:
        pod.close()


def unprivileged_python(python_candidates: list[str]) -> str | None:
    for python in python_candidates:
        if python and subprocess.run(
                ["setpriv", "--reuid=1000", "--regid=1000", "--clear-groups", python, "-c", "pass"],
                capture_output=True, timeout=30).returncode == 0:
            return python
    return None


@pytest.fixture
def traversable_tmp():
    """A scratch directory other users can reach (pytest's tmp_path sits under a 0700 directory)."""
    path = Path(tempfile.mkdtemp(prefix="dtwatch-pidns-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_ptrace_rights_behind_the_watchdog_security_context(unshare, traversable_tmp):
    """Why the watchdog's runAsUser must equal the trainer's, and what SYS_PTRACE does.

    In one PID namespace: trainers as UID 1000 and UID 1001, py-spy as
    - UID 1000 without capabilities (the chart's default watchdog): reads the UID-1000 trainer and is
      refused the UID-1001 one. A non-root container loses added capabilities at exec, so SYS_PTRACE
      cannot bridge different UIDs;
    - root with only SYS_PTRACE (bounding set = {SYS_PTRACE}, like `drop: [ALL], add: [SYS_PTRACE]`):
      reads the UID-1001 trainer; root with no capability at all cannot.
    With Yama ptrace_scope 1 or 2 even the same-UID read is refused (the reader is not the trainer's
    ancestor): the case values.yaml documents for the root watchdog.
    """
    yama = Path("/proc/sys/kernel/yama/ptrace_scope")
    scope = int(yama.read_text()) if yama.exists() else 0
    if scope >= 3:
        pytest.skip("Yama ptrace_scope 3: no process may ptrace another on this host")
    if not shutil.which("setpriv"):
        _missing("setpriv (util-linux) not installed")
    pyspy = pyspy_path()
    python = unprivileged_python(
        [sys.executable, "/usr/bin/python3", "/usr/local/bin/python3", shutil.which("python3")])
    if python is None:
        _missing("no Python interpreter executable by UID 1000 (needed to run a non-root trainer)")
    if subprocess.run(["setpriv", "--reuid=1000", "--regid=1000", "--clear-groups", pyspy, "--version"],
                      capture_output=True, timeout=30).returncode != 0:
        _missing(f"{pyspy} is not executable by UID 1000")
    as_user = lambda uid: [f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    dump = [pyspy, "dump", "--pid", "{pid}", "--json"]
    pod = Pod(unshare, traversable_tmp / "pod",
              {"uid1000": {"setpriv": as_user(1000)}, "uid1001": {"setpriv": as_user(1001)}},
              [{"name": "same-uid", "trainer": "uid1000", "argv": dump, "setpriv": as_user(1000) + ["--no-new-privs"]},
               {"name": "other-uid", "trainer": "uid1001", "argv": dump, "setpriv": as_user(1000) + ["--no-new-privs"]},
               {"name": "root-sys-ptrace", "trainer": "uid1001", "argv": dump,
                "setpriv": ["--inh-caps=-all", "--bounding-set=-all,+sys_ptrace", "--no-new-privs"]},
               {"name": "root-no-caps", "trainer": "uid1001", "argv": dump,
                "setpriv": ["--inh-caps=-all", "--bounding-set=-all", "--no-new-privs"]}],
              python=python, hold=False)
    try:
        probes = pod.result()["probes"]
    finally:
        pod.close()
    if scope == 0:
        assert probes["same-uid"]["returncode"] == 0, probes["same-uid"]["stderr"]
        assert KNOWN_FUNCTION in dump_functions(probes["same-uid"]["stdout"])
    else:
        assert probes["same-uid"]["returncode"] != 0, f"Yama ptrace_scope {scope} should refuse it"
    assert probes["other-uid"]["returncode"] != 0
    assert "Permission Denied" in probes["other-uid"]["stdout"] + probes["other-uid"]["stderr"]
    assert probes["root-sys-ptrace"]["returncode"] == 0, probes["root-sys-ptrace"]["stderr"]
    assert KNOWN_FUNCTION in dump_functions(probes["root-sys-ptrace"]["stdout"])
    assert probes["root-no-caps"]["returncode"] != 0


def test_sidecar_writes_the_diagnosis_into_the_trainers_log(unshare, traversable_tmp):
    """How the sidecar's diagnosis reaches the trainer container's log (what `kubectl logs` shows).

    The trainer's stderr is a pipe owned by the container runtime (here: by root, the test), which the
    watchdog, running as the trainer's UID as the chart requires, may not open through /proc; it borrows
    the trainer's own descriptor instead (pidfd_getfd, allowed by the same ptrace rights py-spy uses).
    """
    yama = Path("/proc/sys/kernel/yama/ptrace_scope")
    if yama.exists() and int(yama.read_text()) >= 1:
        pytest.skip("Yama ptrace_scope >= 1: the same-UID sidecar needs DTWATCH_ALLOW_PTRACE (not simulated here)")
    if not shutil.which("setpriv"):
        _missing("setpriv (util-linux) not installed")
    python = unprivileged_python(
        [sys.executable, "/usr/bin/python3", "/usr/local/bin/python3", shutil.which("python3")])
    if python is None:
        _missing("no Python interpreter executable by UID 1000 (needed to run a non-root trainer)")
    console = traversable_tmp / "console.py"  # stdlib only: loadable by any user from a readable copy
    shutil.copyfile(REPO / "dtwatch" / "watchdog" / "console.py", console)
    console.chmod(0o644)
    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('console', sys.argv[1]); "
            "m = sys.modules['console'] = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
            "print(m.write_to_process_stderr(int(sys.argv[2]), 'dtwatch: STALL [sidecar] rank 0 in barrier\\n'))")
    as_1000 = ["--reuid=1000", "--regid=1000", "--clear-groups"]
    pod = Pod(unshare, traversable_tmp / "pod", {"trainer": {"setpriv": as_1000}},
              [{"name": "sidecar", "trainer": "trainer", "setpriv": as_1000 + ["--no-new-privs"],
                "argv": [python, "-c", code, str(console), "{pid}"]}], python=python, hold=False)
    try:
        probe = pod.result()["probes"]["sidecar"]
    finally:
        pod.close()
    log = pod.output
    assert probe["returncode"] == 0, probe["stderr"]
    assert "Delivery(ok=True" in probe["stdout"], probe["stdout"]
    assert log.count("dtwatch: STALL [sidecar] rank 0 in barrier\n") == 1, log
