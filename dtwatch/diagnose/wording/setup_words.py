"""The words of the setup warnings (:mod:`dtwatch.diagnose.setup`): one sentence per check, from the facts the
check decided and stored in the finding (its ranks, its site and ``details``). Nothing here decides; changing
how a warning reads touches this module only.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

from dtwatch.diagnose.evidence import Evidence
from dtwatch.diagnose.wording.phrases import fmt_ranks, fmt_site

_SET_EPOCH = "call sampler.set_epoch(epoch) each epoch"


def show(v: Any) -> str:
    """One fact's value as the warning shows it (``1,234``; lists joined by ``/``; ``none``)."""
    if isinstance(v, (list, tuple)):
        return "/".join(show(x) for x in v) or "none"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return "none" if v in (None, "") else str(v)


def by_value(values: dict[int, Any]) -> dict[str, list[int]]:
    """The ranks sharing each shown value, in rank order."""
    groups: dict[str, list[int]] = defaultdict(list)
    for rank, v in sorted(values.items()):
        groups[show(v)].append(rank)
    return dict(groups)


def _values(values: dict[int, Any]) -> str:
    """``1,234 on ranks 0-2; 1,300 on rank 3``."""
    return "; ".join(f"{v} on {fmt_ranks(rs)}" for v, rs in by_value(values).items())


def _ranked(values: dict) -> dict[int, Any]:
    """Facts stored per rank (JSON keys are strings) back to rank -> value."""
    return {int(r): v for r, v in values.items()}


def _not_distributed(ranks: list[int], site: dict | None, d: dict, ev: Evidence | None) -> str:
    return (f"{fmt_ranks(ranks)} of WORLD_SIZE={d['world']} {'runs' if len(ranks) == 1 else 'run'} optimizer steps at "
            f"{fmt_site(site, ev)} without a process group (init_process_group was never called): every rank trains "
            "alone on its own copy of the model and nothing is averaged across ranks; initialise torch.distributed "
            "(with Accelerate on CPU, launch with --cpu or ACCELERATE_USE_CPU=1)")


def _same_device(ranks: list[int], site: dict | None, d: dict, ev: Evidence | None) -> str:
    device = d["device"]
    name = f"{device.get('type')}:{device.get('index')}" + (f" ({device['uuid']})" if device.get("uuid") else "")
    how = f", set at {fmt_site(site, ev)}" if site else ""
    count, used = d.get("visible"), int(d["in_use"])
    advice = "bind each process to its local rank (torch.cuda.set_device(int(os.environ['LOCAL_RANK'])), not RANK)"
    if count is not None and count > used:
        where = f"they share one GPU while {count - used} other GPU(s) they can see stay idle; "
    elif count is not None:
        where = (f"they share one GPU, and the process sees only {used} GPU(s) (CUDA_VISIBLE_DEVICES "
                 f"{d.get('cvd') or 'unset'}); ")
        advice = ("start as many ranks per node as it has GPUs (torchrun --nproc-per-node), or set "
                  "NCCL_MULTI_RANK_GPU_ENABLE=1 (NCCL >= 2.30) if sharing is meant")
    else:
        where = "they share one GPU; "
    local = ", ".join(str(v) for _, v in sorted(_ranked(d["local_ranks"]).items()))
    return f"{fmt_ranks(ranks)} on {d['host']} (local ranks {local}) all use {name}{how}: {where}{advice}"


def _why_same_batch(d: dict) -> str:
    if d.get("distributed") is False:
        return (f"its {d.get('sampler')} is not distributed, so every rank iterates the whole dataset in the same "
                f"order; use DistributedSampler(dataset) as its sampler (and {_SET_EPOCH})")
    if d.get("iterable"):
        return ("its IterableDataset is not split by rank, so every rank reads the same stream; shard it by "
                "rank (torch.distributed.get_rank() in __iter__, or the library's split-by-node helper)")
    return (f"its sampler ({d.get('sampler')}) does not split the data by rank, so the ranks train on the same "
            "data; use a distributed sampler")


def _same_data(ranks: list[int], site: dict | None, d: dict, ev: Evidence | None) -> str:
    where = f"the DataLoader at {fmt_site(site, ev)}"
    if d["evidence"] == "sampler_rank":
        return (f"the {d.get('sampler')} of {where} was built with rank={d['sampler_rank']} "
                f"(num_replicas={d.get('num_replicas')}) on {fmt_ranks(ranks)}: they draw the same samples and "
                "train on the same data; pass rank=dist.get_rank() and num_replicas=dist.get_world_size() "
                "(or leave both to their defaults)")
    if d["evidence"] == "first_batch":
        return f"{fmt_ranks(ranks)} got the same first batch in epoch {d['epoch']} of {where}: {_why_same_batch(d)}"
    return (f"{where} uses a {d.get('sampler')}, which is not distributed, over the same dataset on "
            f"{fmt_ranks(ranks)}: every rank iterates the whole dataset each epoch; use "
            f"DistributedSampler(dataset) as its sampler (and {_SET_EPOCH})")


def _same_shuffle(ranks: list[int], site: dict | None, d: dict, ev: Evidence | None) -> str:
    return (f"the {d.get('sampler')} (shuffle=True) of the DataLoader at {fmt_site(site, ev)} stayed at epoch "
            f"{d['epoch']} for {d['epochs_started']} epochs on {fmt_ranks(ranks)}: sampler.set_epoch(epoch) is never "
            "called, so every epoch visits the data in the same order; call it before each epoch")


def _drop_last(ranks: list[int], site: dict | None, d: dict, ev: Evidence | None) -> str:
    shown = {r: f"DataLoader {show(v[0] if v else None)}" + (f", sampler {show(v[1])}" if len(v) > 1 and
                                                             v[1] is not None else "")
             for r, v in _ranked(d["drop_last"]).items()}
    return (f"the DataLoader at {fmt_site(site, ev)} has different drop_last settings across ranks "
            f"(drop_last: {_values(shown)}): whenever the data does not divide evenly the ranks that drop "
            "the last batch leave the loop early and the others hang in their next collective; use the same "
            "drop_last (DataLoader and DistributedSampler) on every rank")


_WRAP_FIELDS = {"params": "parameter count", "trainable": "trainable parameter count", "dtypes": "parameter dtypes",
                "policy": "mixed-precision policy"}


def divergent_fact(diff: dict, ev: Evidence | None = None) -> str:
    """What one difference of ``config_divergence`` is about: ``the torch version``, ``the parameter count of the
    model wrapped by DDP at train.py:40``."""
    if diff["fact"] == "torch":
        return "the torch version"
    return f"the {_WRAP_FIELDS[diff['fact']]} of the model wrapped by {diff['wrap']} at {fmt_site(diff['site'], ev)}"


def _config_divergence(ranks: list[int], site: dict | None, d: dict, ev: Evidence | None) -> str:
    parts = [f"{divergent_fact(diff, ev)} ({_values(_ranked(diff['values']))})" for diff in d["differences"]]
    return ("ranks disagree on facts they should share: " + "; ".join(parts) + ". Ranks that run different "
            "versions or build different models can hang in a collective or train wrong silently")


SENTENCES: dict[str, Callable[[list[int], dict | None, dict, Evidence | None], str]] = {
    "not_distributed": _not_distributed, "same_device": _same_device, "same_data": _same_data,
    "same_shuffle": _same_shuffle, "drop_last": _drop_last, "config_divergence": _config_divergence,
}


def setup_summary(ranks: list[int], site: dict | None, details: dict, evidence: Evidence | None = None) -> str:
    """The sentence of one setup warning, from its ranks, site and ``details`` (``check`` names the check);
    ``evidence`` shows paths relative to the working directory (as recorded without it)."""
    return SENTENCES[details["check"]](ranks, site, details, evidence)
