"""The functions and methods a module defines, and which of them a call in that module reaches.

The lint looks inside a call to the user's own code only when it can see that code: a function of the
same file (``save_all(...)``, found through the enclosing scopes), a method of the class it runs in
(``self.save(...)``, same-file base classes included), or a method of a same-file class whose instance
the module builds by name (``checkpointer = Checkpointer(...)`` then ``checkpointer.save(...)``, or
``self.ckpt = Checkpointer(...)`` then ``self.ckpt.save(...)``). Nothing is guessed from a name alone:
``checkpointer.save(...)`` on an object of unknown class reaches nothing.
"""
from __future__ import annotations

import ast
from collections.abc import Mapping
from dataclasses import dataclass, field

from dtwatch.lint.syntax import walk_scope

FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef


@dataclass(frozen=True)
class Table:
    """One scope's names: the functions it defines, and the other names it binds (which hide an
    enclosing scope's function of the same name: ``def train(evaluate): evaluate()``)."""

    functions: Mapping[str, FunctionNode]
    bound: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Context:
    """What names mean inside one scope's body."""

    functions: tuple[Table, ...] = ()  # the functions each enclosing scope defines, innermost first
    cls: ast.ClassDef | None = None  # the class whose method this is: what ``self`` is
    self_name: str | None = None  # the method's first parameter (``self``, ``cls``)


@dataclass
class Definitions:
    """A module's functions, classes and instances of its classes, indexed once per module."""

    contexts: dict[ast.AST, Context] = field(default_factory=dict)  # module, function or class node
    classes: dict[str, ast.ClassDef] = field(default_factory=dict)
    methods: dict[ast.ClassDef, Mapping[str, FunctionNode]] = field(default_factory=dict)
    qualnames: dict[FunctionNode, str] = field(default_factory=dict)
    instances: dict[str, ast.ClassDef] = field(default_factory=dict)  # name = SameFileClass(...)
    attr_instances: dict[str, ast.ClassDef] = field(default_factory=dict)  # self.name = SameFileClass(...)

    @classmethod
    def of(cls, tree: ast.Module) -> Definitions:
        defs = cls()
        defs._index(tree)
        defs.instances, defs.attr_instances = defs._instances(tree)
        return defs

    def target(self, func: ast.expr, context: Context) -> FunctionNode | None:
        """The same-file function that calling ``func`` runs, when the module shows which one."""
        if isinstance(func, ast.Name):
            for table in context.functions:
                if func.id in table.functions:
                    return table.functions[func.id]
                if func.id in table.bound:
                    return None
            constructed = self.classes.get(func.id)  # SameFileClass(...) runs its __init__
            return self.method(constructed, "__init__") if constructed is not None else None
        if not isinstance(func, ast.Attribute):
            return None
        receiver, owner = func.value, None
        if isinstance(receiver, ast.Name):
            if receiver.id == context.self_name:
                owner = context.cls
            else:
                owner = self.classes.get(receiver.id) or self.instances.get(receiver.id)
        elif (isinstance(receiver, ast.Attribute) and isinstance(receiver.value, ast.Name)
              and receiver.value.id == context.self_name):
            owner = self.attr_instances.get(receiver.attr)
        return self.method(owner, func.attr) if owner is not None else None

    def method(self, owner: ast.ClassDef, name: str) -> FunctionNode | None:
        """``owner.name``, looked up in ``owner`` and then in its same-file base classes."""
        seen: set[ast.ClassDef] = set()
        queue = [owner]
        while queue:
            current = queue.pop(0)
            if current in seen:
                continue
            seen.add(current)
            found = self.methods.get(current, {}).get(name)
            if found is not None:
                return found
            queue += [self.classes[b.id] for b in current.bases if isinstance(b, ast.Name) and b.id in self.classes]
        return None

    def _index(self, tree: ast.Module) -> None:
        self.contexts[tree] = Context((_table(tree),))
        self.classes = {n.name: n for n in walk_scope(tree.body) if isinstance(n, ast.ClassDef)}
        # (scope node, the context its body sees, qualified-name prefix)
        stack: list[tuple[ast.Module | FunctionNode | ast.ClassDef, Context, str]] = [(tree, self.contexts[tree], "")]
        while stack:
            scope, context, prefix = stack.pop()
            for child in walk_scope(scope.body):
                if isinstance(child, ast.ClassDef):
                    self.methods[child] = _table(child).functions
                    self.contexts[child] = Context(context.functions)
                    stack.append((child, self.contexts[child], f"{prefix}{child.name}."))
                elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    self.qualnames[child] = prefix + child.name
                    enclosing = context.functions  # a class body's names are not seen from its methods
                    owner = scope if isinstance(scope, ast.ClassDef) else None
                    self_name = _self_name(child) if owner is not None else None
                    self.contexts[child] = Context((_table(child), *enclosing), owner, self_name)
                    stack.append((child, self.contexts[child], f"{prefix}{child.name}."))

    def _instances(self, tree: ast.Module) -> tuple[dict[str, ast.ClassDef], dict[str, ast.ClassDef]]:
        """Names and ``self.`` attributes assigned an instance of one same-file class (and no other)."""
        names: dict[str, set[ast.ClassDef]] = {}
        attrs: dict[str, set[ast.ClassDef]] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                targets, value = [node.target], node.value
            else:
                continue
            if not (isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in self.classes):
                continue
            constructed = self.classes[value.func.id]
            for target in targets:
                if isinstance(target, ast.Name):
                    names.setdefault(target.id, set()).add(constructed)
                elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
                    attrs.setdefault(target.attr, set()).add(constructed)
        return ({k: next(iter(v)) for k, v in names.items() if len(v) == 1},
                {k: next(iter(v)) for k, v in attrs.items() if len(v) == 1})


def _table(scope: ast.Module | FunctionNode | ast.ClassDef) -> Table:
    """The functions a scope's body defines (in ifs and trys too, not in nested functions), and the
    other names it binds: parameters, assignment, loop, ``with``/``except`` targets, imports."""
    functions: dict[str, FunctionNode] = {}
    bound: set[str] = set()
    if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
        bound |= {a.arg for a in ast.walk(scope.args) if isinstance(a, ast.arg)}
    for node in walk_scope(scope.body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            functions[node.name] = node
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return Table(functions, frozenset(bound - set(functions)))


def _self_name(function: FunctionNode) -> str | None:
    if any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in function.decorator_list):
        return None
    positional = [*function.args.posonlyargs, *function.args.args]
    return positional[0].arg if positional else None
