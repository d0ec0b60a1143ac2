"""Installing the recorder into ``torch.distributed``, and taking it out again.

``install()`` replaces each function listed in :mod:`dtwatch.ops` (in ``torch.distributed`` and
``torch.distributed.distributed_c10d``) with a wrapper made by :func:`~dtwatch.record.wrapper.make_wrapper`,
the one recording path. It also follows the default process group's life (the ring is created when the
group appears and stops when it goes), counts DataLoader epochs and optimizer steps, hooks the setup
functions whose facts the setup checks compare (:mod:`dtwatch.record.wraps`), and hooks the
process's end (``atexit``, ``sys.excepthook``; the signal files of :mod:`dtwatch.record.endings` come
with the ring). ``uninstall()`` restores every function it replaced, where it is still dtwatch's.
Work that can wait runs in :mod:`dtwatch.record.sampling_thread`'s thread; the state is
:class:`~dtwatch.record.recorder.Recorder`'s.

The recorder never changes arguments or results and never raises into the caller: a failure of its
own disables recording for that call and produces one warning per process.
"""
from __future__ import annotations

import atexit
import functools
import logging
import os
import sys
import threading
import warnings
from types import TracebackType
from typing import Any

import torch.distributed as dist

import dtwatch.paths as paths
from dtwatch.config import Config
from dtwatch.ops import OP_KINDS, bind
from dtwatch.record.native import choose as choose_native
from dtwatch.record.native import make_native_wrapper
from dtwatch.record.recorder import Recorder
from dtwatch.record.wrapper import make_wrapper
from dtwatch.ring import EXIT_DETACHED

log = logging.getLogger("dtwatch")

_make_wrapper = make_wrapper  # the name benchmarks/overhead.py times the hot path by

_ACTIVE: Recorder | None = None
_INSTALL_LOCK = threading.Lock()


def active() -> Recorder | None:
    return _ACTIVE


def _patch(rec: Recorder, owner: Any, attr: str, wrapper: Any) -> None:
    original = getattr(owner, attr)
    setattr(owner, attr, wrapper)
    rec.patched.append((owner, attr, original, wrapper))


def install(**options: Any) -> bool:
    """Start recording in this process. Idempotent; returns False if dtwatch was already installed.

    Options (each also ``DTWATCH_<NAME>`` in the environment; arguments win): see :class:`Config`.
    Safe without torchrun and before ``init_process_group``: the ring is created when the default
    process group appears.
    """
    global _ACTIVE
    config = Config.from_env(**options)  # raises ConfigError on a bad argument
    with _INSTALL_LOCK:
        if _ACTIVE is not None:
            warnings.warn("dtwatch.install() called twice; keeping the first installation", RuntimeWarning,
                          stacklevel=2)
            return False
        if not dist.is_available():
            log.warning("dtwatch: torch.distributed is not available in this torch build; nothing to record")
            return False
        fastpath = choose_native(config.native)  # raises ConfigError for native='on' that cannot load
        rec = Recorder(config, fastpath)
        _apply_env(rec)
        c10d = dist.distributed_c10d
        for name in OP_KINDS:
            original = getattr(c10d, name, None)
            if original is None or getattr(original, "__dtwatch_original__", None) is not None:
                continue
            spec = bind(name, original)
            if spec is None:
                log.warning("dtwatch: torch.distributed.%s has an unexpected signature; not recorded", name)
                continue
            wrapper = make_native_wrapper(fastpath, rec, original, spec) or make_wrapper(rec, original, spec)
            _patch(rec, c10d, name, wrapper)
            if getattr(dist, name, None) is original:
                _patch(rec, dist, name, wrapper)
        _patch_lifecycle(rec)
        _patch_group_creation(rec)
        _patch_iteration(rec)
        try:
            from dtwatch.record.wraps import start_setup_facts

            rec.setup = start_setup_facts(rec, functools.partial(_patch, rec))
        except Exception as exc:  # noqa: BLE001
            rec.fail("hooking setup functions (DDP/FSDP wraps, set_device)", exc)
        rec.prev_excepthook = sys.excepthook

        def excepthook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
            try:
                rec.on_exception(exc_type, exc, tb)
            except Exception:  # noqa: BLE001 - the user's hook below must run whatever happens here
                pass
            rec.prev_excepthook(exc_type, exc, tb)

        rec.excepthook = excepthook
        sys.excepthook = excepthook
        _patch_exits(rec)
        atexit.register(rec.on_exit)
        _ACTIVE = rec
        rec.attach()  # no-op until the default process group exists
        rec.watch_for_group()  # no-op once attached
        return True


def uninstall() -> bool:
    """Stop recording and restore every patched function (only where it is still dtwatch's)."""
    global _ACTIVE
    with _INSTALL_LOCK:
        rec = _ACTIVE
        if rec is None:
            return False
        rec.stopped.set()
        rec.stop_watching_for_group()
        for owner, attr, original, wrapper in reversed(rec.patched):
            if getattr(owner, attr, None) is wrapper:
                setattr(owner, attr, original)
            else:
                log.warning("dtwatch: %s.%s was replaced by someone else; leaving it",
                            getattr(owner, "__name__", owner), attr)
        rec.patched.clear()
        if rec.optimizer_hook is not None:
            rec.optimizer_hook.remove()
        if sys.excepthook is rec.excepthook:
            sys.excepthook = rec.prev_excepthook
        atexit.unregister(rec.on_exit)
        rec.signal_files.remove()
        rec.detach()
        if rec.hooks is not None:
            rec.hooks.remove_all()
        if rec.setup is not None:
            rec.setup.close()
        if rec.ring is not None:
            rec.ring.set_exit(EXIT_DETACHED, 0, "dtwatch uninstalled")
        rec.mm = None
        _ACTIVE = None
        return True


def _apply_env(rec: Recorder) -> None:
    if not rec.config.torch_env:
        return
    from dtwatch.record.torchenv import apply_torch_env

    prefix = paths.torch_fr_prefix(rec.run_dir)
    initialised = dist.is_initialized()
    changes = apply_torch_env(rec.config.fr_buffer_size, prefix)
    if initialised and changes:
        log.warning(
            "dtwatch: installed after init_process_group; these settings apply only to process groups "
            "created from now on, not to the existing ones: %s. Import dtwatch.auto (or call "
            "dtwatch.install()) before init_process_group.", ", ".join(c.split("=", 1)[0] for c in changes),
        )
    elif changes:
        try:
            os.makedirs(os.path.dirname(prefix), exist_ok=True)
        except OSError:
            pass


def _patch_lifecycle(rec: Recorder) -> None:
    """Attach when the default process group appears and detach when it goes, by whatever route.

    ``_update_default_pg`` is the c10d function every creation and destruction of the default group
    passes through, called by its module-global name, so hooking it covers callers that imported
    ``init_process_group`` by name before dtwatch was installed (``torch.distributed.device_mesh``).
    The public ``init_process_group`` / ``destroy_process_group`` are wrapped as well: on a torch
    without that hook they are the route, and ``destroy`` must stop the sampler before the groups go.
    """
    c10d = dist.distributed_c10d
    init_original = c10d.init_process_group
    destroy_original = c10d.destroy_process_group
    update_original = getattr(c10d, "_update_default_pg", None)

    @functools.wraps(init_original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        result = init_original(*args, **kwargs)
        try:
            rec.attach()
        except Exception as exc:  # noqa: BLE001
            rec.fail("attaching after init_process_group", exc)
        return result

    @functools.wraps(destroy_original)
    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        group = args[0] if args else kwargs.get("group")
        if group is None or group is rec.default_pg:
            rec.detach()  # stop sampling groups that are going away
        else:
            rec.forget_group(group)
        result = destroy_original(*args, **kwargs)
        try:
            rec.watch_for_group()  # a job may create its default group again
        except Exception as exc:  # noqa: BLE001
            rec.fail("watching for a new process group", exc)
        return result

    for owner in (c10d, dist):
        if getattr(owner, "init_process_group", None) is init_original:
            _patch(rec, owner, "init_process_group", init_process_group)
        if getattr(owner, "destroy_process_group", None) is destroy_original:
            _patch(rec, owner, "destroy_process_group", destroy_process_group)

    if update_original is not None:
        @functools.wraps(update_original)
        def _update_default_pg(pg: Any) -> Any:
            result = update_original(pg)
            try:
                if pg is not rec.default_pg and rec.mm is not None:
                    rec.detach()  # destroyed, or replaced (shrink): the old group's ring ends here
                if pg is None:
                    rec.watch_for_group()
                else:
                    rec.attach()
            except Exception as exc:  # noqa: BLE001
                rec.fail("following the default process group", exc)
            return result

        _patch(rec, c10d, "_update_default_pg", _update_default_pg)


def _patch_group_creation(rec: Recorder) -> None:
    """Where torch calls its collective hooks (:mod:`dtwatch.record.hooks`), put them on every new process
    group as c10d registers it, before its first collective: a tensor-parallel mesh's groups may see only
    functional collectives, which no wrapper records."""
    hooks = rec.hooks
    c10d = dist.distributed_c10d
    original = getattr(c10d, "_register_process_group", None)
    if hooks is None or original is None:
        return

    @functools.wraps(original)
    def _register_process_group(group_name: Any, pg: Any) -> Any:
        result = original(group_name, pg)
        try:
            hooks.add(pg)
        except Exception as exc:  # noqa: BLE001
            rec.fail("adding the collective hooks to a new process group", exc)
        return result

    _patch(rec, c10d, "_register_process_group", _register_process_group)


def _patch_exits(rec: Recorder) -> None:
    """``sys.exit(n)`` and ``os._exit(n)`` note their status and line before they end the process: a
    framework's ``sys.exit(1)`` after an error is no normal exit, and ``os._exit`` leaves no other trace."""
    from dtwatch.record.endings import exit_call_facts

    sys_exit, os_exit = sys.exit, os._exit

    @functools.wraps(sys_exit)
    def exit_(*args: Any) -> Any:
        try:
            rec.on_exit_call(exit_call_facts("sys.exit", args[0] if args else None, sys._getframe(1)))
        except Exception:  # noqa: BLE001 - the exit goes ahead whatever happens here
            pass
        return sys_exit(*args)

    @functools.wraps(os_exit)
    def os_exit_(status: int) -> Any:
        try:
            rec.on_exit_call(exit_call_facts("os._exit", status, sys._getframe(1)))
        except Exception:  # noqa: BLE001
            pass
        return os_exit(status)

    _patch(rec, sys, "exit", exit_)
    _patch(rec, os, "_exit", os_exit_)


def _patch_iteration(rec: Recorder) -> None:
    from torch.utils.data import DataLoader

    init_original, iter_original = DataLoader.__init__, DataLoader.__iter__

    @functools.wraps(init_original)
    def dataloader_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init_original(self, *args, **kwargs)
        try:
            rec.loader_makes.note(self, sys._getframe(1))  # which loader it is, across ranks
        except Exception as exc:  # noqa: BLE001
            rec.fail("noting where a DataLoader was made", exc)

    @functools.wraps(iter_original)
    def dataloader_iter(self: Any) -> Any:
        slot = -1
        try:
            slot = rec.loader_started(self)
        except Exception as exc:  # noqa: BLE001
            rec.fail("recording a DataLoader epoch", exc)
        iterator = iter_original(self)
        if slot >= 0:
            try:
                rec.loader_iterating(iterator)  # the end of its loop is noted (collectives issued while it ran)
            except Exception as exc:  # noqa: BLE001
                rec.fail("following a DataLoader epoch", exc)
        if slot >= 0 and rec.setup is not None:
            try:
                rec.setup.loader_epoch(self, slot, iterator)  # sampler facts; first batch fingerprinted
            except Exception as exc:  # noqa: BLE001
                rec.fail("noting a DataLoader's setup", exc)
        return iterator

    _patch(rec, DataLoader, "__init__", dataloader_init)
    _patch(rec, DataLoader, "__iter__", dataloader_iter)
    _patch_loader_ends(rec)
    try:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        rec.optimizer_hook = register_optimizer_step_post_hook(lambda *_: rec.advance_step(explicit=False))
    except Exception as exc:  # noqa: BLE001
        rec.fail("hooking optimizer steps", exc)


def _patch_loader_ends(rec: Recorder) -> None:
    """A DataLoader iterator's ``__next__``: its StopIteration is where an epoch's loop ran out of batches
    (with persistent workers the iterator outlives its loop: letting go of it cannot say so)."""
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    next_original = _BaseDataLoaderIter.__next__

    # Per batch: one more Python call around the iterator's own __next__ (about 40 ns, measured; that
    # __next__ alone enters a profiler range, microseconds, and a batch takes tens of microseconds at
    # least). Nothing else happens but on an epoch's last call.
    @functools.wraps(next_original)
    def dataloader_next(self: Any) -> Any:
        try:
            return next_original(self)
        except StopIteration:
            rec.loader_exhausted(self)  # never raises
            raise

    _patch(rec, _BaseDataLoaderIter, "__next__", dataloader_next)


def step() -> None:
    """Mark the end of a training step (turns off counting optimizer steps for this process)."""
    rec = _ACTIVE
    if rec is not None:
        rec.advance_step(explicit=True)


__all__ = ["Recorder", "active", "install", "step", "uninstall"]
