"""Which ``torch.distributed`` functions are recorded, and where each keeps its group, tensors and flags.

Argument positions are read from the installed torch's signatures at install time (cold path), so the
same table serves every torch version; a function missing from the installed torch is skipped.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

from dtwatch.ring import FLAG_COALESCED, FLAG_OBJECT, FLAG_P2P, OP_CODES

# How an op's payload is described in its record.
TENSOR, TENSOR_LIST, OBJECT, NOTHING, P2P_OPS = range(5)


@dataclass(frozen=True)
class OpKind:
    payload: int  # TENSOR / TENSOR_LIST / OBJECT / NOTHING / P2P_OPS
    payload_arg: str | None  # parameter describing the payload (the input, where there are two)
    flags: int = 0
    peer_arg: str | None = None  # p2p: the peer's global rank
    always_async: bool = False  # returns Work without an async_op parameter (isend/irecv/batch)
    composite: bool = False  # issues other (wrapped) torch.distributed calls itself: record once


# One entry per public (and still-used private) function. Object collectives and batch p2p are
# composite: the calls they make internally are not recorded twice.
OP_KINDS: dict[str, OpKind] = {
    "all_reduce": OpKind(TENSOR, "tensor"),
    "all_gather": OpKind(TENSOR, "tensor"),
    # torch >= 2.13 spells these all_gather_single / reduce_scatter_single; the old names delegate to
    # the new ones, so they are composite (recorded once, under the name the caller used).
    "all_gather_single": OpKind(TENSOR, "input_tensor"),
    "all_gather_into_tensor": OpKind(TENSOR, "input_tensor", composite=True),
    "_all_gather_base": OpKind(TENSOR, "input_tensor", composite=True),
    "all_gather_object": OpKind(OBJECT, "obj", FLAG_OBJECT, composite=True),
    "all_to_all": OpKind(TENSOR_LIST, "input_tensor_list"),
    "all_to_all_single": OpKind(TENSOR, "input"),
    "barrier": OpKind(NOTHING, None),
    "monitored_barrier": OpKind(NOTHING, None),
    "broadcast": OpKind(TENSOR, "tensor"),
    "broadcast_object_list": OpKind(OBJECT, "object_list", FLAG_OBJECT, composite=True),
    "gather": OpKind(TENSOR, "tensor"),
    "gather_object": OpKind(OBJECT, "obj", FLAG_OBJECT, composite=True),
    "scatter": OpKind(TENSOR, "tensor"),
    "scatter_object_list": OpKind(OBJECT, "scatter_object_output_list", FLAG_OBJECT, composite=True),
    "reduce": OpKind(TENSOR, "tensor"),
    "reduce_scatter": OpKind(TENSOR, "output"),
    "reduce_scatter_single": OpKind(TENSOR, "input"),
    "reduce_scatter_tensor": OpKind(TENSOR, "input", composite=True),
    "_reduce_scatter_base": OpKind(TENSOR, "input", composite=True),
    # send/recv are isend/irecv + wait in torch: composite, so the inner call is not recorded again.
    "send": OpKind(TENSOR, "tensor", FLAG_P2P, peer_arg="dst", composite=True),
    "recv": OpKind(TENSOR, "tensor", FLAG_P2P, peer_arg="src", composite=True),
    "isend": OpKind(TENSOR, "tensor", FLAG_P2P, peer_arg="dst", always_async=True),
    "irecv": OpKind(TENSOR, "tensor", FLAG_P2P, peer_arg="src", always_async=True),
    "batch_isend_irecv": OpKind(P2P_OPS, "p2p_op_list", FLAG_P2P | FLAG_COALESCED, always_async=True, composite=True),
    "send_object_list": OpKind(OBJECT, "object_list", FLAG_OBJECT | FLAG_P2P, peer_arg="dst", composite=True),
    "recv_object_list": OpKind(OBJECT, "object_list", FLAG_OBJECT | FLAG_P2P, peer_arg="src", composite=True),
    "all_reduce_coalesced": OpKind(TENSOR_LIST, "tensors", FLAG_COALESCED),
    "all_gather_coalesced": OpKind(TENSOR_LIST, "input_tensor_list", FLAG_COALESCED),
}


# Point-to-point ops, by name (the rest are collectives).
P2P_NAMES = frozenset(name for name, kind in OP_KINDS.items() if kind.flags & FLAG_P2P)
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
