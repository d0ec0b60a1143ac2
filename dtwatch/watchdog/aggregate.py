"""The job-level view: what the elected aggregator computes from every node's digest (pure: no I/O).

Every round the aggregator scans the digests of all ranks (:class:`~dtwatch.watchdog.summary.RankDigest`)
and decides which ranks every node's diagnosis must see (:func:`select_ranks`):

* a small job (up to :data:`FULL_VIEW_RANKS` ranks): all of them, so every node diagnoses as if it had
  read every other node;
* a large job: none while it progresses and nothing stands out; once nothing anywhere has progressed
  for a while (*suspect*), a rank ended, loaders differ or a finding names ranks: the ranks that stand out (a
  place - state, call, loader lengths, sequence numbers - shared by few ranks is shipped whole), the
  ranks the findings name, and exemplars of the common places in proportion to their sizes, so that a
  majority stays a majority in what the nodes compare.

The view's head (:class:`ViewHead`) is small and read by every node every round; the ranks' states
(the *body*) are read only when the head says they changed.
"""
from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

from dtwatch.diagnose.evidence import ViewSample
from dtwatch.watchdog.summary import BLOCKED, GONE, RankDigest

FULL_VIEW_RANKS = 64  # jobs up to this many ranks: every node sees every rank
SMALL_PLACE = 8  # a place shared by at most this many ranks is shipped whole (they stand out)
VIEW_EXEMPLARS = 32  # ranks of the common places shipped, in proportion to how many ranks share each
MAX_VIEW_RANKS = 160  # never more ranks than this in the body of a large job
NAMED_KEPT = 32  # ranks named by findings that are shipped
ENDED_KEPT = 8  # of the ranks that ended, the first ones shipped (besides the exemplars of their places)
SUSPECT_QUIET = 5.0  # seconds without progress anywhere before the ranks are shipped (at most a quarter of the window)
SLOW_FACTOR = 5  # healthy and quiet: exchange this many times less often


def exchange_interval(base: float, *, busy: bool) -> float:
    """Seconds between exchanges: ``base`` while a rank is inside a collective, the job looks suspect or an
    incident is open; ``SLOW_FACTOR`` times longer otherwise."""
    return base if busy else base * SLOW_FACTOR


def suspect_after(window: float) -> float:
    return min(SUSPECT_QUIET, window / 4)


@dataclass
class Selection:
    ranks: list[int]  # sorted
    total: int  # ranks in the job (as digested)
    suspect: bool  # nothing progressed for suspect_after(window)
    quiet: float  # seconds since the latest progress of any rank
    blocked: int  # ranks inside a collective


def select_ranks(digests: list[RankDigest], now: float, window: float, named: Iterable[int] = (), *,
                 full_view: int = FULL_VIEW_RANKS) -> Selection:
    """Which ranks every node's diagnosis needs to see; every rank in a job of up to ``full_view`` ranks."""
    if not digests:
        return Selection([], 0, False, 0.0, 0)
    by_rank = {d.rank: d for d in digests}
    last = max(d.last_activity for d in digests)
    quiet = max(0.0, now - last)
    suspect = quiet > suspect_after(window)
    blocked = sum(1 for d in digests if d.state == BLOCKED)
    total = len(by_rank)
    if total <= full_view:
        return Selection(sorted(by_rank), total, suspect, quiet, blocked)
    chosen = {r for r in named if r in by_rank}
    if len(chosen) > NAMED_KEPT:
        chosen = set(sorted(chosen)[:NAMED_KEPT])
    by_loaders: dict[tuple, list[int]] = defaultdict(list)
    for d in digests:
        by_loaders[d.loaders].append(d.rank)
    uneven = len(by_loaders) > 1
    ended = sorted((d.ending[2], d.rank) for d in digests if d.state == GONE and d.ending is not None)
    if not (suspect or ended or uneven or chosen):
        return Selection([], total, suspect, quiet, blocked)
    # A rank that ended is diagnosed at once (no window): the first ones to end are shipped.
    chosen.update(r for _t, r in ended[:ENDED_KEPT])
    places: dict[tuple, list[int]] = defaultdict(list)
    for d in digests:
        places[d.position() if suspect or ended else (d.loaders,)].append(d.rank)
    for rank in _proportional(places, total):
        chosen.add(rank)
    return Selection(sorted(chosen), total, suspect, quiet, blocked)


def _proportional(places: dict[tuple, list[int]], total: int) -> list[int]:
    """Ranks from each place: all of a small one; of a larger one a share of VIEW_EXEMPLARS proportional to
    its size, strictly more than any smaller place gets, so the order of the places' sizes survives."""
    ordered = sorted(places.values(), key=lambda rs: (len(rs), min(rs)))
    quotas = []
    prev_size, prev_quota = 0, 0
    for ranks in ordered:
        size = len(ranks)
        quota = size if size <= SMALL_PLACE else max(SMALL_PLACE + 1, size * VIEW_EXEMPLARS // total)
        if size > prev_size:
            quota = max(quota, prev_quota + 1)
        quota = min(quota, size)
        quotas.append(quota)
        prev_size, prev_quota = size, quota
    out: list[int] = []
    # The largest place first (the reference the others are compared with), then the smallest upwards.
    for i in [len(ordered) - 1] + list(range(len(ordered) - 1)):
        if len(out) >= MAX_VIEW_RANKS:
            break
        take = min(quotas[i], MAX_VIEW_RANKS - len(out))
        out.extend(sorted(ordered[i])[:take])
    return out


def named_ranks(findings: Iterable[dict]) -> list[int]:
    """Ranks the findings (as dicts) name: culprits first, then a few of those waiting on them."""
    out: list[int] = []
    for f in findings:
        out.extend(f.get("ranks") or [])
        out.extend((f.get("waiting_ranks") or [])[:4])
    return list(dict.fromkeys(out))


# -- the view's head --------------------------------------------------------------------------------
@dataclass
class ViewHead:
    aggregator: str
    term: int
    seq: int
    time: float
    nodes: int
    ranks: int
    suspect: bool
    quiet: float
    blocked: int
    want: list[int] | None  # node indices whose state the aggregator reads; None: every node's
    body: int  # sequence number of the body holding ``body_ranks`` (0: none yet)
    body_ranks: list[int] = field(default_factory=list)
    verdict: dict | None = None  # the aggregator's open incident: {"incident", "kind", "findings": [...]}
    # The body ranks' latest heartbeats (aligned with body_ranks): a hung job's body does not change, only
    # its heartbeats do, and every node reads the head anyway.
    beats: list[float] = field(default_factory=list)
    # Ranks chosen for the body whose node has not yet published a state as fresh as its digest (it does at
    # its next exchange): until the body holds them, a diagnosis of the view is not yet on what was chosen.
    pending: list[int] = field(default_factory=list)

    def sample(self) -> ViewSample | None:
        """What a node's view is a sample of: None in a job small enough to ship every rank (``want`` None)."""
        return ViewSample(self.ranks, self.blocked) if self.want is not None else None

    def encode(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> ViewHead:
        d = json.loads(data)
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


def verdict_of(incident: dict | None) -> dict | None:
    """What the head says of the aggregator's open incident (``Watchdog.incident``): its id, kind and, per
    finding, the kind, the ranks named and the sentence."""
    if not incident:
        return None
    findings = []
    for f in incident.get("findings") or []:
        d = f.to_dict() if hasattr(f, "to_dict") else dict(f)
        findings.append({"kind": str(d.get("kind")), "ranks": d.get("ranks") or [],
                         "waiting_ranks": (d.get("waiting_ranks") or [])[:16], "summary": d.get("summary", "")})
    return {"incident": incident.get("id"), "kind": incident.get("verdict"), "findings": findings}
