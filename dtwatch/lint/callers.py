"""Rank tests that a same-file function inherits from its callers.

A helper that runs no rank test of its own still runs only on some ranks when every call of it sits
under one::

    def save(model, step):
        dist.barrier()              # runs on rank 0 only...
    ...
        if rank == 0:
            save(model, step)       # ...because this is the only call of save()

:func:`inherit` maps the lines of such a function's body to the caller's test, named with the call
(``if rank == 0 (calls save() at line 10)``), and follows chains (a helper called only from such a
function) a bounded number of steps. Calls are found with :class:`~dtwatch.lint.local.Definitions`, as
the lint finds them: plain names through the enclosing scopes, ``self.method()``, methods of same-file
instances. Nothing is guessed: a function called anywhere outside a rank test or on both sides of one
(``if rank == 0: save(a) else: save(b)``: every rank calls it), never called, used as a
value (passed, stored, decorating, called from a lambda), decorated (other than by ``staticmethod``,
``torch.no_grad()``...), a dunder method other than ``__init__``, or a method whose name is also
called on a receiver the lint cannot resolve (``super().save()``, ``model.save()``) inherits nothing.
"""
from __future__ import annotations

import ast
from collections.abc import Hashable, Iterator, Mapping
from dataclasses import dataclass, field

from dtwatch.lint import syntax
from dtwatch.lint.local import Context, Definitions, FunctionNode

# Decorators that leave a function called only where the file calls it.
TRANSPARENT_DECORATORS = frozenset({"staticmethod", "classmethod", "no_grad", "inference_mode", "enable_grad"})
MAX_DEPTH = 5  # how many helpers deep a caller's test is followed


@dataclass(frozen=True)
class Gate:
    """A line's rank test: the test's line, its text, and the calls from it down to the line."""

    line: int
    text: str
    calls: tuple[tuple[str, int], ...] = ()  # (call text, line), outermost first
    arm: Hashable = None  # which side of the test: the if's body and its else side differ

    def label(self) -> str:
        if not self.calls:
            return self.text
        return f"{self.text} (calls " + ", which calls ".join(f"{t}() at line {n}" for t, n in self.calls) + ")"


@dataclass
class References:
    """Where the module calls each of its functions, and which functions it also uses otherwise."""

    # (line, "self.save", the scope the call is in: the function itself for a recursive call)
    calls: dict[FunctionNode, list[tuple[int, str, ast.AST]]] = field(default_factory=dict)
    blocked: set[FunctionNode] = field(default_factory=set)
    unresolved_attrs: set[str] = field(default_factory=set)  # x.name(...) on receivers of unknown class


def inherit(tree: ast.Module, defs: Definitions, branches: Mapping[int, tuple[int, str]],
            arms: Mapping[int, Hashable] | None = None, depth: int = MAX_DEPTH) -> dict[int, tuple[int, str]]:
    """``branches`` (line -> (test line, test text)) with the lines of functions called only under rank
    tests added; the lines it has keep their own test. ``arms`` tells the sides of a test apart (line ->
    any key): a function called on both sides of one test runs on every rank and inherits nothing."""
    arms = arms or {}
    gates = {line: Gate(test_line, text, (), arms.get(line)) for line, (test_line, text) in branches.items()}
    refs = _references(tree, defs)
    methods = {fn for table in defs.methods.values() for fn in table.values()}
    candidates = sorted((fn for fn, sites in refs.calls.items() if sites and _eligible(fn, refs, methods)),
                        key=lambda fn: (fn.lineno, fn.col_offset))
    done: set[FunctionNode] = set()
    for _ in range(depth):
        snapshot, added = dict(gates), False  # one step of the chain per round: the depth is bounded
        for function in candidates:
            if function in done:
                continue
            sites = [(line, text) for line, text, scope in refs.calls[function] if scope is not function]
            if not sites or any(line not in snapshot for line, _ in sites):
                continue  # a recursive call (above) runs under whatever the first call runs under
            sides = {(snapshot[line].line, snapshot[line].arm) for line, _ in sites}
            if len(sides) > len({test for test, _ in sides}):
                continue  # called from both sides of one test: every rank calls it
            line, text = min(sites)
            caller = snapshot[line]
            gate = Gate(caller.line, caller.text, (*caller.calls, (text, line)), caller.arm)
            for body_line in _body_lines(function):
                gates.setdefault(body_line, gate)
            done.add(function)
            added = True
        if not added:
            break
    return {line: (gate.line, gate.label()) for line, gate in gates.items()}


def _eligible(function: FunctionNode, refs: References, methods: set[FunctionNode]) -> bool:
    if function in refs.blocked:
        return False
    name = function.name
    if name.startswith("__") and name.endswith("__") and name != "__init__":
        return False  # run by the language (obj(), with, iteration...), not by a call the file shows
    if function in methods and name in refs.unresolved_attrs:
        return False  # maybe called on an instance the lint cannot see: self.name() in a base class, super()
    for decorator in function.decorator_list:
        if syntax.tail(decorator.func if isinstance(decorator, ast.Call) else decorator) not in TRANSPARENT_DECORATORS:
            return False  # the decorator receives the function as a value
    return True


def _references(tree: ast.Module, defs: Definitions) -> References:
    refs = References()
    imported = _imported_names(tree)
    for scope, context in defs.contexts.items():
        if not isinstance(scope, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node, as_value, callee in _scope_nodes(scope.body):
            _note(scope, node, as_value, callee, context, defs, imported, refs)
    return refs


def _note(scope: ast.AST, node: ast.AST, as_value: bool, callee: bool, context: Context, defs: Definitions,
          imported: set[str], refs: References) -> None:
    """Record ``node`` if it names a same-file function: a call site, or a use as a value."""
    if isinstance(node, ast.Call):
        target = defs.target(node.func, context)
        if target is not None and not as_value:
            refs.calls.setdefault(target, []).append((node.lineno, _text(node.func), scope))
        return
    if not isinstance(node, (ast.Name, ast.Attribute)) or not isinstance(node.ctx, ast.Load):
        return
    target = defs.target(node, context)
    if target is not None:
        if as_value or not callee:
            refs.blocked.add(target)
    elif isinstance(node, ast.Attribute):
        receiver = syntax.dotted(node.value)
        if receiver is None or receiver.split(".")[0] not in imported:  # not a module: maybe an instance
            refs.unresolved_attrs.add(node.attr)


def _scope_nodes(body: list[ast.stmt]) -> Iterator[tuple[ast.AST, bool, bool]]:
    """Each node that runs with ``body`` (nested functions' and classes' decorators, defaults and bases
    included, their bodies not), whether it runs later, as a value (inside a lambda), and whether it is
    what a call calls."""
    stack: list[tuple[ast.AST, bool]] = [(node, False) for node in reversed(body)]
    callees: set[ast.AST] = set()
    while stack:
        node, as_value = stack.pop()
        yield node, as_value, node in callees
        if isinstance(node, ast.Call):
            callees.add(node.func)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            children: list[ast.AST] = [*node.decorator_list, node.args, *([node.returns] if node.returns else [])]
        elif isinstance(node, ast.ClassDef):
            children = [*node.decorator_list, *node.bases, *node.keywords]
        elif isinstance(node, ast.Lambda):
            stack += [(node.args, as_value), (node.body, True)]
            continue
        else:
            children = list(ast.iter_child_nodes(node))
        stack += [(child, as_value) for child in reversed(children)]


def _imported_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def _text(func: ast.expr) -> str:
    return syntax.dotted(func) or syntax.shorten(ast.unparse(func))


def _body_lines(function: FunctionNode) -> set[int]:
    """The lines the function's body runs, as the walk marks them: a compound statement's first line, a
    simple one's all; nested functions' and lambdas' bodies not (they run where they are called)."""
    lines: set[int] = set()
    stack: list[ast.AST] = list(function.body)
    while stack:
        node = stack.pop()
        first = getattr(node, "lineno", None)
        if first is not None:
            last = first if hasattr(node, "body") else getattr(node, "end_lineno", None) or first
            lines.update(range(first, last + 1))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            stack += [*node.decorator_list, node.args, *([node.returns] if node.returns else [])]
        elif isinstance(node, ast.Lambda):
            stack.append(node.args)
        else:
            stack += ast.iter_child_nodes(node)
    return lines
