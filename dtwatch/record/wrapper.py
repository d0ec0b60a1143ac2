"""The one recording path every wrapped ``torch.distributed`` function goes through (the hot path).

:func:`make_wrapper` binds what is specific to an op (its :class:`~dtwatch.ops.OpSpec`) once; the wrapper
it returns writes one fixed-size record into this rank's ring before calling the original and stamps the
record's exit after. Nothing else happens on that path: no lock, no I/O, no allocation beyond a few small
objects. Everything it reads per call is a local bound here or one attribute of the :class:`Recorder`
(``mm``, ``default_pg``, ``site_positions``, ``stamps``, ``records_off``, ``capacity``, ``step``); a change
here is timed by ``benchmarks/overhead.py`` ("hot path alone").

It never changes arguments or results and never raises into the caller: a failure of its own disables
recording for that call and produces one warning per process (:meth:`Recorder.fail`).
"""
from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable
from types import CodeType
from typing import TYPE_CHECKING, Any

import torch

from dtwatch.ops import NOTHING, OBJECT, P2P_OPS, TENSOR, OpSpec
from dtwatch.ring import (
    DTYPE_CODES,
    FLAG_ASYNC,
    FLAG_ENQUEUED,
    FLAG_P2P,
    NUMEL_FROM_SHAPE,
    RECORD_ENTRY_BY_NDIM,
    RECORD_EXIT,
    RECORD_EXIT_OFFSET,
    RECORD_SIZE,
    STATUS_ERROR,
    STATUS_OK,
)

if TYPE_CHECKING:
    from dtwatch.record.recorder import Recorder

DTYPE_CODES_BY_TORCH: dict[torch.dtype, int] = {}  # torch's dtypes -> the ring's codes
for _name, _code in DTYPE_CODES.items():
    _dt = getattr(torch, _name, None)
    if isinstance(_dt, torch.dtype):
        DTYPE_CODES_BY_TORCH[_dt] = _code


def _never() -> bool:
    return False


def _none() -> None:
    return None


def make_wrapper(rec: Recorder, original: Callable[..., Any], spec: OpSpec) -> Callable[..., Any]:
    """The one recording path. Everything specific to an op is in ``spec``, bound here once."""
    op, payload, flags = spec.code, spec.kind.payload, spec.kind.flags
    # "" where the op has no such parameter: kwargs.get("") is None, as for any name not passed.
    ppos, pname = spec.payload_pos, spec.kind.payload_arg or ""
    gpos, apos, peer_pos, peer_name = spec.group_pos, spec.async_pos, spec.peer_pos, spec.kind.peer_arg or ""
    always_async, composite, spans = spec.kind.always_async, spec.kind.composite, spec.spans_several
    is_p2p, tracked_sync = bool(flags & FLAG_P2P), spec.returns_before_completion
    tls, groups, dtypes = rec.tls, rec.groups, DTYPE_CODES_BY_TORCH
    # With the native path loaded, a call it is recording (a composite's inner calls) is its own, and a composite
    # recorded here tells it the same (dtwatch.record.native).
    fastpath = rec.fastpath
    inside, enter, leave = (fastpath.inside, fastpath.enter, fastpath.leave) if fastpath else (_never, _none, _none)
    entries, exit_pack, now, getframe = RECORD_ENTRY_BY_NDIM, RECORD_EXIT.pack_into, time.time, sys._getframe

    @functools.wraps(original)
    def dtwatch_recorded(*args: Any, **kwargs: Any) -> Any:
        mm = rec.mm
        if mm is None or tls.busy or inside():
            return original(*args, **kwargs)
        off = -1
        try:
            nargs = len(args)
            group = args[gpos] if 0 <= gpos < nargs else kwargs.get("group")
            ntensors, peer = 1, -1
            if payload == TENSOR:
                t: Any = args[ppos] if ppos < nargs else kwargs.get(pname)  # (annotations cost nothing here)
                shape = t.shape
                ndim, dt = len(shape), dtypes.get(t.dtype, 0)
                numel = NUMEL_FROM_SHAPE if ndim <= 4 else t.numel()  # the reader derives it from the dims
            elif payload == NOTHING:
                shape, ndim, numel, dt = (), 0, 0, 0
            elif payload == OBJECT:
                shape, ndim, numel, dt = (), 0, -1, 0
            else:  # TENSOR_LIST / P2P_OPS: describe the first, count them all
                items: Any = args[ppos] if ppos < nargs else kwargs.get(pname)
                ntensors = len(items)
                if payload == P2P_OPS:
                    ts: Any = [x.tensor for x in items]
                    if items:
                        group = items[0].group  # batch_isend_irecv runs on its ops' group
                else:
                    ts = items
                shape = ts[0].shape if ts else ()
                ndim, dt = len(shape), dtypes.get(ts[0].dtype, 0) if ts else 0
                numel = sum(x.numel() for x in ts)
            if peer_pos >= 0:
                p = args[peer_pos] if peer_pos < nargs else kwargs.get(peer_name)
                peer = p if p is not None else -1
            if ndim > 4:
                shape = tuple(shape[:4])
            if group is None:
                group = rec.default_pg
            ginfo = groups.get(group)
            if ginfo is None:
                ginfo = rec.register_group(group)
            slot, seqfn, tracked = ginfo
            seq0 = seqfn() if seqfn is not None else 0
            is_async = always_async or (apos >= 0 and bool(args[apos] if apos < nargs else kwargs.get("async_op")))
            # On a tracked group (NCCL) a synchronous collective returns before it completes; its record
            # stays in flight until the group's completions pass it (see dtwatch.record.completion).
            # enqueue_on: that group (its queue takes the call when it returns; a TrackedGroup is always
            # true), else None.
            enqueue_on = tracked if tracked_sync and not is_async else None
            # Call sites (see dtwatch.record.callsite): a direct call from user code is one dict hit giving both
            # the site and the user's site (the same line); a call from inside torch (FSDP) or a library
            # (Lightning, Accelerate) walks out to the first frame outside torch/dtwatch and to the first
            # user frame.
            caller = getframe(1)
            sites = rec.site_positions.get((id(caller.f_code), caller.f_lasti))
            if sites is None:
                sites = rec.sites.frame_sites(caller)
            del caller
            site, user_site = sites
            stamp = next(rec.stamps)
            off = rec.records_off + ((stamp - 1) % rec.capacity) * RECORD_SIZE
            entries[ndim if ndim < 4 else 4].pack_into(
                mm, off, stamp, seq0 + 1, now(), op, dt, ndim if ndim < 256 else 255,
                flags | FLAG_ASYNC if is_async else flags | FLAG_ENQUEUED if enqueue_on else flags,
                ntensors if ntensors < 256 else 255, slot, site,
                rec.step, numel, peer, *shape, user_site, stamp,
            )
        except Exception as exc:  # noqa: BLE001 - recording must never break the collective
            rec.fail(f"recording {spec.name}", exc)
            off = -1
        if composite:
            tls.busy = True
            enter()
        try:
            result = original(*args, **kwargs)
        except BaseException:
            if off >= 0:
                rec.finish(off, stamp, STATUS_ERROR, 1)
            raise
        finally:
            if composite:
                tls.busy = False
                leave()
        if off >= 0:
            try:
                span = seqfn() - seq0 if spans and seqfn is not None else 1
                if is_async:
                    if result is None:  # not a member of the group: nothing was issued
                        rec.finish(off, stamp, STATUS_OK, span)
                    elif tracked is not None and not is_p2p:  # completes when the group's watermark passes it
                        tracked.enqueued.append((seq0 + span, off, stamp, span))
                    else:
                        rec.track_async(result, off, stamp, span, use_future=tracked is None)
                elif enqueue_on:
                    enqueue_on.enqueued.append((seq0 + span, off, stamp, span))
                else:
                    exit_pack(mm, off + RECORD_EXIT_OFFSET, now(), span, STATUS_OK)
            except Exception as exc:  # noqa: BLE001
                rec.fail(f"recording the end of {spec.name}", exc)
        return result

    dtwatch_recorded.__dtwatch_original__ = original  # type: ignore[attr-defined]  # mypy: no attributes on functions
    return dtwatch_recorded


# Every wrapper runs this one code object: a frame running it is a call the wrapper records (what the
# collective hooks check, dtwatch.record.hooks).
WRAPPER_CODE: CodeType = next(
    c for c in make_wrapper.__code__.co_consts if isinstance(c, CodeType) and c.co_name == "dtwatch_recorded"
)
