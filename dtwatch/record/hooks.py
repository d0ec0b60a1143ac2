"""Collectives that no ``torch.distributed`` Python function issued, recorded from torch's collective hooks.

torch >= 2.14 calls a process group's pre- and post-hooks (``ProcessGroup.register_pre_hook`` /
``register_post_hook``) from the c10d dispatcher for every collective it issues: eager calls, functional
collectives (DTensor, tensor parallel, ``torch.compile``d graphs, ``_c10d_functional``) and DDP's reducer.
The wrapper (:mod:`dtwatch.record.wrapper`) sees only the first kind; without hooks the others are known
only as a sampled sequence number, their op named later from a Flight Recorder dump.

Contract. :class:`CollectiveHooks` registers one pre-hook and one post-hook on every process group as c10d
registers it (``_register_process_group``, on the thread creating it, before anyone can issue a collective
on it), and on a group that existed before dtwatch was installed when the main thread first meets it. torch
keeps a group's hooks in an unlocked map and asks for registration at set-up time, not concurrently with
collectives: hooks are never added from the sampler's or the attach poll's thread (such a group, created
before dtwatch and used only from other threads, is then sampled as on an older torch).

The pre-hook writes the same ring record the wrapper writes (op, shape and dtype of the tensor every rank
passes alike, tensor count, root or peer, async flag, the group's sequence number, the call site and the
user's line where the issuing thread has Python frames) plus ``FLAG_HOOKED``. It records nothing for a
call the wrapper is recording: the frames between the hook and the first frame outside torch and dtwatch
then include the wrapper's (all wrappers share one code object), which is also true of the calls an object
collective or a batch of p2p ops makes internally, so nothing is counted twice. Completion: on a tracked
group (NCCL, gloo_async) the record stays in flight until the group's completed watermark passes its
sequence number, as a wrapped call's does; elsewhere the post-hook hands the call's ``Work`` to the
recorder, which the sampler polls (the record's exit is stamped at its next tick after the work completed).

Cost. Registering the hooks makes torch call into Python twice for every collective on the group, the
wrapped ones included (which the pre-hook leaves after a few frame hops). ``benchmarks/overhead.py``
measures it against the wrapper; ``Config.collective_hooks`` ("auto" / "off") chooses.

Failure policy. A hook never raises into torch (which would raise into the training code): any failure
of its own disables recording through :meth:`Recorder.fail` (one warning per process). A DDP reducer
running on a GPU's autograd thread has no Python frames: its records carry no site (0), and the watchdog
places the rank by its main thread, as before.
"""
from __future__ import annotations

import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from dtwatch.code_paths import INTERNAL, USER
from dtwatch.ops import FLAG_COALESCED, FLAG_P2P, OP_CODES
from dtwatch.record.wrapper import DTYPE_CODES_BY_TORCH, WRAPPER_CODE
from dtwatch.ring import FLAG_ASYNC, FLAG_ENQUEUED, NUMEL_FROM_SHAPE, RECORD_ENTRY_BY_NDIM, RECORD_SIZE, STATUS_OK
from dtwatch.ring.layout import FLAG_HOOKED

if TYPE_CHECKING:
    from dtwatch.record.recorder import Recorder

HOOK_ID = 0x64747700  # dtwatch's id for its pre- and post-hook on every group ("dtw\0")

# torch's hook op names -> (ring op name, op flags, which tensors describe the call). The tensors are those
# every rank passes alike, as the wrapper records them: a scatter's and a reduce_scatter's output (only the
# root has a scatter's inputs), a recv's buffer, otherwise the input. Ops that are not collectives (SPLIT,
# NEW_WINDOW, UNKNOWN) are not recorded. torch 2.14 names the base, coalesced and single-tensor variants by
# their plain op; torch 2.15 has names of their own.
_IN, _OUT = 0, 1
_HOOK_OPS: dict[str, tuple[str, int, int]] = {
    "ALLREDUCE": ("all_reduce", 0, _IN),
    "ALLREDUCE_COALESCED": ("all_reduce_coalesced", FLAG_COALESCED, _IN),
    "ALLGATHER": ("all_gather", 0, _IN),
    "ALLGATHER_BASE": ("all_gather_into_tensor", 0, _IN),
    "ALLGATHER_COALESCED": ("all_gather_coalesced", FLAG_COALESCED, _IN),
    "ALLGATHER_INTO_TENSOR_COALESCED": ("all_gather_into_tensor_coalesced", FLAG_COALESCED, _IN),
    "ALLTOALL": ("all_to_all", 0, _IN),
    "ALLTOALL_BASE": ("all_to_all_single", 0, _IN),
    "BARRIER": ("barrier", 0, _IN),
    "BROADCAST": ("broadcast", 0, _IN),
    "GATHER": ("gather", 0, _IN),
    "REDUCE": ("reduce", 0, _IN),
    "REDUCE_SCATTER": ("reduce_scatter", 0, _OUT),
    "REDUCE_SCATTER_BASE": ("reduce_scatter_tensor", 0, _IN),
    "REDUCE_SCATTER_TENSOR_COALESCED": ("reduce_scatter_tensor_coalesced", FLAG_COALESCED, _IN),
    "SCATTER": ("scatter", 0, _OUT),
    "SEND": ("isend", FLAG_P2P, _IN),
    "RECV": ("irecv", FLAG_P2P, _OUT),
}
# A coalesced call of one tensor is the plain op (torch 2.15's functional all_gather_tensor issues one).
_SINGLE = {"all_reduce_coalesced": "all_reduce", "all_gather_coalesced": "all_gather",
           "all_gather_into_tensor_coalesced": "all_gather_into_tensor",
           "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor"}
_UNSET = object()


def _never() -> bool:
    return False


def available() -> bool:
    """Whether this torch calls process-group hooks for every collective (torch >= 2.14)."""
    return dist.is_available() and hasattr(dist.ProcessGroup, "register_pre_hook") and _op_table() is not None


def _op_table() -> list[tuple[int, int, int, int] | None] | None:
    """Indexed by the value of torch's ``HookOpName`` members: (ring op code, op flags, tensors, the op code of a
    one-tensor call), or None for an op not recorded; None where torch has no such enum. (A list, not a dict:
    hashing a pybind11 enum costs ~0.5 us.)"""
    try:
        from torch._C._distributed_c10d import HookOpName  # type: ignore[attr-defined, unused-ignore]  # torch >= 2.14
    except ImportError:
        return None
    size = max(int(m.value) for m in HookOpName.__members__.values()) + 1
    table: list[tuple[int, int, int, int] | None] = [None] * size
    for name, (op, flags, side) in _HOOK_OPS.items():
        member = getattr(HookOpName, name, None)
        if member is not None:
            table[int(member.value)] = (OP_CODES[op], flags, side, OP_CODES[_SINGLE.get(op, op)])
    return table


class CollectiveHooks:
    """dtwatch's pre- and post-hook on each process group (see the module doc). Thread-safe."""

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec
        self.ops = _op_table() or []
        self.hooked: weakref.WeakSet[Any] = weakref.WeakSet()  # groups carrying our hooks
        self.lock = threading.Lock()

    def add(self, pg: Any) -> None:
        """Register the hooks on ``pg`` (once; a group that refuses them is recorded by the wrapper only)."""
        with self.lock:
            if pg in self.hooked:
                return
            pre, post = self._hooks_for(weakref.ref(pg))
            try:
                for unregister in (pg.unregister_pre_hook, pg.unregister_post_hook):
                    try:
                        unregister(HOOK_ID)  # a previous install's, in the same process
                    except Exception:  # noqa: BLE001 - none registered: the usual case
                        pass
                pg.register_pre_hook(HOOK_ID, pre)
                pg.register_post_hook(HOOK_ID, post)
            except Exception:  # noqa: BLE001 - e.g. a backend without hooks: the wrapper still records its calls
                return
            self.hooked.add(pg)

    def remove(self, pg: Any) -> None:
        with self.lock:
            self.hooked.discard(pg)
            for unregister in (pg.unregister_pre_hook, pg.unregister_post_hook):
                try:
                    unregister(HOOK_ID)
                except Exception:  # noqa: BLE001 - a group being torn down
                    pass

    def remove_all(self) -> None:
        for pg in list(self.hooked):
            self.remove(pg)

    def _hooks_for(self, group_ref: Callable[[], Any]) -> tuple[Callable[[Any], None], Callable[[Any], None]]:
        fastpath = self.rec.fastpath
        rec, ops, nops, dtypes = self.rec, self.ops, len(self.ops), DTYPE_CODES_BY_TORCH
        entries, now, getframe, wrapper_code = RECORD_ENTRY_BY_NDIM, time.time, sys._getframe, WRAPPER_CODE
        native_inside = fastpath.inside if fastpath is not None else _never
        # op_id -> (record offset, stamp) of an untracked group's call, until its post-hook gives the Work.
        waiting: dict[int, tuple[int, int]] = {}
        members: list[Any] = [_UNSET]  # the group's global ranks, read at its first p2p op

        def pre_hook(args: Any) -> None:
            mm = rec.mm
            if mm is None or native_inside():  # the native wrapper is recording this call
                return
            try:
                # Frames of torch (and dtwatch) between here and the code that issued the call: the wrapper's
                # among them means the wrapper records it (the common case, so looked at first). None: a thread
                # without Python frames (C++).
                try:
                    f: Any = getframe(1)
                except ValueError:
                    f = None
                kinds, table = rec.sites._kinds, rec.sites
                while f is not None:
                    code = f.f_code
                    if code is wrapper_code:
                        return
                    kind = kinds.get(code.co_filename)
                    if kind is None:
                        kind = table.kind(code)
                    if kind != INTERNAL:
                        break
                    f = f.f_back
                value = args.name.value
                op = ops[value] if value < nops else None
                if op is None:
                    return
                if f is not None and f.f_back is not None and f.f_lineno == f.f_code.co_firstlineno:
                    # A function torch.compile runs: its frame reports the ``def`` line, which says nothing;
                    # the line that called it does.
                    f = f.f_back
                pg = group_ref()
                if pg is None:
                    return
                ginfo = rec.groups.get(pg)
                if ginfo is None:
                    ginfo = rec.register_group(pg)
                slot, seqfn, tracked = ginfo
                code_, flags, side, single = op
                tensors = args.output_tensors if side else args.input_tensors
                ntensors = len(tensors)
                if ntensors == 1 and flags & FLAG_COALESCED:
                    code_, flags = single, flags & ~FLAG_COALESCED
                if ntensors:
                    t = tensors[0]
                    shape = t.shape
                    ndim, dt = len(shape), dtypes.get(t.dtype, 0)
                    numel = NUMEL_FROM_SHAPE if ndim <= 4 and ntensors == 1 else sum(x.numel() for x in tensors)
                    if ndim > 4:
                        shape = tuple(shape[:4])
                else:
                    shape, ndim, numel, dt = (), 0, 0, 0
                peer = -1
                if flags & FLAG_P2P:
                    if members[0] is _UNSET:
                        try:
                            members[0] = list(dist.get_process_group_ranks(pg))
                        except Exception:  # noqa: BLE001 - torch cannot list them: the group rank is kept
                            members[0] = None
                    root, known = args.root, members[0]
                    peer = known[root] if known is not None and 0 <= root < len(known) else root
                # torch's op_id counts the hook calls (it pairs a pre-hook with its post-hook); the group's sequence
                # number is what the wrapper and the Flight Recorder use (NCCL numbers p2p ops apart).
                seq0 = seqfn() if seqfn is not None else 0
                site, user_site = rec.sites.frame_sites(f) if f is not None else (0, 0)
                if f is not None:
                    user_site = _called_by_user(table, f, user_site)
                is_async = bool(args.async_op)
                on_tracked = tracked if not flags & FLAG_P2P else None
                flags |= FLAG_HOOKED | (FLAG_ASYNC if is_async else FLAG_ENQUEUED if on_tracked else 0)
                stamp = next(rec.stamps)
                off = rec.records_off + ((stamp - 1) % rec.capacity) * RECORD_SIZE
                entries[ndim if ndim < 4 else 4].pack_into(
                    mm, off, stamp, seq0 + 1, now(), code_, dt, ndim if ndim < 256 else 255, flags,
                    ntensors if ntensors < 256 else 255, slot, site, rec.step, numel, peer, *shape, user_site, stamp,
                )
                if on_tracked is not None:  # completes when the watermark passes it (record.completion)
                    on_tracked.enqueued.append((seq0 + 1, off, stamp, 1))
                else:
                    if len(waiting) > 256:  # calls that raised before their post-hook: let them go
                        waiting.clear()
                    waiting[args.op_id] = (off, stamp)
            except Exception as exc:  # noqa: BLE001 - a hook must never raise into torch
                rec.fail("recording a collective from torch's hook", exc)

        def post_hook(args: Any) -> None:
            if not waiting:
                return
            try:
                held = waiting.pop(args.op_id, None)
                if held is None:
                    return
                off, stamp = held
                work = args.work
                if work is None:
                    rec.finish(off, stamp, STATUS_OK, 1)
                else:
                    # Polled by the sampler (its next tick stamps the exit): a future's callback would cost
                    # the issuing thread ~20 us a call in GIL hand-overs with the backend's thread.
                    rec.track_async(work, off, stamp, 1, use_future=False)
            except Exception as exc:  # noqa: BLE001
                rec.fail("recording a collective's end from torch's hook", exc)

        return pre_hook, post_hook


def _called_by_user(table: Any, f: Any, user_site: int) -> int:
    """The user's line that led to a call torch issued from inside user code that torch itself called (a module's
    ``forward`` run by ``model(x)``, a hook): the first user frame that user or library code called. An extra
    forward under a rank test is told from the training forward by that line, not by the ``forward`` line both
    run through."""
    inner = None
    while f is not None:
        kind = table.kind(f.f_code)
        if kind == USER:
            if inner is None:
                inner = f
            caller = f.f_back
            if caller is None or table.kind(caller.f_code) != INTERNAL:
                break  # called by user or library code: the line that led here
        f = f.f_back
    if f is None or f is inner:
        return user_site
    return table.frame_site(f) or user_site


__all__ = ["CollectiveHooks", "HOOK_ID", "available"]
