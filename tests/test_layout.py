"""The package's shape: what runs inside a training process never pulls in the watchdog's side, and the
modules do not import each other in a circle.

The import graph is read from the source (every ``import`` statement, also those inside functions, which
run later and are easy to miss), and checked against a real training-side import in a fresh interpreter.
"""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "dtwatch"

# Modules that run inside the training process (the user's one line, torchrun's bootstrap, the testing
# backend), and what they must never reach.
RANK_SIDE = ("dtwatch", "dtwatch.auto", "dtwatch.record", "dtwatch.ring", "dtwatch.testing", "dtwatch.config",
             "dtwatch.ops", "dtwatch.paths")
WATCHDOG_SIDE = ("dtwatch.watchdog", "dtwatch.export", "dtwatch.report", "dtwatch.lint", "dtwatch.cli")
MAX_LINES = 600


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(name: str, path: Path, top_level_only: bool) -> set[str]:
    """The dtwatch modules ``name`` imports (``from a import b`` counts as ``a.b`` when that is a module)."""
    tree = ast.parse(path.read_text(), str(path))
    known = modules()
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    if top_level_only:  # also imports under a module-level `if`/`try` (TYPE_CHECKING blocks excluded)
        extra = []
        for node in tree.body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, (ast.If, ast.Try)):
                extra += [n for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))]
        nodes = [*nodes, *extra]
    out: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in nodes:
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "dtwatch"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "dtwatch":
                continue
            out.add(source)
            out |= {f"{source}.{a.name}" for a in node.names if f"{source}.{a.name}" in known}
    # importing a.b.c runs a/__init__ and a/b/__init__ too
    for mod in list(out):
        parts = mod.split(".")
        out |= {".".join(parts[:i]) for i in range(1, len(parts))}
    return {m for m in out if m in known and m != name}


def reachable(roots: list[str], top_level_only: bool = False) -> dict[str, list[str]]:
    """Every module reachable from ``roots``, with one import chain that reaches it."""
    known = modules()
    chains = {r: [r] for r in roots}
    todo = list(roots)
    while todo:
        mod = todo.pop()
        for dep in sorted(imports(mod, known[mod], top_level_only)):
            if dep not in chains:
                chains[dep] = [*chains[mod], dep]
                todo.append(dep)
    return chains


def in_area(module: str, areas: tuple[str, ...]) -> bool:
    return any(module == a or module.startswith(a + ".") for a in areas)


def test_code_that_runs_in_the_rank_never_imports_the_watchdog_side():
    roots = ["dtwatch", *(m for m in modules() if in_area(m, RANK_SIDE[1:]))]
    chains = reachable(roots)
    leaks = {m: " -> ".join(chain) for m, chain in chains.items() if in_area(m, WATCHDOG_SIDE)}
    assert not leaks, f"training-side code reaches watchdog-side modules: {json.dumps(leaks, indent=1)}"


def test_the_rank_side_import_checked_in_a_real_interpreter():
    code = (
        "import sys, dtwatch, dtwatch.auto, dtwatch.testing\n"
        "from dtwatch.record import installation, recorder, sampling_thread, completion, callsite, launcher, torchenv\n"
        "import json; print(json.dumps(sorted(m for m in sys.modules if m.startswith('dtwatch'))))\n"
    )
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "DTWATCH": "0"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert "dtwatch.record.installation" in loaded
    assert not [m for m in loaded if in_area(m, WATCHDOG_SIDE)], loaded


def test_no_import_cycles_between_modules():
    known = modules()
    graph = {m: imports(m, p, top_level_only=True) for m, p in known.items()}
    # A package's __init__ importing its own submodules (to re-export them) is not a cycle.
    graph = {m: {d for d in deps if not d.startswith(m + ".")} for m, deps in graph.items()}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                cycles.append([*stack[stack.index(d):], d] if d in stack else [m, d])
            elif d not in state:
                visit(d, [*stack, d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(REPO)))
def test_no_module_is_too_long_to_read(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(REPO)} has {lines} lines (at most {MAX_LINES}): split it by concern"
