"""What a DataLoader says about how its data is split across ranks: read from its attributes, at the
start of an epoch (never per batch), for the setup checks (:mod:`dtwatch.diagnose.setup`).

A sampler is *distributed* when it (or the batch sampler around it) carries its rank and the number
of replicas (``DistributedSampler`` and its subclasses, Lightning's wrapper: ``num_replicas``/``rank``;
Accelerate's shards: ``num_processes``/``process_index``). It is *not distributed* when it is one of
torch's own single-process samplers over a map-style dataset. Anything else (an ``IterableDataset``,
a custom sampler) is unknown: the batch fingerprints decide.
"""
from __future__ import annotations

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
    :mod:`dtwatch.record.setup_facts`)."""
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
