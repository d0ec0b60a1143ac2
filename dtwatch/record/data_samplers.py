"""What a DataLoader says about how its data is split across ranks: read from its attributes, at the
start of an epoch (never per batch), for the setup checks (:mod:`dtwatch.diagnose.setup`); and which
loader it is, the same on every rank (:class:`LoaderMakes`), for the uneven-loader warning.

A sampler is *distributed* when it (or the batch sampler around it) carries its rank and the number
of replicas (``DistributedSampler`` and its subclasses, Lightning's wrapper: ``num_replicas``/``rank``;
Accelerate's shards: ``num_processes``/``process_index``). It is *not distributed* when it is one of
torch's own single-process samplers over a map-style dataset. Anything else (an ``IterableDataset``,
a custom sampler) is unknown: the batch fingerprints decide.
"""
from __future__ import annotations

import functools
import os
import threading
import weakref
import zlib
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from dtwatch.code_paths import USER, classify_file

_DIST_ATTRS = (("num_replicas", "rank"), ("num_processes", "process_index"))
_SINGLE_PROCESS = (SequentialSampler, RandomSampler, SubsetRandomSampler, WeightedRandomSampler)


def _int_attr(obj: Any, name: str) -> int | None:
    try:
        value = getattr(obj, name, None)
    except Exception:  # noqa: BLE001 - a property of user code
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _rank_attrs(obj: Any) -> tuple[int, int] | None:
    """(replicas, rank) when ``obj`` says which share of the data it serves."""
    for n_name, r_name in _DIST_ATTRS:
        n, r = _int_attr(obj, n_name), _int_attr(obj, r_name)
        if n is not None and r is not None:
            return n, r
    return None


def _candidates(loader: Any) -> list[Any]:
    """The sampler objects of a loader, outermost first: batch sampler, what it wraps, the sampler."""
    out: list[Any] = []
    batch = getattr(loader, "batch_sampler", None)
    for obj in (batch, getattr(batch, "batch_sampler", None), getattr(batch, "sampler", None),
                getattr(loader, "sampler", None)):
        if obj is not None and all(obj is not seen for seen in out):
            out.append(obj)
    return out


def describe_loader(loader: Any, training: bool) -> dict[str, Any]:
    """The facts of one DataLoader at the start of an epoch (JSON-ready; keys documented in
    :mod:`dtwatch.record.setup_probe`)."""
    dataset = getattr(loader, "dataset", None)
    iterable = isinstance(dataset, IterableDataset)
    candidates = _candidates(loader)
    sampler = getattr(loader, "sampler", None)
    distributed: bool | None = None
    owner = sampler
    replicas = rank = None
    for obj in candidates + ([dataset] if dataset is not None else []):
        attrs = _rank_attrs(obj)
        if attrs is not None:
            (replicas, rank), owner, distributed = attrs, obj, True
            break
    if distributed is None and not iterable and isinstance(sampler, _SINGLE_PROCESS):
        batch = getattr(loader, "batch_sampler", None)
        if batch is None or type(batch) is BatchSampler:
            distributed = False
    try:
        length = len(dataset) if dataset is not None and not iterable else -1
    except Exception:  # noqa: BLE001 - a dataset without a length
        length = -1
    shuffle = getattr(owner, "shuffle", None) if distributed else isinstance(sampler, RandomSampler)
    return {
        "sampler": type(owner).__name__ if owner is not None else None,
        "dist": distributed,
        "srank": rank,
        "sreplicas": replicas,
        "shuffle": shuffle if isinstance(shuffle, bool) else None,
        "seed": _int_attr(owner, "seed") if distributed else None,
        "epoch": _int_attr(owner, "epoch") if distributed else None,
        # Which sampler object (within this process): a loader iterated at two lines - a peek at the first
        # batch before set_epoch, then the loop - has one sampler, whose epochs are judged together.
        "sid": id(owner) if distributed else None,
        "drop_last": [_bool_attr(loader, "drop_last"), _bool_attr(owner, "drop_last") if distributed else None],
        "dlen": length,
        "iterable": iterable,
        "train": training,
    }


def _bool_attr(obj: Any, name: str) -> bool | None:
    try:
        value = getattr(obj, name, None)
    except Exception:  # noqa: BLE001
        return None
    return value if isinstance(value, bool) else None


def training_now(models: list[torch.nn.Module]) -> bool:
    """Whether an epoch starting now feeds training: gradients are on and no wrapped model is in eval
    mode (evaluation loops run under ``torch.no_grad()`` or after ``model.eval()``)."""
    if not torch.is_grad_enabled():
        return False
    return all(getattr(m, "training", True) for m in models)


# ---------------------------------------------------------------------------------------------------
# which loader it is, across ranks
# ---------------------------------------------------------------------------------------------------
MADE_FRAMES = 3  # the user's frames at a DataLoader's construction that name it: its line and two callers
Frame = tuple[str, int, str]  # (file, line, function) of a user frame


@dataclass(frozen=True)
class Made:
    """Where a DataLoader was made: the user's frames, innermost first, and its identity across ranks."""

    chain: tuple[Frame, ...]
    ident: int  # never 0 (0 in a ring: written before loaders were told apart)


class LoaderMakes:
    """Which DataLoader is which, the same on every rank: noted once per loader, when it is made
    (``DataLoader.__init__``), and kept weakly (loader -> :class:`Made`).

    Within a process the loader object is known; across ranks its identity is where it was made - the
    user's line that made it and the two user frames above (a ``make_loader(ds)`` helper makes the
    training and the evaluation loader at one line; its callers' lines tell them apart) - its dataset's
    place among those given to loaders made there (loaders made in a loop over datasets; a loader made
    again each epoch over the same dataset keeps its place), and the type names of its dataset and
    samplers. Nothing in it is a per-rank value (a length, an object id), so the same loader has the same
    identity on every rank."""

    def __init__(self) -> None:
        self._made: dict[int, tuple[weakref.ref, Made]] = {}  # id(loader) -> (weak loader, Made)
        self._datasets: dict[tuple, list[weakref.ref]] = {}  # where -> the datasets of loaders made there
        self._chains: dict[Frame, set[tuple[Frame, ...]]] = {}  # innermost frame -> chains made there
        self._kinds: dict[str, int] = {}
        self._lock = threading.Lock()

    def note(self, loader: Any, frame: FrameType | None) -> None:
        """``loader`` was just made by the code in ``frame`` (a few us, once per loader)."""
        chain: list[Frame] = []
        while frame is not None and len(chain) < MADE_FRAMES:
            code = frame.f_code
            kind = self._kinds.get(code.co_filename)
            if kind is None:
                kind = self._kinds[code.co_filename] = classify_file(code.co_filename)
            if kind == USER:
                chain.append((code.co_filename, frame.f_lineno or 0, getattr(code, "co_qualname", code.co_name)))
            frame = frame.f_back
        # By file name, line and function: the same on every rank even where checkouts lie in other directories.
        where = tuple((os.path.basename(f), line, fn) for f, line, fn in chain)
        with self._lock:
            place = self._place(where, getattr(loader, "dataset", None))
            if chain:
                self._chains.setdefault(chain[0], set()).add(tuple(chain))
        key = id(loader)
        self._made[key] = (weakref.ref(loader, functools.partial(self._forget, key)),
                           Made(tuple(chain), _ident(where, place, loader)))

    def made(self, loader: Any) -> Made:
        entry = self._made.get(id(loader))
        if entry is not None and entry[0]() is loader:
            return entry[1]
        return Made((), _ident((), 0, loader))  # made before dtwatch was installed (or copied): its types only

    def shown_frame(self, made: Made) -> Frame | None:
        """The line that names ``made`` to the user: where it was made, or, where other loaders were made at
        that line too (a helper), the first caller that tells it apart from them."""
        if not made.chain:
            return None
        with self._lock:
            others = [c for c in self._chains.get(made.chain[0], ()) if c != made.chain]
        for depth, frame in enumerate(made.chain):
            if all(len(c) <= depth or c[depth] != frame for c in others):
                return frame
        return made.chain[0]

    def _place(self, where: tuple, dataset: Any) -> int:
        """``dataset``'s place among the datasets of the loaders made at ``where`` (in the order they came;
        a place whose dataset is gone is taken again)."""
        refs = self._datasets.setdefault(where, [])
        free = -1
        for i, ref in enumerate(refs):
            known = ref()
            if known is dataset:
                return i
            if known is None and free < 0:
                free = i
        try:
            ref = weakref.ref(dataset)
        except TypeError:  # a list, a tuple: it cannot be told from the others made here
            return 0
        if free >= 0:
            refs[free] = ref
            return free
        refs.append(ref)
        return len(refs) - 1

    def _forget(self, key: int, ref: weakref.ref) -> None:
        entry = self._made.get(key)
        if entry is not None and entry[0] is ref:
            self._made.pop(key, None)


def _type_name(obj: Any) -> str:
    return "-" if obj is None else f"{type(obj).__module__}.{type(obj).__qualname__}"


def _ident(where: tuple, place: int, loader: Any) -> int:
    parts = [f"{f}:{line}:{fn}" for f, line, fn in where] + [str(place)] + [
        _type_name(getattr(loader, name, None)) for name in ("dataset", "sampler", "batch_sampler")]
    return zlib.crc32("|".join(parts).encode()) or 1


@dataclass
class LoaderSlot:
    """One entry of the ring's loader table, as the recorder keeps it (per loader and loop line)."""

    slot: int
    epochs: int = 0
    ended: int = 0  # the latest epoch whose loop ended
    shown: Frame | None = None  # the frame shown as where it was made, and its site id
    made_site: int = 0


@dataclass
class LoaderRun:
    """One epoch of a loader, from its start (``clock``: where the rank's collectives stood) to the end of
    its loop: the iterator ran out (``StopIteration``) or the loop let go of it (``break``)."""

    ring: Any
    entry: LoaderSlot
    epoch: int
    clock: tuple[int, dict[int, int], int]
    ref: weakref.ref | None = field(default=None)
