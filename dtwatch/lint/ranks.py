"""Whether an expression tests the rank, and which names in a scope stand for a rank.

A test is rank-conditional when it mentions a rank: a name whose last word is ``rank``, one of
``RANK_NAMES``, an environment lookup of ``RANK``/``SLURM_PROCID``..., or a local name assigned from one
of those (``is_main = rank == 0``). Names for another rank (``src_rank``), ``for`` loop variables,
``dist.get_global_rank(group, 0)`` and ``local_rank == -1`` / ``rank is None`` do not count: they are
the same on every rank. See :mod:`dtwatch.lint.checker` for the whole rule.
"""
from __future__ import annotations

import ast
import re
from collections.abc import Mapping

from dtwatch.lint.syntax import tail, walk_scope
from dtwatch.lint.vocabulary import (
    CONVERSIONS,
    OTHER_RANK_WORDS,
    RANK_ENV_KEYS,
    RANK_NAMES,
    RANK_TRANSLATIONS,
)

# A scope whose names and ifs are its own.
Scope = ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
_WORD_BREAK = re.compile(r"_+|(?<=[a-z0-9])(?=[A-Z])")


def mentions_rank(node: ast.AST, names: Mapping[str, bool], through_calls: bool = True) -> bool:
    """Whether an expression depends on the rank. ``names`` overrides the name rule for this scope
    (see scope_names). With ``through_calls=False`` a call counts only if it is a rank getter or a
    conversion of one (``int(os.environ["RANK"])``), not ``f(rank)``."""
    stack = [node]  # iterative: generated code nests "a + b + ..." deeper than the recursion limit
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Name):
            if names[node.id] if node.id in names else is_rank_name(node.id):
                return True
            continue
        if isinstance(node, ast.Attribute):
            if is_rank_name(node.attr) or names.get("." + node.attr):
                return True
            stack.append(node.value)
            continue
        key = env_key(node)
        if key is not None:
            if is_rank_name(key) or key in RANK_ENV_KEYS:
                return True
            continue
        if isinstance(node, (ast.Lambda, ast.Constant)) or is_sentinel_check(node):
            continue
        if isinstance(node, ast.Call):
            arguments = [*node.args, *(keyword.value for keyword in node.keywords)]
            if tail(node.func) in RANK_TRANSLATIONS and len(arguments) >= 2:  # get_global_rank(group, 0)
                stack += arguments
                continue
            if not through_calls:
                stack.append(node.func)
                if tail(node.func) in CONVERSIONS:
                    stack += node.args
                continue
        stack.extend(ast.iter_child_nodes(node))
    return False


def rank_subjects(test: ast.expr, names: Mapping[str, bool]) -> frozenset[str]:
    """The rank references a test reads, as text: ``{"local_rank"}`` for ``local_rank not in [-1, 0]``."""
    return frozenset(
        ast.unparse(node) for node in ast.walk(test)
        if mentions_rank(node, names) and not any(mentions_rank(c, names) for c in ast.iter_child_nodes(node))
    )


def negated(test: ast.expr, names: Mapping[str, bool]) -> bool:
    """Whether a rank test reads "not this rank" (``not``, ``!=``, ``not in``, ``>``): pairs up the
    two ifs of "rank 0 goes first"."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return not negated(test.operand, names)
    if isinstance(test, ast.BoolOp):
        return any(negated(value, names) for value in test.values if mentions_rank(value, names))
    negative = (ast.NotEq, ast.NotIn, ast.IsNot, ast.Gt, ast.GtE)
    return isinstance(test, ast.Compare) and isinstance(test.ops[0], negative)


def is_rank_name(name: str) -> bool:
    """``rank``, ``local_rank``, ``RANK``, ``myRank``, ``get_rank`` and RANK_NAMES; not ``rankings``,
    nor ``src_rank`` and the like (OTHER_RANK_WORDS)."""
    if name.lower() in RANK_NAMES:
        return True
    words = [word.lower() for word in _WORD_BREAK.split(name) if word]
    return bool(words) and words[-1] == "rank" and (len(words) == 1 or words[-2] not in OTHER_RANK_WORDS)


def env_key(node: ast.AST) -> str | None:
    """The key of ``os.environ["K"]``, ``os.environ.get("K")`` or ``os.getenv("K")``."""
    if isinstance(node, ast.Subscript) and tail(node.value) == "environ":
        key = node.slice
    elif isinstance(node, ast.Call) and node.args and (
        tail(node.func) == "getenv"
        or (isinstance(node.func, ast.Attribute) and node.func.attr in ("get", "pop")
            and tail(node.func.value) == "environ")
    ):
        key = node.args[0]
    else:
        return None
    return key.value if isinstance(key, ast.Constant) and isinstance(key.value, str) else None


def is_sentinel_check(node: ast.AST) -> bool:
    """``local_rank == -1`` / ``rank is None``: "is this run distributed?", alike on every rank."""
    if not (isinstance(node, ast.Compare) and len(node.ops) == 1
            and isinstance(node.ops[0], (ast.Eq, ast.NotEq, ast.Is, ast.IsNot))):
        return False
    right = node.comparators[0]
    if isinstance(right, ast.Constant):
        return right.value is None
    return (isinstance(right, ast.UnaryOp) and isinstance(right.op, ast.USub)
            and isinstance(right.operand, ast.Constant) and type(right.operand.value) is int
            and right.operand.value == 1)


def scope_names(scope: Scope, inherited: Mapping[str, bool]) -> dict[str, bool]:
    """A scope's exceptions to the name rule: names assigned from a rank expression are rank-ish
    (``is_main = rank == 0``), ``for`` loop variables are not (``for peer_rank in ranks``: the same
    on every rank). Enclosing scopes' exceptions hold unless this scope binds the name itself."""
    pairs, loop_vars = [], set()
    for node in walk_scope(scope.body):
        if isinstance(node, ast.Assign):
            pairs += [(t.id, node.value) for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
            if isinstance(node.target, ast.Name):
                pairs.append((node.target.id, node.value))
        elif isinstance(node, (ast.For, ast.AsyncFor)):
            loop_vars |= {n.id for n in ast.walk(node.target) if isinstance(n, ast.Name)}
    params: set[str] = set()
    if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
        params = {a.arg for a in ast.walk(scope.args) if isinstance(a, ast.arg)}
    assigned = params | loop_vars | {name for name, _ in pairs}
    names = {name: value for name, value in inherited.items() if name not in assigned}
    names.update(dict.fromkeys(loop_vars, False))
    changed = True
    while changed:
        changed = False
        for name, value in pairs:
            if not names.get(name) and mentions_rank(value, names, through_calls=False):
                names[name] = True
                changed = True
    return names


def rank_attributes(tree: ast.Module) -> frozenset[str]:
    """Attributes assigned a rank anywhere in the module: ``self.gpu_id = int(os.environ["LOCAL_RANK"])``
    makes ``self.gpu_id == 0`` a rank test in every method."""
    attrs: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and mentions_rank(node.value, {}, through_calls=False):
            attrs.update(t.attr for t in node.targets if isinstance(t, ast.Attribute))
    return frozenset(attrs)
