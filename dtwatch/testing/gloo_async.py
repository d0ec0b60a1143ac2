"""``gloo_async``: gloo underneath, NCCL's CPU-side execution model on top (for tests on machines without GPUs).

On NCCL a collective *returns as soon as it is enqueued* on the GPU stream. ``Work.wait()`` only makes the
current stream wait for it; the CPU runs on and blocks later, at a synchronisation point
(``torch.cuda.synchronize()``, ``.item()``, ``.cpu()``, a barrier), or never. A job whose ranks disagree
therefore hangs at a line that is not the collective's. This backend reproduces that on the CPU:

* every collective and point-to-point op returns once handed to gloo (which runs it on its own threads);
* ``Work.wait()`` returns at once and does not wait for the work (NCCL's stream wait), when the user's
  code or torch's synchronous collectives call it. torch's own library code (DDP, FSDP) reads results
  right after waiting, which a GPU orders on its stream; on the CPU its waits block (see
  :func:`_caller_reads_results`), so DDP and FSDP compute the same numbers as on gloo;
* ``barrier()`` blocks the caller until every member arrived, as NCCL's does;
* a ``Work``'s future completes when the data is ready, so ``future.wait()`` blocks (DDP's reducer waits on
  its buckets' futures at the end of the backward pass);
* :func:`synchronize` blocks until all work this process issued has completed: the stand-in for
  ``torch.cuda.synchronize()``; it raises the first error any of that work raised.

Like on NCCL, a tensor that a user's collective writes is only safe to read on the CPU after a
synchronisation point; reading it earlier reads whatever is there (on a GPU the read would be ordered on
the stream; here it is a data race). This backend reproduces *when the CPU blocks*.

Each group also keeps the active entries an NCCL Flight Recorder would show (:meth:`GlooAsyncGroup.in_flight`)
and the number of collectives issued (``_get_sequence_number_for_group``, counted like NCCL's: point-to-point
ops do not advance it). That is how dtwatch learns what completed, as it does from NCCL's Flight Recorder.
"""
from __future__ import annotations

import datetime
import functools
import os
import queue
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup, Work, c10d_logger
from torch.distributed.distributed_c10d import AllgatherOptions

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import GroupName  # a NewType of str, in newer torch only

from dtwatch.code_paths import is_user_file

BACKEND_NAME = "gloo_async"

# Object collectives read back sizes and bytes between their tensor ops (``.item()``, ``.cpu()``), which on
# NCCL synchronises: their inner ops block here, marked by this thread-local flag.
_OBJECT_COLLECTIVES = ("all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list",
                       "send_object_list", "recv_object_list")
_local = threading.local()

_pending_lock = threading.Lock()
_pending: list[EnqueuedWork] = []  # gloo works issued by this process and not yet seen completed


def _remember(work: EnqueuedWork) -> None:
    with _pending_lock:
        # Drop what completed meanwhile, so a long job's list stays short.
        if len(_pending) > 64:
            _pending[:] = [w for w in _pending if not w.done.is_set()]
        _pending.append(work)


def synchronize() -> None:
    """Block until every collective this process issued on a ``gloo_async`` group has completed.

    The stand-in for ``torch.cuda.synchronize()``. It raises the first error such work raised."""
    while True:
        with _pending_lock:
            if not _pending:
                return
            works, _pending[:] = list(_pending), []
        for w in works:
            w.block()


# Frames between a caller and the work it waits on: torch's collective API and its wrappers (its logger,
# the deprecation decorator from typing_extensions) and dtwatch's own (the recorder, this module).
_API_FILES = {os.path.normcase(os.path.abspath(f)) for f in (dist.distributed_c10d.__file__, c10d_logger.__file__)}
_DTWATCH_DIR = os.path.normcase(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep


def _caller_reads_results(frame: FrameType | None) -> bool:
    """Whether the code that waits (directly with ``work.wait()``, or through a synchronous collective
    such as ``dist.all_reduce(t)``) is a library that reads the results on the CPU right after.

    The user's own code gets NCCL's semantics: the wait returns at once, and the user's code must
    synchronise (:func:`synchronize`) before it reads. Library code (torch's DDP and FSDP, Lightning,
    when called from C++ the Python frame that entered it) reads what it waited for right away, which on
    a GPU is ordered on the stream or synchronises (``.item()``). Here such a wait must block, or the
    library would read results that are not there yet.
    """
    while frame is not None:
        name = os.path.normcase(os.path.abspath(frame.f_code.co_filename))
        if not (name in _API_FILES or name.startswith(_DTWATCH_DIR)
                or os.path.basename(name) == "typing_extensions.py"):
            break
        frame = frame.f_back
    return frame is None or not is_user_file(frame.f_code.co_filename)


class _AllOf:
    """Several gloo works issued as one op (the coalesced variants gloo lacks), seen as one work."""

    def __init__(self, works: list[Work]) -> None:
        self.works = works

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def is_success(self) -> bool:
        return all(w.is_success() for w in self.works)

    def exception(self) -> BaseException | None:
        return next((w.exception() for w in self.works if not w.is_success()), None)

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        return True

    def result(self) -> list[Tensor]:
        return [t for w in self.works for t in w.result()]

    def get_future(self) -> torch.futures.Future[list[Tensor]]:
        return torch.futures.collect_all([w.get_future() for w in self.works]).then(
            lambda fut: [t for f in fut.value() for t in f.value()])


class EnqueuedWork(dist.distributed_c10d.Work):
    """A handle on work already handed to gloo. Whether ``wait()`` blocks: see the module doc."""

    def __init__(self, inner: Work | _AllOf, blocking: bool) -> None:
        super().__init__()
        self._inner = inner
        self._blocking = blocking
        self.done = threading.Event()  # set once the work completed (see _Completions)
        self.error: BaseException | None = None

    def finished(self, error: BaseException | None) -> None:
        self.error = error
        self.done.set()

    def block(self) -> None:
        """Wait until the work completed; raise its error. (gloo works are waited on by one thread only:
        a second ``wait()`` on some of them never returns.)"""
        self.done.wait()
        if self.error is not None:
            raise self.error

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if self._blocking or _caller_reads_results(sys._getframe(1)):
            self.block()
        return True

    def is_completed(self) -> bool:
        return self.done.is_set()

    def is_success(self) -> bool:
        return self._inner.is_success()

    def exception(self) -> BaseException | None:
        return self._inner.exception()

    def result(self) -> list[Tensor]:
        return self._inner.result()

    def get_future(self) -> torch.futures.Future[list[Tensor]]:
        return self._inner.get_future()

    def synchronize(self) -> None:
        return None


class _Completions(threading.Thread):
    """Notices when a group's works complete, in issue order (gloo runs a group's ops in that order).

    A future's callback would do for most ops, but some gloo works have no future, and their
    ``is_completed()`` stays False even after they finished (``_reduce_scatter_base`` on torch 2.13):
    waiting on them, on this thread, is the one reliable signal."""

    def __init__(self) -> None:
        super().__init__(name="gloo-async-completions", daemon=True)
        self.queue: queue.SimpleQueue[tuple[Work | _AllOf, Callable[[BaseException | None], None]] | None] = \
            queue.SimpleQueue()

    def run(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:  # the group shut down
                return
            inner, on_done = item
            try:
                inner.wait()
                on_done(None)
            except BaseException as exc:  # noqa: BLE001 - the error is the work's, reported to its waiters
                on_done(exc)


_Opts = TypeVar("_Opts", AllgatherOptions, dist.ReduceScatterOptions)


class _GlooOps(Protocol):
    """The ops of ``ProcessGroupGloo`` this group hands its work to. torch's stubs declare none of them on
    ``Backend`` subclasses, although gloo's bindings have them all; hence the ``cast`` where it is made."""

    def allreduce(self, tensors: list[Tensor], opts: dist.AllreduceOptions, /) -> Work: ...
    def allreduce_coalesced(self, tensors: list[Tensor], opts: dist.AllreduceCoalescedOptions, /) -> Work: ...
    def broadcast(self, tensors: list[Tensor], opts: dist.BroadcastOptions, /) -> Work: ...
    def reduce(self, tensors: list[Tensor], opts: dist.ReduceOptions, /) -> Work: ...
    def allgather(self, outputs: list[list[Tensor]], inputs: list[Tensor], opts: AllgatherOptions, /) -> Work: ...
    def _allgather_base(self, output: Tensor, input_tensor: Tensor, opts: AllgatherOptions, /) -> Work: ...
    def allgather_coalesced(self, outputs: list[list[Tensor]], inputs: list[Tensor], opts: AllgatherOptions,
                            /) -> Work: ...
    def gather(self, outputs: list[list[Tensor]], inputs: list[Tensor], opts: dist.GatherOptions, /) -> Work: ...
    def scatter(self, outputs: list[Tensor], inputs: list[list[Tensor]], opts: dist.ScatterOptions, /) -> Work: ...
    def reduce_scatter(self, outputs: list[Tensor], inputs: list[list[Tensor]], opts: dist.ReduceScatterOptions,
                       /) -> Work: ...
    def _reduce_scatter_base(self, output: Tensor, input_tensor: Tensor, opts: dist.ReduceScatterOptions,
                             /) -> Work: ...
    def alltoall_base(self, output: Tensor, input_tensor: Tensor, output_split_sizes: list[int],
                      input_split_sizes: list[int], opts: dist.AllToAllOptions, /) -> Work: ...
    def alltoall(self, outputs: list[Tensor], inputs: list[Tensor], opts: dist.AllToAllOptions, /) -> Work: ...
    def barrier(self, opts: dist.BarrierOptions, /) -> Work: ...
    def send(self, tensors: list[Tensor], dst: int, tag: int, /) -> Work: ...
    def recv(self, tensors: list[Tensor], src: int, tag: int, /) -> Work: ...
    def recv_anysource(self, tensors: list[Tensor], tag: int, /) -> Work: ...


class GlooAsyncGroup(ProcessGroup):
    """A process group whose ops run on gloo and return before they complete (see the module doc).

    c10d calls its ops in their ``(tensors, opts)`` form (``group.allreduce([t], opts)``), the form a
    backend implements; torch's stubs describe ``ProcessGroup``'s convenience overloads as well
    (``allreduce(tensor, op)``), which this group does not offer. mypy reports those as incompatible
    overrides: hence the ``ignore[override]`` on those it lists.
    """

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg, unused-ignore]  # the binding has (rank, size); the stub lacks it
        gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        self._gloo = cast(_GlooOps, gloo)
        self._holder = ProcessGroup(store, rank, size)
        self._holder._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, gloo)
        self._lock = threading.Lock()
        self._seq = 0  # collectives issued (NCCL's collective counter: p2p ops do not advance it)
        self._active: dict[int, str] = {}  # seq -> op of collectives not completed, NCCL Flight Recorder style
        self._completions: _Completions | None = None
        self._group_name = cast("GroupName", "")
        self._group_desc = ""
        # Collective hooks (torch >= 2.14 calls them from its dispatcher, which a Python group bypasses):
        # hook id -> callable, called by _issue as the dispatcher calls a C++ group's.
        self._pre_hooks: dict[int, Callable[[Any], None]] = {}
        self._post_hooks: dict[int, Callable[[Any], None]] = {}

    # -- collective hooks, as the c10d dispatcher calls them for C++ groups ------------------------
    def register_pre_hook(self, hook_id: int, hook: Callable[[Any], None]) -> None:
        self._pre_hooks[hook_id] = hook

    def register_post_hook(self, hook_id: int, hook: Callable[[Any], None]) -> None:
        self._post_hooks[hook_id] = hook

    def unregister_pre_hook(self, hook_id: int) -> None:
        self._pre_hooks.pop(hook_id, None)

    def unregister_post_hook(self, hook_id: int) -> None:
        self._post_hooks.pop(hook_id, None)

    # -- bookkeeping ----------------------------------------------------------------------------
    def _issue(self, op: str, run: Callable[[], Work | _AllOf], *, collective: bool = True,
               blocking: bool = False, inputs: list[Tensor] | tuple[Tensor, ...] = (),
               outputs: list[Tensor] | tuple[Tensor, ...] = (), root: int = -1) -> EnqueuedWork:
        hooked = _HOOK_NAMES.get(op) if self._pre_hooks or self._post_hooks else None
        with self._lock:  # one issuing order per group, as on a CUDA stream
            if hooked is not None:
                # torch's dispatcher passes the call's async_op; to the CPU every NCCL collective but a
                # barrier is asynchronous, so this backend says so.
                hook_args = _HookArgs(hooked, self._seq, op != "barrier", list(inputs), list(outputs), root)
                for hook in list(self._pre_hooks.values()):
                    hook(hook_args)
            inner = run()
            blocking = blocking or getattr(_local, "in_object_collective", False)
            work = EnqueuedWork(inner, blocking)
            seq = 0
            if collective:
                self._seq += 1
                seq = self._seq
                self._active[seq] = op
            if self._completions is None:
                self._completions = _Completions()
                self._completions.start()

        def on_done(exc: BaseException | None, seq: int = seq, work: EnqueuedWork = work) -> None:
            work.finished(exc)
            if seq:
                with self._lock:
                    self._active.pop(seq, None)

        self._completions.queue.put((inner, on_done))
        _remember(work)
        if hooked is not None:
            hook_args.work = work
            for hook in list(self._post_hooks.values()):
                hook(hook_args)
        if blocking:
            work.block()
        return work

    def in_flight(self) -> tuple[int, list[tuple[int, str]]]:
        """(collectives issued, [(seq, op) of those not completed yet]): what NCCL's Flight Recorder
        shows of a group when asked for active entries only."""
        with self._lock:
            return self._seq, sorted(self._active.items())

    def shutdown(self) -> None:
        """``destroy_process_group`` calls this: the completion thread ends (after the work queued before
        it), then gloo shuts down, so no thread of this group is inside gloo when the process exits."""
        completions, self._completions = self._completions, None
        if completions is not None:
            completions.queue.put(None)
            completions.join(timeout=10)
        try:
            self._holder.shutdown()
        except Exception:  # noqa: BLE001 - a torch without Backend.shutdown: gloo ends with the process
            pass

    def abort(self) -> None:
        self.shutdown()

    # torch reads a group's name and description from its backend; this group is its own backend.
    def _set_group_name(self, name: GroupName) -> None:
        self._group_name = name
        # gloo's Flight Recorder entries carry the name of the group that holds it: a plain holder group,
        # so that they name this group, as NCCL's do.
        try:
            self._holder._set_group_name(name)
        except Exception:  # noqa: BLE001 - the entries then carry no name; nothing else depends on it
            pass

    @property
    def group_name(self) -> GroupName:
        return self._group_name

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc
        try:
            self._holder._set_group_desc(desc)
        except Exception:  # noqa: BLE001
            pass

    @property
    def group_desc(self) -> str:
        return self._group_desc

    def _get_sequence_number_for_group(self) -> int:
        return self._seq

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    # -- collectives ----------------------------------------------------------------------------
    def allreduce(  # type: ignore[override]  # the (tensors, opts) form only: see the class doc
            self, tensors: list[Tensor], opts: dist.AllreduceOptions | None = None) -> EnqueuedWork:
        return self._issue("allreduce", lambda: self._gloo.allreduce(tensors, opts or dist.AllreduceOptions()),
                           inputs=tensors)

    def allreduce_coalesced(self, tensors: list[Tensor],
                            opts: dist.AllreduceCoalescedOptions | None = None) -> EnqueuedWork:
        return self._issue("allreduce_coalesced", lambda: self._gloo.allreduce_coalesced(
            tensors, opts or dist.AllreduceCoalescedOptions()), inputs=tensors)

    def broadcast(  # type: ignore[override]  # as allreduce
            self, tensors: list[Tensor], opts: dist.BroadcastOptions | None = None) -> EnqueuedWork:
        opts = opts or dist.BroadcastOptions()
        return self._issue("broadcast", lambda: self._gloo.broadcast(tensors, opts), inputs=tensors,
                           root=opts.rootRank)

    def reduce(  # type: ignore[override]  # as allreduce
            self, tensors: list[Tensor], opts: dist.ReduceOptions | None = None) -> EnqueuedWork:
        opts = opts or dist.ReduceOptions()
        return self._issue("reduce", lambda: self._gloo.reduce(tensors, opts), inputs=tensors, root=opts.rootRank)

    def allgather(  # type: ignore[override]  # as allreduce
            self, output_tensors: list[list[Tensor]], input_tensors: list[Tensor],
            opts: AllgatherOptions | None = None) -> EnqueuedWork:
        return self._issue("allgather", lambda: self._gloo.allgather(
            output_tensors, input_tensors, opts or AllgatherOptions()), inputs=input_tensors)

    def _allgather_base(self, output: Tensor, input_tensor: Tensor,
                        opts: AllgatherOptions | None = None) -> EnqueuedWork:
        return self._issue("_allgather_base", lambda: self._gloo._allgather_base(
            output, input_tensor, opts or AllgatherOptions()), inputs=[input_tensor])

    def allgather_coalesced(self, output_lists: list[list[Tensor]], input_list: list[Tensor],
                            opts: AllgatherOptions | None = None) -> EnqueuedWork:
        return self._issue("allgather_coalesced", lambda: self._gloo.allgather_coalesced(
            output_lists, input_list, opts or AllgatherOptions()), inputs=input_list)

    def allgather_into_tensor_coalesced(self, outputs: list[Tensor], inputs: list[Tensor],
                                        opts: AllgatherOptions | None = None) -> EnqueuedWork:
        return self.all_gather_single_coalesced(outputs, inputs, opts)

    def gather(  # type: ignore[override]  # as allreduce
            self, output_tensors: list[list[Tensor]], input_tensors: list[Tensor],
            opts: dist.GatherOptions | None = None) -> EnqueuedWork:
        opts = opts or dist.GatherOptions()
        return self._issue("gather", lambda: self._gloo.gather(output_tensors, input_tensors, opts),
                           inputs=input_tensors, root=opts.rootRank)

    def scatter(  # type: ignore[override]  # as allreduce
            self, output_tensors: list[Tensor], input_tensors: list[list[Tensor]],
            opts: dist.ScatterOptions | None = None) -> EnqueuedWork:
        opts = opts or dist.ScatterOptions()
        return self._issue("scatter", lambda: self._gloo.scatter(output_tensors, input_tensors, opts),
                           inputs=[t for ts in input_tensors for t in ts], outputs=output_tensors, root=opts.rootRank)

    def reduce_scatter(  # type: ignore[override]  # as allreduce
            self, output_tensors: list[Tensor], input_tensors: list[list[Tensor]],
            opts: dist.ReduceScatterOptions | None = None) -> EnqueuedWork:
        return self._issue("reduce_scatter", lambda: self._gloo.reduce_scatter(
            output_tensors, input_tensors, opts or dist.ReduceScatterOptions()),
            inputs=[t for ts in input_tensors for t in ts], outputs=output_tensors)

    def _reduce_scatter_base(self, output: Tensor, input_tensor: Tensor,
                             opts: dist.ReduceScatterOptions | None = None) -> EnqueuedWork:
        return self._issue("_reduce_scatter_base", lambda: self._gloo._reduce_scatter_base(
            output, input_tensor, opts or dist.ReduceScatterOptions()), inputs=[input_tensor])

    def reduce_scatter_tensor_coalesced(self, outputs: list[Tensor], inputs: list[Tensor],
                                        opts: dist.ReduceScatterOptions | None = None) -> EnqueuedWork:
        return self.reduce_scatter_single_coalesced(outputs, inputs, opts)

    # torch >= 2.12 names (ProcessGroup level) of the single-tensor ops; gloo knows them by the older ones
    def all_gather_single(self, output: Tensor, input_tensor: Tensor,
                          opts: AllgatherOptions | None = None) -> EnqueuedWork:
        return self._allgather_base(output, input_tensor, opts)

    def reduce_scatter_single(self, output: Tensor, input_tensor: Tensor,
                              opts: dist.ReduceScatterOptions | None = None) -> EnqueuedWork:
        return self._reduce_scatter_base(output, input_tensor, opts)

    def all_to_all_single(  # type: ignore[override]  # as allreduce
            self, output: Tensor, input_tensor: Tensor, output_split_sizes: list[int],
            input_split_sizes: list[int], opts: dist.AllToAllOptions | None = None) -> EnqueuedWork:
        return self.alltoall_base(output, input_tensor, output_split_sizes, input_split_sizes, opts)

    def all_gather_single_coalesced(self, outputs: list[Tensor], inputs: list[Tensor],
                                    opts: AllgatherOptions | None = None) -> EnqueuedWork:
        return self._coalesced("allgather_into_tensor_coalesced", self._gloo._allgather_base, outputs, inputs,
                               opts or AllgatherOptions())

    def reduce_scatter_single_coalesced(self, outputs: list[Tensor], inputs: list[Tensor],
                                        opts: dist.ReduceScatterOptions | None = None) -> EnqueuedWork:
        return self._coalesced("reduce_scatter_tensor_coalesced", self._gloo._reduce_scatter_base, outputs, inputs,
                               opts or dist.ReduceScatterOptions())

    def _coalesced(self, op: str, one: Callable[[Tensor, Tensor, _Opts], Work], outputs: list[Tensor],
                   inputs: list[Tensor], opts: _Opts) -> EnqueuedWork:
        """The coalesced variants gloo lacks: one gloo op per pair, seen as one work."""
        return self._issue(op, lambda: _AllOf([one(o, i, opts) for o, i in zip(outputs, inputs, strict=False)]),
                           inputs=inputs)

    def alltoall_base(  # type: ignore[override]  # as allreduce
            self, output: Tensor, input_tensor: Tensor, output_split_sizes: list[int],
            input_split_sizes: list[int], opts: dist.AllToAllOptions | None = None) -> EnqueuedWork:
        return self._issue("alltoall_base", lambda: self._gloo.alltoall_base(
            output, input_tensor, output_split_sizes, input_split_sizes, opts or dist.AllToAllOptions()),
            inputs=[input_tensor])

    def alltoall(  # type: ignore[override]  # as allreduce
            self, output_tensors: list[Tensor], input_tensors: list[Tensor],
            opts: dist.AllToAllOptions | None = None) -> EnqueuedWork:
        return self._issue("alltoall", lambda: self._gloo.alltoall(
            output_tensors, input_tensors, opts or dist.AllToAllOptions()), inputs=input_tensors)

    def barrier(  # type: ignore[override]  # as allreduce
            self, opts: dist.BarrierOptions | None = None) -> EnqueuedWork:
        return self._issue("barrier", lambda: self._gloo.barrier(opts or dist.BarrierOptions()), blocking=True)

    # -- point-to-point (NCCL numbers these apart from collectives) -------------------------------
    def send(self, tensors: list[Tensor], dst: int, tag: int = 0) -> EnqueuedWork:
        return self._issue("send", lambda: self._gloo.send(tensors, dst, tag), collective=False, inputs=tensors,
                           root=dst)

    def recv(self, tensors: list[Tensor], src: int, tag: int = 0) -> EnqueuedWork:
        return self._issue("recv", lambda: self._gloo.recv(tensors, src, tag), collective=False, outputs=tensors,
                           root=src)

    def recv_anysource(self, tensors: list[Tensor], tag: int = 0) -> EnqueuedWork:
        return self._issue("recv_anysource", lambda: self._gloo.recv_anysource(tensors, tag), collective=False)


# This backend's op names -> torch's hook op names (HookOpName members, torch >= 2.14), most specific first:
# torch 2.14 names a base, coalesced or single-tensor variant by its plain op; 2.15 has their own names.
_HOOK_OP_NAMES: dict[str, tuple[str, ...]] = {
    "allreduce": ("ALLREDUCE",), "allreduce_coalesced": ("ALLREDUCE_COALESCED", "ALLREDUCE"),
    "broadcast": ("BROADCAST",), "reduce": ("REDUCE",), "allgather": ("ALLGATHER",),
    "_allgather_base": ("ALLGATHER_BASE", "ALLGATHER"), "allgather_coalesced": ("ALLGATHER_COALESCED", "ALLGATHER"),
    "allgather_into_tensor_coalesced": ("ALLGATHER_INTO_TENSOR_COALESCED", "ALLGATHER"),
    "gather": ("GATHER",), "scatter": ("SCATTER",), "reduce_scatter": ("REDUCE_SCATTER",),
    "_reduce_scatter_base": ("REDUCE_SCATTER_BASE", "REDUCE_SCATTER"),
    "reduce_scatter_tensor_coalesced": ("REDUCE_SCATTER_TENSOR_COALESCED", "REDUCE_SCATTER"),
    "alltoall_base": ("ALLTOALL_BASE", "ALLTOALL"), "alltoall": ("ALLTOALL",), "barrier": ("BARRIER",),
    "send": ("SEND",), "recv": ("RECV",),
}


def _hook_names() -> dict[str, Any]:
    try:
        from torch._C._distributed_c10d import HookOpName  # type: ignore[attr-defined, unused-ignore]  # torch >= 2.14
    except ImportError:
        return {}
    found = {op: next((getattr(HookOpName, n) for n in names if hasattr(HookOpName, n)), None)
             for op, names in _HOOK_OP_NAMES.items()}
    return {op: member for op, member in found.items() if member is not None}


_HOOK_NAMES = _hook_names()


class _HookArgs:
    """What torch passes a collective hook (``PreHookArgs`` / ``PostHookArgs``: the post-hook's ``work`` set
    once issued)."""

    __slots__ = ("name", "op_id", "async_op", "input_tensors", "output_tensors", "root", "work")

    def __init__(self, name: Any, op_id: int, async_op: bool, inputs: list[Tensor], outputs: list[Tensor],
                 root: int) -> None:
        self.name, self.op_id, self.async_op, self.root = name, op_id, async_op, root
        self.input_tensors, self.output_tensors = inputs, outputs
        self.work: Any = None


def _create(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta) -> GlooAsyncGroup:
    return GlooAsyncGroup(store, rank, size, timeout)


def _blocking_inner_ops(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def object_collective(*args: Any, **kwargs: Any) -> Any:
        outer = getattr(_local, "in_object_collective", False)
        _local.in_object_collective = True
        try:
            return fn(*args, **kwargs)
        finally:
            _local.in_object_collective = outer

    object_collective.__gloo_async__ = True  # type: ignore[attr-defined]
    return object_collective


def register() -> None:
    """Make ``init_process_group("gloo_async")`` (and ``new_group(backend="gloo_async")``) available.

    Also marks torch's object collectives so that their inner tensor ops block on ``gloo_async`` groups,
    as the device-to-host copies inside them do on NCCL. Idempotent."""
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create, devices=["cpu"])
    c10d = dist.distributed_c10d
    for name in _OBJECT_COLLECTIVES:
        fn = getattr(c10d, name, None)
        if fn is None or getattr(fn, "__gloo_async__", False):
            continue
        wrapped = _blocking_inner_ops(fn)
        setattr(c10d, name, wrapped)
        if getattr(dist, name, None) is fn:
            setattr(dist, name, wrapped)
