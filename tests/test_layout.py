"""The package's shape: floors that import only downwards, no import cycles, what runs inside a training process
never pulling in the watchdog's side, one module per basename, none too long to read.

The import graph is read from the source and counts every import that runs: those inside functions (lazy; they
run later and are easy to miss), ``from dtwatch import x`` (an edge to the package root, whose ``__init__`` runs
first and must be complete enough), and the packages a dotted import runs on its way (``import a.b.c`` runs
``a/__init__`` and ``a/b/__init__``). Only ``if TYPE_CHECKING:`` blocks, which never run, are left out.
A package's ``__init__`` importing its own modules is an edge like any other: if one of them imports the package
back, that is a cycle.
"""
from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "dtwatch"
MAX_LINES = 600

# The floors, bottom first. A module imports modules of lower floors and of its own area only; two areas of one
# floor never import each other (the watchdog and the readers of what it left are siblings). An area is a module
# prefix; a floor that is one area lists one name.
FLOORS: tuple[tuple[str, tuple[str, ...], bool], ...] = (
    # (floor, areas, the floor's areas are one area)
    ("base: paths, ops, config, the ring format", (
        "dtwatch.paths", "dtwatch.ops", "dtwatch.config", "dtwatch.version", "dtwatch.exception_text",
        "dtwatch.code_paths", "dtwatch.process_liveness", "dtwatch.ring"), True),
    ("the rank side: recording", ("dtwatch.__init__", "dtwatch.auto", "dtwatch.record", "dtwatch.testing"), True),
    ("source checks", ("dtwatch.lint",), False),
    ("diagnosis", ("dtwatch.diagnose",), False),
    ("incident files and words", ("dtwatch.bundle", "dtwatch.render"), False),
    ("exporters", ("dtwatch.export",), False),
    ("the watchdog and the readers", ("dtwatch.watchdog", "dtwatch.report"), False),
    ("command line", ("dtwatch.cli", "dtwatch.__main__"), True),
)
RANK_SIDE = ("dtwatch.__init__", "dtwatch.auto", "dtwatch.record", "dtwatch.testing", "dtwatch.config",
             "dtwatch.ops", "dtwatch.paths", "dtwatch.ring")
WATCHDOG_SIDE = ("dtwatch.watchdog", "dtwatch.export", "dtwatch.report", "dtwatch.lint", "dtwatch.cli",
                 "dtwatch.diagnose", "dtwatch.bundle", "dtwatch.render")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(root: Path = REPO) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted((root / "dtwatch").rglob("*.py"))}


def _ancestors(mod: str) -> set[str]:
    parts = mod.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The dtwatch modules importing ``name`` runs (see the module doc), as edges of the graph."""
    tree = ast.parse(path.read_text(), str(path))
    skipped = {id(n) for node in ast.walk(tree)
               if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
               for n in ast.walk(node) if n is not node}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            targets = {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            # the source module is imported, then each name read from it (or imported as its submodule)
            targets = {source} | {f"{source}.{a.name}" for a in node.names if f"{source}.{a.name}" in known}
        else:
            continue
        for target in targets:
            if target.split(".")[0] != "dtwatch":
                continue
            out.add(target)
            # the packages on the way, except those the importer is itself inside (already importing)
            out |= _ancestors(target) - _ancestors(name) - {package}
    return {m for m in out if m in known and m != name}


def graph(root: Path = REPO) -> dict[str, set[str]]:
    known = modules(root)
    return {m: imports(m, p, known) for m, p in known.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (each a cycle or several), as one cycle through it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(_one_cycle(g, set(group)))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


def _one_cycle(g: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest cycle through the group's first module, to name in the failure."""
    start = min(group)
    paths = {start: [start]}
    todo = [start]
    while todo:
        v = todo.pop(0)
        for w in sorted(g[v] & group):
            if w == start:
                return [*paths[v], start]
            if w not in paths:
                paths[w] = [*paths[v], w]
                todo.append(w)
    return sorted(group)


def placement(mod: str) -> tuple[int, str]:
    """(floor, area) of a module; the longest matching prefix wins."""
    name = "dtwatch.__init__" if mod == "dtwatch" else mod
    best: tuple[int, str, int] | None = None
    for i, (floor, areas, one_area) in enumerate(FLOORS):
        for area in areas:
            if (name == area or name.startswith(area + ".")) and (best is None or len(area) > best[2]):
                best = (i, floor if one_area else area, len(area))
    assert best is not None, f"{mod} is on no floor: add it to FLOORS in {Path(__file__).name}"
    return best[0], best[1]


def layering_violations(g: dict[str, set[str]]) -> list[str]:
    out = []
    for mod, deps in sorted(g.items()):
        floor, area = placement(mod)
        for dep in sorted(deps):
            dep_floor, dep_area = placement(dep)
            if dep_area != area and dep_floor >= floor:
                out.append(f"{mod} ({FLOORS[floor][0]}) imports {dep} ({FLOORS[dep_floor][0]})")
    return out


def reachable(g: dict[str, set[str]], roots: list[str]) -> dict[str, list[str]]:
    """Every module reachable from ``roots``, with one import chain that reaches it."""
    chains = {r: [r] for r in roots}
    todo = list(roots)
    while todo:
        mod = todo.pop()
        for dep in sorted(g[mod]):
            if dep not in chains:
                chains[dep] = [*chains[mod], dep]
                todo.append(dep)
    return chains


def in_area(module: str, areas: tuple[str, ...]) -> bool:
    name = "dtwatch.__init__" if module == "dtwatch" else module
    return any(name == a or name.startswith(a + ".") for a in areas)


def test_no_import_cycles_counting_lazy_and_package_root_imports():
    found = cycles(graph())
    assert not found, "import cycles: " + "; ".join(" -> ".join(c) for c in found)


def test_every_module_imports_only_its_floor_area_and_the_floors_below():
    bad = layering_violations(graph())
    assert not bad, "imports against the floors:\n" + "\n".join(bad)


def test_a_cycle_planted_through_the_package_root_is_caught(tmp_path):
    """The check fails on what it must catch: a ring module reading ``paths`` from the package root, whose
    ``__init__`` imports the ring package (the cycle this house once had, and which a check skipping root edges
    could not see); and a lazy import from the report into the watchdog."""
    shutil.copytree(PACKAGE, tmp_path / "dtwatch", ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.c"))
    layout = tmp_path / "dtwatch" / "ring" / "layout.py"
    layout.write_text(layout.read_text() + "\n\ndef _planted() -> None:\n    from dtwatch import paths  # noqa: F401\n")
    analyze = tmp_path / "dtwatch" / "report" / "analyze.py"
    lazy = "\n\ndef _planted() -> None:\n    import dtwatch.watchdog.watch  # noqa: F401\n"
    analyze.write_text(analyze.read_text() + lazy)
    g = graph(tmp_path)
    found = [" -> ".join(c) for c in cycles(g)]
    assert any("dtwatch.ring.layout -> dtwatch" in f"{c} " and c.startswith("dtwatch ->") for c in found), found
    bad = layering_violations(g)
    assert "dtwatch.report.analyze (the watchdog and the readers) imports dtwatch.watchdog.watch " \
           "(the watchdog and the readers)" in bad, bad
    assert any(b.startswith("dtwatch.ring.layout (base") and "imports dtwatch (the rank side" in b for b in bad), bad


def test_code_that_runs_in_the_rank_never_imports_the_watchdog_side():
    g = graph()
    roots = [m for m in g if in_area(m, RANK_SIDE)]
    leaks = {m: " -> ".join(chain) for m, chain in reachable(g, roots).items() if in_area(m, WATCHDOG_SIDE)}
    assert not leaks, f"training-side code reaches watchdog-side modules: {json.dumps(leaks, indent=1)}"


def test_the_rank_side_import_checked_in_a_real_interpreter():
    code = (
        "import sys, dtwatch, dtwatch.auto, dtwatch.testing\n"
        "from dtwatch.record import installation, recorder, sampling_thread, completion, callsite, launcher, "
        "torchenv\n"
        "import json; print(json.dumps(sorted(m for m in sys.modules if m.startswith('dtwatch'))))\n"
    )
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "DTWATCH": "0"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert "dtwatch.record.installation" in loaded
    assert not [m for m in loaded if in_area(m, WATCHDOG_SIDE)], loaded


def test_no_two_modules_share_a_basename():
    seen: dict[str, list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name not in ("__init__.py", "__main__.py"):
            seen.setdefault(path.name, []).append(str(path.relative_to(REPO)))
    assert not {n: p for n, p in seen.items() if len(p) > 1}, {n: p for n, p in seen.items() if len(p) > 1}


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(REPO)))
def test_no_module_is_too_long_to_read(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(REPO)} has {lines} lines (at most {MAX_LINES}): split it by concern"


def test_the_version_is_stated_once_in_the_package_and_agrees_with_pyproject():
    import re

    import dtwatch
    from dtwatch.version import __version__

    stated = re.search(r'^version = "([^"]+)"$', (REPO / "pyproject.toml").read_text(), re.MULTILINE)
    assert stated is not None and dtwatch.__version__ == __version__ == stated.group(1)


# The words of a diagnosis live in dtwatch/diagnose/wording/; decisions hand it facts and build no sentence
# themselves. Counted as a sentence built: a string literal or f-string of four words or more in a function body;
# docstrings and the messages of exceptions raised (a programming error, never a diagnosis) are not counted.


def sentences_built(path: Path) -> int:
    """String literals and f-strings of four words or more inside the functions of ``path``, docstrings aside."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    parts_of_fstrings = {id(part) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr)
                         for part in ast.walk(node) if part is not node}
    raised = {id(part) for node in ast.walk(tree) if isinstance(node, ast.Raise) for part in ast.walk(node)}
    found: set[int] = set()
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(function):
            if id(node) in docstrings or id(node) in parts_of_fstrings or id(node) in raised:
                continue
            if isinstance(node, ast.JoinedStr):
                text = "".join(str(v.value) for v in node.values if isinstance(v, ast.Constant))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value
            else:
                continue
            if len(text.split()) >= 4:
                found.add(id(node))
    return len(found)


def test_decisions_leave_their_words_to_the_wording_package():
    counts = {path.name: sentences_built(path) for path in sorted((PACKAGE / "diagnose").glob("*.py"))}
    assert len(counts) > 20, counts  # the decision modules were found
    building = {name: n for name, n in counts.items() if n}
    assert not building, f"decisions building sentences (module: count): {building}; hand the facts to " \
                         "dtwatch/diagnose/wording/ instead"


def test_the_sentence_count_sees_sentences(tmp_path):
    planted = tmp_path / "decision.py"
    planted.write_text('def decide(ranks):\n    """A docstring of many words is not a sentence built."""\n'
                       '    if ranks is None:\n        raise ValueError(f"no ranks were given to {decide}")\n'
                      '    return f"{ranks} left the loop early" if ranks else "ok"\n')
    assert sentences_built(planted) == 1
