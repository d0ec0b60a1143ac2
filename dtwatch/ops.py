"""The ``torch.distributed`` functions dtwatch knows: one table for the recorder, the ring and the lint.

Each row of :data:`TABLE` names a function and says

* its **ring op code** (the number a record stores; part of the ring format, so codes are never
  renumbered or reused: append new ops with the next free code), or ``None`` when it is never recorded;
* how the **recorder** reads a call (:class:`OpKind`: where its payload, group and peer are), or
  ``None`` when it is not wrapped;
* why every rank must call it, which is what makes it a **collective for the lint**
  (``dtwatch lint`` reports it inside rank-conditional code), or ``""`` when the lint ignores it.

Everything else here is derived from the table: :data:`OPS` / :data:`OP_CODES` (the ring's op names by
code), :data:`OP_KINDS` (what the recorder wraps), :data:`LINT_COLLECTIVES`, :data:`P2P_NAMES`.

Argument positions are read from the installed torch's signatures at install time (cold path, :func:`bind`),
so the same table serves every torch version; a function missing from the installed torch is skipped.

This module imports nothing from dtwatch: the ring format imports it (record flags, op codes).
"""
from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

# How an op's payload is described in its record.
TENSOR, TENSOR_LIST, OBJECT, NOTHING, P2P_OPS = range(5)

# Bits of a ring record's ``flags`` that describe the op itself, not the call (the ring format,
# dtwatch.ring.layout, adds the call's own bits and re-exports these with them).
FLAG_OBJECT = 2  # pickled Python objects: no tensor shape to compare
FLAG_P2P = 4  # point to point: one peer, not the whole group
FLAG_COALESCED = 8  # several tensors or ops in one call


@dataclass(frozen=True)
class OpKind:
    """How the recorder reads a call of one op."""

    payload: int  # TENSOR / TENSOR_LIST / OBJECT / NOTHING / P2P_OPS
    payload_arg: str | None  # parameter describing the payload (the input, where there are two)
    flags: int = 0  # FLAG_OBJECT / FLAG_P2P / FLAG_COALESCED
    peer_arg: str | None = None  # p2p: the peer's global rank
    always_async: bool = False  # returns Work without an async_op parameter (isend/irecv/batch)
    composite: bool = False  # issues other (wrapped) torch.distributed calls itself: record once


@dataclass(frozen=True)
class OpEntry:
    """One row of :data:`TABLE`."""

    name: str
    code: int | None  # the ring's op code; None: never recorded
    kind: OpKind | None  # how the recorder wraps it; None: not wrapped
    blocks: str = ""  # why every rank (or the peer) must call it; "": not a collective for the lint
    common_name: bool = False  # lint: other libraries use the name too (functools.reduce, asyncio.gather)

    @property
    def p2p(self) -> bool:
        return self.kind is not None and bool(self.kind.flags & FLAG_P2P)


_OBJ, _P2P, _COAL = FLAG_OBJECT, FLAG_P2P, FLAG_COALESCED

# Object collectives, send/recv and batch p2p are composite: the calls they make internally are not
# recorded twice. torch >= 2.13 spells all_gather_into_tensor / reduce_scatter_tensor as
# all_gather_single / reduce_scatter_single; the old names delegate to the new ones, so they are
# composite (recorded once, under the name the caller used).
TABLE: tuple[OpEntry, ...] = (
    OpEntry("unknown", 0, None),  # a record whose op this reader does not know
    OpEntry("step", 1, None),  # a step marker, not a call
    OpEntry("all_reduce", 2, OpKind(TENSOR, "tensor"), "every rank contributes to and receives the reduction"),
    OpEntry("all_gather", 3, OpKind(TENSOR, "tensor"), "every rank contributes to and receives every tensor"),
    OpEntry("all_gather_into_tensor", 4, OpKind(TENSOR, "input_tensor", composite=True),
        "all_gather into one output tensor"),
    OpEntry("all_gather_object", 5, OpKind(OBJECT, "obj", _OBJ, composite=True),
        "pickles and all-gathers Python objects"),
    OpEntry("all_to_all", 6, OpKind(TENSOR_LIST, "input_tensor_list"),
        "every rank exchanges a chunk with every other rank"),
    OpEntry("all_to_all_single", 7, OpKind(TENSOR, "input"), "all_to_all on one flat tensor"),
    OpEntry("barrier", 8, OpKind(NOTHING, None), "returns only once every rank has arrived"),
    OpEntry("monitored_barrier", 9, OpKind(NOTHING, None), "a barrier that names the missing ranks after its timeout"),
    OpEntry("broadcast", 10, OpKind(TENSOR, "tensor"), "the source sends, every other rank must receive",
        common_name=True),
    OpEntry("broadcast_object_list", 11, OpKind(OBJECT, "object_list", _OBJ, composite=True),
        "the source sends, every other rank must receive"),
    OpEntry("gather", 12, OpKind(TENSOR, "tensor"),
        "every rank sends to the destination (accelerator.gather: to all)", common_name=True),
    OpEntry("gather_object", 13, OpKind(OBJECT, "obj", _OBJ, composite=True),
        "every rank sends to the destination, which waits for all"),
    OpEntry("scatter", 14, OpKind(TENSOR, "tensor"), "the source sends each rank its chunk", common_name=True),
    OpEntry("scatter_object_list", 15, OpKind(OBJECT, "scatter_object_output_list", _OBJ, composite=True),
        "the source sends, every other rank must receive"),
    OpEntry("reduce", 16, OpKind(TENSOR, "tensor"),
        "every rank sends to the destination (accelerator.reduce: to all)", common_name=True),
    OpEntry("reduce_scatter", 17, OpKind(TENSOR, "output"), "reduces, then hands every rank its chunk"),
    OpEntry("reduce_scatter_tensor", 18, OpKind(TENSOR, "input", composite=True), "reduce_scatter into one tensor"),
    # send/recv are isend/irecv + wait in torch: composite, so the inner call is not recorded again.
    OpEntry("send", 19, OpKind(TENSOR, "tensor", _P2P, peer_arg="dst", composite=True),
        "blocks until the destination posts the matching recv", common_name=True),
    OpEntry("recv", 20, OpKind(TENSOR, "tensor", _P2P, peer_arg="src", composite=True),
        "blocks until the source posts the matching send", common_name=True),
    OpEntry("isend", 21, OpKind(TENSOR, "tensor", _P2P, peer_arg="dst", always_async=True),
        "the destination must post the matching recv", common_name=True),
    OpEntry("irecv", 22, OpKind(TENSOR, "tensor", _P2P, peer_arg="src", always_async=True),
        "the source must post the matching send", common_name=True),
    OpEntry("batch_isend_irecv", 23,
        OpKind(P2P_OPS, "p2p_op_list", _P2P | _COAL, always_async=True, composite=True),
        "batched isend/irecv; peers must post the matching ops"),
    OpEntry("all_reduce_coalesced", 24, OpKind(TENSOR_LIST, "tensors", _COAL), "all_reduce over a list of tensors"),
    OpEntry("all_gather_coalesced", 25, OpKind(TENSOR_LIST, "input_tensor_list", _COAL),
        "all_gather over a list of tensors"),
    OpEntry("_all_gather_base", 26, OpKind(TENSOR, "input_tensor", composite=True),
        "older name of all_gather_into_tensor"),
    OpEntry("_reduce_scatter_base", 27, OpKind(TENSOR, "input", composite=True), "older name of reduce_scatter_tensor"),
    OpEntry("send_object_list", 28, OpKind(OBJECT, "object_list", _OBJ | _P2P, peer_arg="dst", composite=True),
        "send of pickled objects"),
    OpEntry("recv_object_list", 29, OpKind(OBJECT, "object_list", _OBJ | _P2P, peer_arg="src", composite=True),
        "recv of pickled objects"),
    # Codes kept for ProcessGroup-level coalesced calls; no wrapper records them today.
    OpEntry("all_gather_into_tensor_coalesced", 30, None),
    OpEntry("reduce_scatter_tensor_coalesced", 31, None),
    OpEntry("_broadcast_coalesced", 32, None),
    OpEntry("all_gather_single", 33, OpKind(TENSOR, "input_tensor"), "all_gather into one output tensor"),
    OpEntry("reduce_scatter_single", 34, OpKind(TENSOR, "input"), "reduce_scatter into one tensor"),
    # Not recorded (no ring code), but every rank of the group must call them.
    OpEntry("new_group", None, None, "every rank of the default group must call it, even ranks left out"),
    OpEntry("new_subgroups", None, None, "builds groups with new_group: every rank must call it"),
    OpEntry("new_subgroups_by_enumeration", None, None, "builds groups with new_group: every rank must call it"),
    OpEntry("init_process_group", None, None, "a rendezvous: blocks until every rank has joined"),
    OpEntry("destroy_process_group", None, None, "tears the group down; every rank must call it"),
)

BY_NAME: dict[str, OpEntry] = {op.name: op for op in TABLE}


def _ops_by_code(table: tuple[OpEntry, ...]) -> tuple[str, ...]:
    """The ring's op names, indexed by code; the codes must be 0, 1, 2... with no gap or repeat."""
    coded = sorted((op.code, op.name) for op in table if op.code is not None)
    if [code for code, _ in coded] != list(range(len(coded))):
        raise ValueError(f"ring op codes must be 0..{len(coded) - 1}, each once: {coded}")
    return tuple(name for _, name in coded)


# The ring's op names by code, and back.
OPS: tuple[str, ...] = _ops_by_code(TABLE)
OP_CODES: dict[str, int] = {name: code for code, name in enumerate(OPS)}
# What the recorder wraps, in table order.
OP_KINDS: dict[str, OpKind] = {op.name: op.kind for op in TABLE if op.kind is not None}
# What the lint counts as a collective (or, for p2p ops, reports on request).
LINT_COLLECTIVES: tuple[OpEntry, ...] = tuple(op for op in TABLE if op.blocks)

# Point-to-point ops, by name (the rest are collectives).
P2P_NAMES = frozenset(op.name for op in TABLE if op.p2p)
# Collectives whose recorded tensor must have the same shape on every rank (all_to_all's splits, gather's
# and scatter's root-only lists and object collectives legitimately differ).
SAME_SHAPE_OPS = frozenset({
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_single", "all_gather_into_tensor",
    "_all_gather_base", "reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base",
})


@dataclass(frozen=True)
class OpSpec:
    """An :class:`OpKind` bound to the installed function's parameter positions."""

    name: str
    code: int
    kind: OpKind
    payload_pos: int
    group_pos: int
    async_pos: int  # -1: no async_op parameter
    peer_pos: int

    @property
    def returns_before_completion(self) -> bool:
        """Whether a synchronous call returns before it completes on a tracked group (NCCL): collectives, except
        a barrier (it blocks the CPU on NCCL too) and object collectives (they copy the result to the CPU, which
        synchronises). Synchronous p2p ops are stamped when they return: their completion is not tracked."""
        return not (self.kind.flags & (FLAG_P2P | FLAG_OBJECT) or self.name in ("barrier", "monitored_barrier"))

    @property
    def spans_several(self) -> bool:
        """Whether the call may use other than exactly one group sequence number."""
        return self.kind.composite or bool(self.kind.flags & (FLAG_P2P | FLAG_COALESCED))


def bind(name: str, fn: Callable) -> OpSpec | None:
    """Locate ``fn``'s parameters for op ``name``; ``None`` if the signature is not understood."""
    kind = OP_KINDS[name]
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None

    def pos(param: str | None) -> int:
        return params.index(param) if param in params else -1

    payload_pos = pos(kind.payload_arg)
    if kind.payload_arg is not None and payload_pos < 0:
        return None
    return OpSpec(
        name=name, code=OP_CODES[name], kind=kind, payload_pos=payload_pos, group_pos=pos("group"),
        async_pos=pos("async_op"), peer_pos=pos(kind.peer_arg),
    )
