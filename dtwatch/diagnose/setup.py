"""Setup mistakes that never hang: the job runs, the loss goes down, and the result is wrong or the
cluster is wasted. Each check is one pure function of the ranks' states (their setup facts, see
:mod:`dtwatch.record.setup_probe`) returning at most one warning, with the ranks and the line.

* ``not_distributed``: WORLD_SIZE > 1, but a rank runs optimizer steps without a process group.
* ``same_device``: ranks of one host use the same GPU (``set_device(RANK)`` instead of ``LOCAL_RANK``).
* ``same_data``: ranks train on the same data: identical first batches of an epoch, a non-distributed
  sampler over the same dataset, or distributed samplers built with the same rank.
* ``same_shuffle``: a ``DistributedSampler(shuffle=True)`` whose epoch never changes (``set_epoch``
  is never called): every epoch sees the same order.
* ``drop_last`` (kind ``uneven_iterations``): a DataLoader's ``drop_last`` differs across ranks.
* ``config_divergence``: ranks disagree on what they should share (torch version; the parameter
  count, dtypes and mixed-precision policy of a model at its DDP/FSDP wrap).

The decisions are here, as facts in each finding's ``details``; their words are in
:mod:`dtwatch.diagnose.wording.setup_words`. :data:`CHECKS` says what each costs and where it is paid.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from dtwatch.diagnose.evidence import Evidence
from dtwatch.diagnose.loaders import loader_key
from dtwatch.diagnose.model import WARNING, Finding, Kind
from dtwatch.diagnose.rank_state import RankState
from dtwatch.diagnose.wording.phrases import with_source
from dtwatch.diagnose.wording.setup_words import by_value, setup_summary, show

SETTLE_S = 5.0  # wraps unchanged this long (or every rank stepped): the facts are final enough to compare


# ---------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------
def _finding(kind: str, check: str, ranks: Iterable[int], site: dict | None, now: float, compared: Iterable[int],
             ev: Evidence | None, **facts: Any) -> Finding:
    """A setup warning, worded from its facts; ``compared``: the ranks whose facts the decision read (see
    :class:`Hold`)."""
    culprits = sorted(set(ranks))
    details = {"check": check, "compared": sorted(set(compared)), **facts}
    return Finding(kind=kind, severity=WARNING, ranks=culprits, summary=setup_summary(culprits, site, details, ev),
                   site=site, detected=now, onset=now, details=details)


def _site_key(site: dict | None) -> tuple | None:
    return (site.get("file"), site.get("line")) if site else None


LoaderKey = tuple


def loader_facts(states: list[RankState]) -> dict[LoaderKey, dict[int, tuple[dict, dict | None]]]:
    """DataLoaders by loop line (or table position when no line is known): rank -> (facts, site)."""
    out: dict[LoaderKey, dict[int, tuple[dict, dict | None]]] = defaultdict(dict)
    for s in states:
        by_slot = {str(ld.get("index")): ld for ld in s.loaders}
        for slot, facts in (s.setup.get("loaders") or {}).items():
            ld = by_slot.get(str(slot))
            site = (ld.get("user_site") or ld.get("site")) if ld else None
            key = loader_key(ld) if ld else ("#loader", str(slot))
            out[key][s.rank] = (facts, site)
    return out


def _deviants(values: dict[int, Any]) -> list[int]:
    """Ranks whose value is not the reference one: the most common, ties going to the lowest rank's."""
    shown = {r: show(v) for r, v in values.items()}
    counts = Counter(shown.values())
    top = max(counts.values())
    reference = next(shown[r] for r in sorted(shown) if counts[shown[r]] == top)
    return sorted(r for r, v in shown.items() if v != reference)


# ---------------------------------------------------------------------------------------------------
# the checks
# ---------------------------------------------------------------------------------------------------
def not_distributed(states: list[RankState], now: float, ev: Evidence | None = None) -> Finding | None:
    alone = [(s, s.setup["no_pg"]) for s in states if isinstance(s.setup.get("no_pg"), dict)]
    alone = [(s, f) for s, f in alone if int(f.get("world") or s.world_size or 1) > 1]
    if not alone:
        return None
    ranks = [s.rank for s, _ in alone]
    first = alone[0][1]
    world = int(first.get("world") or alone[0][0].world_size)
    site = with_source(first.get("site"), ev)
    return _finding(Kind.NOT_DISTRIBUTED, "not_distributed", ranks, site, now, ranks, ev,
                    world=world, steps={str(s.rank): int(f.get("steps", 0)) for s, f in alone})


def same_device(states: list[RankState], now: float, ev: Evidence | None = None) -> Finding | None:
    users: dict[tuple, list[tuple[int, dict]]] = defaultdict(list)
    for s in states:
        d = s.setup.get("device")
        if isinstance(d, dict) and d.get("type") not in (None, "cpu", "meta"):
            if d.get("uuid"):
                key: tuple = (s.host, "uuid", d["uuid"])
            elif d.get("index") is not None:
                # Without a UUID an index names the same GPU only under the same CUDA_VISIBLE_DEVICES.
                key = (s.host, d.get("type"), int(d["index"]), s.setup.get("cvd"))
            else:
                continue
            users[key].append((s.rank, d))
        elif s.gpu_uuid:  # the ring's identity, read when CUDA was already initialised at attach
            users[(s.host, "uuid", s.gpu_uuid)].append((s.rank, {"type": "cuda", "index": s.device_index,
                                                                   "uuid": s.gpu_uuid}))
    by_rank = {s.rank: s for s in states}
    shared = [v for v in users.values() if len(v) > 1 and not sharing_on_purpose([by_rank[r] for r, _ in v])]
    if not shared:
        return None
    group = shared[0]
    ranks = [r for r, _ in group]
    device = group[0][1]
    host = by_rank[ranks[0]].host
    site = next((with_source(d.get("site"), ev) for _, d in reversed(group) if d.get("site")), None)
    local = {str(r): by_rank[r].local_rank for r in ranks}
    # What the host has: only a count the ranks saw says whether other GPUs stand idle.
    on_host = [d for key, v in users.items() if key[0] == host for _, d in v]
    counts = {d["count"] for d in on_host if isinstance(d.get("count"), int)}
    visible = counts.pop() if len(counts) == 1 else None  # ranks that disagree: not known
    return _finding(Kind.SAME_DEVICE, "same_device", ranks, site, now,
                    [r for key, v in users.items() if key[0] == host for r, _ in v], ev,
                    device=device, local_ranks=local, host=host, visible=visible,
                    in_use=len({key for key, v in users.items() if key[0] == host}),
                    cvd=by_rank[ranks[0]].setup.get("cvd"))


def sharing_on_purpose(ranks: list[RankState]) -> bool:
    """Every one of ``ranks`` set NCCL's switch for sharing a GPU (NCCL_MULTI_RANK_GPU_ENABLE=1), or each its
    own NCCL_HOSTID (how two ranks share a GPU before NCCL 2.30)."""
    shares = [s.setup.get("gpu_share") or {} for s in ranks]
    if all(str(sh.get("multi_rank", "")).strip() == "1" for sh in shares):
        return True
    hostids = [sh.get("hostid") for sh in shares]
    return all(hostids) and len(set(hostids)) == len(hostids)


def same_data(states: list[RankState], now: float, ev: Evidence | None = None) -> Finding | None:
    for per_rank in loader_facts(states).values():
        if len(per_rank) < 2:
            continue
        site = with_source(next((st for _, st in per_rank.values() if st), None), ev)
        # Distributed samplers built with the same rank draw the same indices.
        sranks = {r: f.get("srank") for r, (f, _) in per_rank.items() if f.get("dist") and f.get("srank") is not None}
        for srank, ranks in by_value(sranks).items():
            if len(ranks) > 1:
                f0 = per_rank[ranks[0]][0]
                return _finding(Kind.SAME_DATA, "same_data", ranks, site, now, per_rank, ev, evidence="sampler_rank",
                                sampler=f0.get("sampler"), sampler_rank=srank, num_replicas=f0.get("sreplicas"))
        training = {r: f for r, (f, _) in per_rank.items() if f.get("train") and not f.get("dist")}
        # Identical first batches of the same epoch.
        iterations = sorted({int(i) for f in training.values() for i in (f.get("fp") or {})})
        for it in iterations:
            fps = {r: f["fp"][str(it)] for r, f in training.items() if str(it) in (f.get("fp") or {})}
            for fp, ranks in by_value(fps).items():
                if len(ranks) > 1:
                    f0 = training[ranks[0]]
                    return _finding(Kind.SAME_DATA, "same_data", ranks, site, now, fps, ev, evidence="first_batch",
                                    epoch=it, fingerprint=fp, sampler=f0.get("sampler"), distributed=f0.get("dist"),
                                    iterable=bool(f0.get("iterable")))
        # A non-distributed sampler over the same dataset: every rank iterates all of it.
        sigs = {r: f.get("dsig") for r, f in training.items() if f.get("dist") is False and f.get("dsig")}
        for sig, ranks in by_value(sigs).items():
            if len(ranks) > 1:
                f0 = training[ranks[0]]
                return _finding(Kind.SAME_DATA, "same_data", ranks, site, now, sigs, ev, evidence="dataset",
                                dataset=sig, sampler=f0.get("sampler"))
    return None


def _sampler_epochs(state: RankState) -> dict[int, tuple[set[tuple], bool]]:
    """Per sampler object of one rank (facts ``sid``): the (seed, epoch) pairs noted at every line it was
    iterated, and whether each line started it at least twice."""
    out: dict[int, tuple[set[tuple], bool]] = {}
    for f in (state.setup.get("loaders") or {}).values():
        if f.get("sid") is None:
            continue
        seen, every_line_twice = out.get(f["sid"], (set(), True))
        out[f["sid"]] = (seen | {tuple(e) for e in f.get("epochs") or []},
                         every_line_twice and int(f.get("iters") or 0) >= 2)
    return out


def same_shuffle(states: list[RankState], now: float, ev: Evidence | None = None) -> Finding | None:
    """A shuffling DistributedSampler that stays at one epoch. Judged per sampler, over every line that
    iterates it: a peek at the first batch before ``set_epoch`` (the tutorials' ``next(iter(loader))``)
    sees the previous epoch at each epoch's start, but the loop after it sees the new one."""
    samplers = {s.rank: _sampler_epochs(s) for s in states}
    # A rank that moves another sampler's epoch knows set_epoch: the one it leaves alone is one whose order
    # does not matter (an evaluation loader whose loop starts with gradients still on).
    knows = {r for r, by_sid in samplers.items() if any(len(seen) > 1 for seen, _ in by_sid.values())}
    for per_rank in loader_facts(states).values():
        stale = {}
        for r, (f, _) in per_rank.items():
            if r in knows:
                continue
            epochs = [tuple(e) for e in f.get("epochs") or []]
            sid = f.get("sid")
            seen, every_line_twice = samplers[r][sid] if sid is not None else (set(epochs), True)
            # An evaluation loader's fixed order harms nobody: only loaders that fed training (grad on, models
            # in train mode at the epoch's start) are judged.
            if f.get("dist") and f.get("shuffle") and int(f.get("iters") or 0) >= 2 and len(epochs) >= 2 \
                    and len(seen) == 1 and every_line_twice and f.get("train") is not False:
                stale[r] = f
        if stale:
            ranks = sorted(stale)
            f0 = stale[ranks[0]]
            site = with_source(per_rank[ranks[0]][1], ev)
            seed, epoch = (f0.get("epochs") or [[None, None]])[-1]
            return _finding(Kind.SAME_SHUFFLE, "same_shuffle", ranks, site, now,
                            [r for r, (f, _) in per_rank.items() if int(f.get("iters") or 0) >= 2], ev,
                            epoch=epoch, seed=seed, epochs_started=int(f0.get("iters") or 0), sampler=f0.get("sampler"))
    return None


def drop_last_differs(states: list[RankState], now: float, ev: Evidence | None = None) -> Finding | None:
    for key, per_rank in loader_facts(states).items():
        values = {r: tuple(f.get("drop_last") or ()) for r, (f, _) in per_rank.items()}
        if len(set(values.values())) < 2:
            continue
        dropping = sorted(r for r, v in values.items() if any(v))
        ranks = dropping or sorted(values)
        site = with_source(next((st for _, st in per_rank.values() if st), None), ev)
        lengths = {str(s.rank): ld.get("length") for s in states if s.rank in per_rank for ld in s.loaders
                   if loader_key(ld) == key}
        return _finding(Kind.UNEVEN_ITERATIONS, "drop_last", ranks, site, now, per_rank, ev,
                        drop_last={str(r): list(v) for r, v in sorted(values.items())},
                        loader={"lengths": lengths, "site": site})
    return None


def config_divergence(states: list[RankState], now: float, ev: Evidence | None = None,
                      settle: float = SETTLE_S) -> Finding | None:
    reporting = [s for s in states if s.setup]
    if len(reporting) < 2:
        return None
    wraps: dict[tuple, dict[int, dict]] = defaultdict(dict)
    for s in reporting:
        for w in s.setup.get("wraps") or []:
            wraps[(_site_key(w.get("site")), w.get("kind"), w.get("group"))][s.rank] = w
    latest = max((float(w.get("t") or 0.0) for per in wraps.values() for w in per.values()), default=0.0)
    if not (all(s.step >= 1 for s in states) or now - latest >= settle):
        return None  # a wrap may still be under way on some rank
    diffs: list[dict] = []
    versions = {s.rank: s.setup.get("torch") for s in reporting if s.setup.get("torch")}
    if len(set(versions.values())) > 1:
        diffs.append({"fact": "torch", "values": versions, "site": None})
    for (_key, kind, group), per_rank in wraps.items():
        if len(per_rank) < 2:
            continue
        site = next(iter(per_rank.values())).get("site")
        for field in ("params", "trainable", "dtypes", "policy"):
            values = {r: w.get(field) for r, w in per_rank.items()}
            if len({show(v) for v in values.values()}) > 1:
                diffs.append({"fact": field, "wrap": kind, "values": values, "site": site, "group": group})
    if not diffs:
        return None
    ranks = sorted({r for d in diffs for r in _deviants(d["values"])})
    site = with_source(next((d["site"] for d in diffs if d["site"]), None), ev)
    return _finding(Kind.CONFIG_DIVERGENCE, "config_divergence", ranks, site, now,
                    {r for d in diffs for r in d["values"]}, ev,
                    differences=[{**d, "values": {str(r): v for r, v in sorted(d["values"].items())}} for d in diffs])


# ---------------------------------------------------------------------------------------------------
# the catalogue
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SetupCheck:
    """One setup check: what it finds, from which facts, and what those facts cost."""

    name: str
    kind: str
    finds: str
    evidence: str
    rank_cost: str  # on the training thread, and when
    background_cost: str  # in the rank, off the training thread
    watchdog_cost: str
    opt_out: str
    limits: str
    run: Callable[[list[RankState], float, Evidence | None], Finding | None]

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "run"}


_LOADER_COST = ("once per DataLoader epoch (its __iter__): about 15 sampler/loader attribute reads; for a loader's "
                "first 4 epochs (and any epoch where they change) an update of the in-memory facts; nothing per "
                "batch or per collective")
_WRITE_COST = "the facts block (<= 3 KiB of JSON) re-encoded and written into the ring, once per change"
_WATCHDOG_COST = "per poll: the facts block parsed with each ring (<= 3 KiB JSON per rank) and a dict comparison"

CHECKS: tuple[SetupCheck, ...] = (
    SetupCheck(
        "not_distributed", Kind.NOT_DISTRIBUTED.value,
        "WORLD_SIZE > 1 (torchrun's variables present) but the process runs optimizer steps with no default "
        "process group: every rank trains alone",
        "optimizer steps counted while no ring exists; after GRACE_S (10 s) of them the rank makes a ring without "
        "a group, with the line of its optimizer step",
        "per optimizer step while no process group exists (a time comparison); none once the group exists",
        "none (the ring without a group is made on the training thread, once)", _WATCHDOG_COST,
        "DTWATCH_AUTO_STEP=0 (no optimizer-step counting)",
        "needs optimizer.step() (or dtwatch.step()); reported GRACE_S after the first step", not_distributed),
    SetupCheck(
        "same_device", Kind.SAME_DEVICE.value,
        "two ranks of one host use the same CUDA device (torch.cuda.set_device(RANK) instead of LOCAL_RANK)",
        "the device at torch.cuda.set_device, at the DDP/FSDP wrap (its parameters' device) or in use when the "
        "process group appeared: index, UUID and CUDA_VISIBLE_DEVICES",
        "once per torch.cuda.set_device call and per wrap: one current_device() and get_device_properties()",
        _WRITE_COST, _WATCHDOG_COST, "none (no cost on CPU jobs)",
        "GPU only; without a UUID an index counts only under the same CUDA_VISIBLE_DEVICES", same_device),
    SetupCheck(
        "same_data", Kind.SAME_DATA.value,
        "ranks train on the same data: identical first batches of a training epoch, a non-distributed sampler "
        "over the same dataset, or distributed samplers built with the same rank",
        "per training DataLoader epoch: the sampler's class and rank attributes, and a fingerprint of the "
        "first batch (first 3 epochs); per loader once: a dataset signature (TensorDataset / HF datasets / Subset)",
        _LOADER_COST + "; plus, for the first batch of those epochs, one instance attribute set and removed",
        "for a loader's first 3 training epochs: the first batch hashed (<= 8 KiB per tensor, <= 32 KiB in all, "
        "blake2b) in a "
        "daemon thread; per loader once: the dataset signature, likewise bounded; " + _WRITE_COST,
        _WATCHDOG_COST, "DTWATCH_BATCH_FINGERPRINT=0 (no batch is read; the sampler-rank evidence remains)",
        "evaluation epochs (no grad, or a wrapped model in eval mode) are not compared; batches on a GPU are not "
        "read", same_data),
    SetupCheck(
        "same_shuffle", Kind.SAME_SHUFFLE.value,
        "a DistributedSampler with shuffle=True whose epoch never changes across epochs (set_epoch never called)",
        "the sampler's seed and epoch at each epoch start",
        _LOADER_COST, _WRITE_COST, _WATCHDOG_COST, "none",
        "reported at the start of the second epoch", same_shuffle),
    SetupCheck(
        "drop_last", Kind.UNEVEN_ITERATIONS.value,
        "a DataLoader's drop_last (or its DistributedSampler's) differs across ranks: batch counts differ "
        "whenever the data does not divide evenly",
        "drop_last of the DataLoader and of its distributed sampler at each epoch start",
        _LOADER_COST, _WRITE_COST, _WATCHDOG_COST, "none",
        "loaders are matched across ranks by where they were made and their loop's line", drop_last_differs),
    SetupCheck(
        "config_divergence", Kind.CONFIG_DIVERGENCE.value,
        "ranks disagree on world-level facts they should share: torch version, and for each DDP/FSDP/fully_shard "
        "wrap line the parameter count, trainable count, dtypes and mixed-precision policy",
        "torch.__version__ when the process group appears; the wrapped module's parameters when it is wrapped",
        "once per wrap: one pass over the module's parameters (numel, dtype); once at attach: torch version",
        _WRITE_COST, _WATCHDOG_COST, "none",
        f"compared once every rank has stepped or the wraps have been quiet for {SETTLE_S:.0f} s; "
        "wraps are matched by line and process group", config_divergence),
)


HOLD_S = 3.0  # a live warning waits this long from first sight, unless every rank's facts were compared


class Hold:
    """Live use: ranks do not reach a setup step at the same instant, and each check warns once per run, so
    a warning decided on the facts of some ranks waits ``hold`` seconds for the ranks a moment behind (or
    until every rank's facts were compared) and then names all the ranks it concerns."""

    def __init__(self, hold: float = HOLD_S) -> None:
        self.hold = hold
        self.first_seen: dict[str, float] = {}

    def due(self, found: list[Finding], now: float, world: int) -> list[Finding]:
        out = []
        for f in found:
            first = self.first_seen.setdefault(str(f.details.get("check")), now)
            if len(f.details.get("compared") or f.ranks) >= world or now - first >= self.hold:
                out.append(f)
        return out


def setup_warnings(states: list[RankState], now: float, ev: Evidence | None = None) -> list[Finding]:
    """Every setup check's warning for these states (at most one per check); ``ev`` shows source lines and
    paths (none without it)."""
    out = []
    for check in CHECKS:
        f = check.run(states, now, ev)
        if f is not None:
            out.append(f)
    return out
