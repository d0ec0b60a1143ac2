"""Hooks that note setup facts where they happen: a model wrapped by DDP, FSDP or ``fully_shard``, and
``torch.cuda.set_device``. Each runs once per call of a setup function, never per collective.

FSDP is not imported by dtwatch (it costs seconds): its hooks go in as soon as the training script
imports ``torch.distributed.fsdp`` (a one-shot import hook), before the script's ``from ... import
fully_shard`` binds the name. Every hook is registered with the recorder, which restores the originals
on uninstall.
"""
from __future__ import annotations

import functools
import importlib.abc
import inspect
import sys
import threading
from collections.abc import Callable
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from dtwatch.record.setup_probe import SetupFacts, SetupHost, _device_fact, caller_site

FSDP_MODULE = "torch.distributed.fsdp"
_FULLY_SHARD_HOMES = ("torch.distributed.fsdp", "torch.distributed._composable.fsdp")
_POLICY_FIELDS = ("param_dtype", "reduce_dtype", "buffer_dtype", "output_dtype")


class _Depth(threading.local):
    depth = 0  # inside a wrap already noted (FSDP's auto-wrap constructs inner units through __init__)


def describe_policy(policy: Any) -> str:
    """``param=bfloat16,reduce=float32`` for a mixed-precision policy (DDP, FSDP, fully_shard); "" for none."""
    if policy is None:
        return ""
    parts = []
    for name in _POLICY_FIELDS:
        value = getattr(policy, name, None)
        if value is not None:
            parts.append(f"{name.split('_')[0]}={str(value).replace('torch.', '')}")
    return ",".join(parts)


def group_key(pg: Any = None, mesh: Any = None) -> str:
    """What a wrap shares its parameters over: the process group's name, or the mesh's ranks."""
    if mesh is not None:
        try:
            return "mesh:" + ",".join(str(r) for r in mesh.mesh.flatten().tolist()[:64])
        except Exception:  # noqa: BLE001
            return "mesh"
    groups = pg if isinstance(pg, tuple) else (pg,)
    names = []
    for g in groups:
        try:
            g = g if g is not None else dist.distributed_c10d._get_default_group()
            names.append(str(dist.distributed_c10d._get_process_group_name(g)))
        except Exception:  # noqa: BLE001
            names.append("?")
    return "+".join(names)


def start_setup_facts(rec: SetupHost, patch: Callable[[Any, str, Any], None]) -> SetupFacts:
    """The recorder's setup facts, with their hooks in place (see :func:`install_setup_hooks`)."""
    facts = SetupFacts(rec)
    install_setup_hooks(rec, facts, patch)
    return facts


def install_setup_hooks(rec: SetupHost, facts: SetupFacts, patch: Callable[[Any, str, Any], None]) -> None:
    """Hook DDP, ``torch.cuda.set_device`` and (now or when imported) FSDP. ``patch(owner, attr, wrapper)``
    registers a replacement with the recorder."""
    depth = _Depth()
    from torch.nn.parallel import DistributedDataParallel

    patch(DistributedDataParallel, "__init__", _wrap_init(rec, facts, depth, "DDP", DistributedDataParallel.__init__))
    if hasattr(torch.cuda, "set_device"):
        patch(torch.cuda, "set_device", _set_device(rec, facts, torch.cuda.set_device))

    def hook_fsdp(module: ModuleType) -> None:
        fsdp_class = getattr(module, "FullyShardedDataParallel", None)
        if fsdp_class is not None and not hasattr(fsdp_class.__init__, "__dtwatch_original__"):
            patch(fsdp_class, "__init__", _wrap_init(rec, facts, depth, "FSDP", fsdp_class.__init__))
        for home in _FULLY_SHARD_HOMES:
            owner = sys.modules.get(home)
            original = getattr(owner, "fully_shard", None)
            if original is not None and not hasattr(original, "__dtwatch_original__"):
                patch(owner, "fully_shard", _fully_shard(rec, facts, depth, original))

    if FSDP_MODULE in sys.modules:
        hook_fsdp(sys.modules[FSDP_MODULE])
    else:
        finder = AfterImport(FSDP_MODULE, hook_fsdp, rec)
        sys.meta_path.insert(0, finder)
        facts.closers.append(finder.remove)


def _wrap_init(rec: SetupHost, facts: SetupFacts, state: _Depth, kind: str, original: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N807 - replaces a class's __init__
        if state.depth == 0:
            try:
                bound = signature.bind_partial(self, *args, **kwargs).arguments
                module = bound.get("module")
                group = group_key(bound.get("process_group"), bound.get("device_mesh"))
                if isinstance(module, torch.nn.Module):
                    facts.wrapped(kind, [module], group, describe_policy(bound.get("mixed_precision")),
                                  caller_site(sys._getframe(1)))
            except Exception as exc:  # noqa: BLE001
                rec.fail(f"noting a {kind} wrap", exc)
        state.depth += 1
        try:
            return original(self, *args, **kwargs)
        finally:
            state.depth -= 1

    __init__.__dtwatch_original__ = original  # type: ignore[attr-defined]
    return __init__


def _fully_shard(rec: SetupHost, facts: SetupFacts, state: _Depth, original: Callable) -> Callable:
    @functools.wraps(original)
    def fully_shard(module: Any, *args: Any, **kwargs: Any) -> Any:
        if state.depth == 0:
            try:
                modules = list(module) if isinstance(module, (list, tuple)) else [module]
                facts.wrapped("fully_shard", [m for m in modules if isinstance(m, torch.nn.Module)],
                              group_key(mesh=kwargs.get("mesh")), describe_policy(kwargs.get("mp_policy")),
                              caller_site(sys._getframe(1)))
            except Exception as exc:  # noqa: BLE001
                rec.fail("noting a fully_shard wrap", exc)
        state.depth += 1
        try:
            return original(module, *args, **kwargs)
        finally:
            state.depth -= 1

    fully_shard.__dtwatch_original__ = original  # type: ignore[attr-defined]
    return fully_shard


def _set_device(rec: SetupHost, facts: SetupFacts, original: Callable) -> Callable:
    @functools.wraps(original)
    def set_device(device: Any) -> None:
        original(device)
        if threading.current_thread() is not threading.main_thread():
            return  # torch's own threads (a DataLoader's pin-memory thread) follow the main thread's device
        try:
            facts.set_device(_device_fact(torch.device("cuda", torch.cuda.current_device())), "set_device",
                             caller_site(sys._getframe(1)))
        except Exception as exc:  # noqa: BLE001
            rec.fail("noting torch.cuda.set_device", exc)

    set_device.__dtwatch_original__ = original  # type: ignore[attr-defined]
    return set_device


class AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``callback(module)`` right after module ``name`` is first imported (before the importer
    receives it), then removes itself from ``sys.meta_path``."""

    def __init__(self, name: str, callback: Callable[[ModuleType], None], rec: SetupHost) -> None:
        self.name, self.callback, self.rec = name, callback, rec
        self.busy = False

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> ModuleSpec | None:
        if fullname != self.name or self.busy:
            return None
        self.busy = True
        try:
            spec = None
            for finder in list(sys.meta_path):
                find = getattr(finder, "find_spec", None)
                if finder is self or find is None:
                    continue
                spec = find(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self.busy = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _ThenCall(spec.loader, self)
        return spec

    def fired(self, module: ModuleType) -> None:
        self.remove()
        try:
            self.callback(module)
        except Exception as exc:  # noqa: BLE001
            self.rec.fail(f"hooking {self.name}", exc)

    def remove(self) -> None:
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass


class _ThenCall(importlib.abc.Loader):
    def __init__(self, loader: Any, finder: AfterImport) -> None:
        self.loader, self.finder = loader, finder

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # The module's loader is the real one again before anything else sees it.
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        self.finder.fired(module)
