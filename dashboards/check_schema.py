#!/usr/bin/env python3
"""Type-check Grafana dashboard JSON against Grafana 11.6's own TypeScript types (@grafana/schema).

For each dashboard this writes one TypeScript file that assigns the JSON, as an object literal, to a
constant typed ``Json<Dashboard>``, plus one constant per panel whose ``options`` (and
``fieldConfig.defaults.custom``) are typed with that panel plugin's ``Options`` (``FieldConfig``) from
``@grafana/schema/dist/esm/raw/composable/<plugin>/panelcfg``. ``tsc --strict`` then rejects a wrong
type (``"gridPos": "oops"``), a missing required field, a misspelt field (object literals get excess
property checks) and an unknown enum value (``"mode": "absolutely"``). ``Json<T>`` is ``T`` as JSON
spells it: a string enum member becomes its value (``ThresholdsMode.Absolute`` -> ``"absolute"``),
which is what Grafana writes into dashboard JSON; everything else is unchanged. A panel type with no
plugin schema in @grafana/schema is reported as unknown.

Annotations on a Prometheus datasource carry that datasource's own fields (``titleFormat``,
``tagKeys``, ... and a target with ``expr``), which @grafana/schema's ``AnnotationQuery`` has no room
for (Grafana's runtime type lets any datasource add its own). Each such annotation is therefore checked
as one constant typed with the shared fields from @grafana/schema plus the Prometheus fields declared
below (:data:`PROMETHEUS_ANNOTATION_TYPE`, after Grafana 11.6's Prometheus annotation editor), and
the dashboard literal carries it without those fields.

Install the toolchain with ``.ci/tools/grafana-schema.sh``; then::

    python dashboards/check_schema.py dashboards/*.json   # exit 1 and one line per error if invalid
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
COMPOSABLE = "node_modules/@grafana/schema/dist/esm/raw/composable"
# Panel types whose plugin schema directory is not the type with dashes removed.
PANEL_TYPE_ALIASES = {"dashlist": "dashboardlist", "annolist": "annotationslist", "nodegraph": "nodegraph"}

# T as it appears in JSON: string enums become their string values, the rest is unchanged.
JSON_TYPE = """\
type Json<T> =
  T extends string ? `${T}` :
  T extends number | boolean | null | undefined ? T :
  T extends Array<infer U> ? Array<Json<U>> :
  T extends object ? { [K in keyof T]: Json<T[K]> } :
  T;
"""

# The Prometheus datasource's annotation fields (Grafana 11.6: the annotation editor's title, tags, text
# and "series value as timestamp", and a query target with the expression and a minimum step).
PROMETHEUS_ANNOTATION_TYPE = """\
type PrometheusAnnotationTarget = Json<DataQuery> & {
  expr: string;
  interval?: string;
  legendFormat?: string;
  editorMode?: "code" | "builder";
  range?: boolean;
  instant?: boolean;
};
type PrometheusAnnotation = Omit<Json<AnnotationQuery>, "target"> & {
  target: PrometheusAnnotationTarget;
  titleFormat?: string;
  textFormat?: string;
  tagKeys?: string;
  useValueForTime?: boolean;
};
"""
# What the dashboard literal leaves out of a Prometheus annotation (checked in its own constant).
PROMETHEUS_ANNOTATION_FIELDS = ("target", "titleFormat", "textFormat", "tagKeys", "useValueForTime")

_TSC_ERROR = re.compile(r"^(?P<file>[^()\s][^()]*)\((?P<line>\d+),(?P<col>\d+)\): error (?P<code>TS\d+): (?P<msg>.*)$")


class SchemaToolMissingError(RuntimeError):
    """typescript / @grafana/schema are not installed in the schema directory."""


@dataclass(frozen=True)
class SchemaError:
    dashboard: Path
    where: str  # "dashboard" or "panel <id> '<title>' options/custom/type"
    line: str  # the generated TypeScript line the error points at (the offending JSON)
    message: str

    def __str__(self) -> str:
        return f"{self.dashboard}: {self.where}: {self.message} [at: {self.line}]"


def default_schema_dir() -> Path:
    tools = os.environ.get("DTWATCH_TOOLS_DIR") or os.environ.get("TOOLS_DIR") or str(REPO / ".tools")
    return Path(tools) / "grafana-schema"


def panel_plugins(schema_dir: Path) -> dict[str, tuple[str, bool, bool]]:
    """Map a panel ``type`` to (module path, has Options, has FieldConfig) from @grafana/schema."""
    plugins: dict[str, tuple[str, bool, bool]] = {}
    for decl in sorted((schema_dir / COMPOSABLE).glob("*/panelcfg/x/*PanelCfg_types.gen.d.ts")):
        text = decl.read_text()
        module = "@grafana/schema/" + str(decl.relative_to(schema_dir / "node_modules/@grafana/schema"))
        module = module.removesuffix(".d.ts")
        plugins[decl.parents[2].name] = (
            module,
            re.search(r"export interface Options\b", text) is not None,
            re.search(r"export interface FieldConfig\b", text) is not None,
        )
    return plugins


def _all_panels(dashboard: dict) -> list[dict]:
    panels = []
    for panel in dashboard.get("panels", []) or []:
        if not isinstance(panel, dict):
            continue
        panels.append(panel)
        panels.extend(p for p in panel.get("panels", []) or [] if isinstance(p, dict))
    return panels


def _literal(value: object) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False)


def render_typescript(
    dashboard: dict, plugins: dict[str, tuple[str, bool, bool]]
) -> tuple[str, list[tuple[str, str]]]:
    """Return the TypeScript source checking ``dashboard``, and (where, message) found without tsc."""
    problems: list[tuple[str, str]] = []
    imports: dict[str, str] = {}
    checks: list[str] = []
    for index, panel in enumerate(_all_panels(dashboard)):
        ptype = panel.get("type")
        if ptype == "row" or not isinstance(ptype, str):
            continue  # rows, and a missing/odd type, are checked by the Dashboard type itself
        label = f"panel {panel.get('id')} {panel.get('title')!r}".replace("\n", " ")
        key = ptype.replace("-", "").lower()
        plugin = plugins.get(PANEL_TYPE_ALIASES.get(key, key))
        if plugin is None:
            problems.append((label, f"unknown panel type {ptype!r} (no panel schema in @grafana/schema)"))
            continue
        module, has_options, has_field_config = plugin
        alias = "p_" + re.sub(r"\W", "_", ptype)
        imports[alias] = module
        name = f"panel_{index}"
        if has_options and "options" in panel:
            checks.append(f"// {label} options\nexport const {name}_options: Json<{alias}.Options> = "
                          f"{_literal(panel['options'])};")
        custom = ((panel.get("fieldConfig") or {}).get("defaults") or {}).get("custom")
        if has_field_config and custom is not None:
            checks.append(f"// {label} custom\nexport const {name}_custom: Json<{alias}.FieldConfig> = "
                          f"{_literal(custom)};")
    dashboard, annotation_checks = _split_prometheus_annotations(dashboard)
    lines = ["import type { AnnotationQuery, Dashboard, DataQuery } from '@grafana/schema';"]
    lines += [f"import type * as {alias} from '{module}';" for alias, module in sorted(imports.items())]
    lines += ["", JSON_TYPE, PROMETHEUS_ANNOTATION_TYPE, "// dashboard",
              f"export const dashboard: Json<Dashboard> = {_literal(dashboard)};", ""]
    lines += annotation_checks + checks
    return "\n".join(lines) + "\n", problems


def _split_prometheus_annotations(dashboard: dict) -> tuple[dict, list[str]]:
    """The dashboard with its Prometheus annotations' own fields left out, and one check per such annotation."""
    annotations = dashboard.get("annotations")
    if not isinstance(annotations, dict) or not isinstance(annotations.get("list"), list):
        return dashboard, []
    checks: list[str] = []
    shared: list[object] = []
    for index, annotation in enumerate(annotations["list"]):
        datasource = annotation.get("datasource") if isinstance(annotation, dict) else None
        if not (isinstance(datasource, dict) and datasource.get("type") == "prometheus"):
            shared.append(annotation)
            continue
        label = f"annotation {index} {annotation.get('name')!r}".replace("\n", " ")
        checks.append(f"// {label}\nexport const annotation_{index}: PrometheusAnnotation = {_literal(annotation)};")
        shared.append({k: v for k, v in annotation.items() if k not in PROMETHEUS_ANNOTATION_FIELDS})
    return {**dashboard, "annotations": {**annotations, "list": shared}}, checks


def _where(source_lines: list[str], line_no: int) -> str:
    for line in reversed(source_lines[: line_no]):
        if line.startswith("// "):
            return line[3:]
    return "dashboard"


def check_dashboards(paths: list[Path], schema_dir: Path | None = None) -> list[SchemaError]:
    """Type-check each dashboard JSON file; return the errors (empty: all valid)."""
    schema_dir = Path(schema_dir or default_schema_dir())
    tsc = schema_dir / "node_modules" / ".bin" / "tsc"
    if not tsc.exists() or not (schema_dir / "node_modules/@grafana/schema/package.json").exists():
        raise SchemaToolMissingError(f"no typescript/@grafana/schema in {schema_dir}: run .ci/tools/grafana-schema.sh")
    if shutil.which("node") is None:
        raise SchemaToolMissingError("node is not on PATH")
    plugins = panel_plugins(schema_dir)
    errors: list[SchemaError] = []
    # The generated files live inside schema_dir so that '@grafana/schema' resolves to its node_modules.
    work = Path(tempfile.mkdtemp(prefix="check-", dir=schema_dir))
    try:
        sources: dict[str, tuple[Path, list[str]]] = {}
        for i, path in enumerate(paths):
            path = Path(path)
            try:
                dashboard = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as exc:
                errors.append(SchemaError(path, "file", "", f"not readable as JSON: {exc}"))
                continue
            if not isinstance(dashboard, dict):
                errors.append(SchemaError(path, "file", "", "top level is not a JSON object"))
                continue
            source, problems = render_typescript(dashboard, plugins)
            errors.extend(SchemaError(path, where, "", message) for where, message in problems)
            name = f"d{i}_{re.sub(r'[^A-Za-z0-9_]', '_', path.stem)}.ts"
            (work / name).write_text(source)
            sources[name] = (path, source.splitlines())
        if not sources:
            return errors
        (work / "tsconfig.json").write_text(json.dumps(
            {"extends": "../tsconfig.json", "compilerOptions": {"noEmit": True, "strict": True},
             "files": sorted(sources)}, indent=2))
        proc = subprocess.run([str(tsc), "-p", str(work / "tsconfig.json"), "--pretty", "false"],
                              cwd=work, capture_output=True, text=True, timeout=300)
        output = proc.stdout + proc.stderr
        current: SchemaError | None = None
        for raw in output.splitlines():
            match = _TSC_ERROR.match(raw)
            if match:
                if current:
                    errors.append(current)
                fname = Path(match["file"]).name
                if fname not in sources:  # an error in the toolchain itself, not in a dashboard
                    current = SchemaError(Path(match["file"]), "toolchain", "", f"{match['code']} {match['msg']}")
                    continue
                dash_path, src = sources[fname]
                line_no = int(match["line"])
                current = SchemaError(dash_path, _where(src, line_no), src[line_no - 1].strip(),
                                      f"{match['code']} {match['msg']}")
            elif current and raw.startswith(" "):
                current = SchemaError(current.dashboard, current.where, current.line,
                                      current.message + " " + raw.strip())
            elif raw.strip():
                errors.append(SchemaError(Path("tsc"), "tsc", "", raw.strip()))
        if current:
            errors.append(current)
        if proc.returncode != 0 and not errors:
            errors.append(SchemaError(Path("tsc"), "tsc", "", f"exit {proc.returncode}: {output.strip()}"))
        return errors
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dashboards", nargs="*", type=Path,
                        help="dashboard JSON files (default: dashboards/*.json minus non-dashboards)")
    parser.add_argument("--schema-dir", type=Path, default=None,
                        help="where .ci/tools/grafana-schema.sh installed (default: $TOOLS_DIR/grafana-schema)")
    args = parser.parse_args(argv)
    paths = args.dashboards or dashboard_files()
    try:
        errors = check_dashboards(paths, args.schema_dir)
    except SchemaToolMissingError as exc:
        print(f"check_schema: {exc}", file=sys.stderr)
        return 2
    for error in errors:
        print(error)
    if not errors:
        print(f"{len(paths)} dashboard(s) valid against @grafana/schema")
    return 1 if errors else 0


def dashboard_files(directory: Path = REPO / "dashboards") -> list[Path]:
    """The Grafana dashboards in ``directory``: JSON files with ``panels`` and a ``schemaVersion``."""
    found = []
    for path in sorted(directory.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError:
            found.append(path)  # a broken dashboard must fail the check, not vanish from it
            continue
        if isinstance(data, dict) and "schemaVersion" in data:
            found.append(path)
    return found


if __name__ == "__main__":
    sys.exit(main())
