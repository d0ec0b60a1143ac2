"""torch's own Flight Recorder dumps turned into rank states, for a job that ran without dtwatch (pure, no I/O).

A dump (``torch._C._distributed_c10d._dump_fr_trace()``, or the file torch writes per rank under the
``TORCH_FR_DUMP_TEMP_FILE`` / ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE`` prefix; pickle or JSON) is a dict with
``version``, ``pg_config``, ``pg_status`` and ``entries``: one entry per collective the rank issued, newest last,
with its process group, counters, op (``profiling_name``: ``gloo:all_reduce``, ``nccl:send 0->1``), input
sizes and dtypes, state and the Python frames that issued it. :func:`rank_state` makes a
:class:`~dtwatch.diagnose.rank_state.RankState` of one rank's dump, so that :func:`dtwatch.diagnose.diagnose` and its
program-order alignment run unchanged.

What the entries say, measured on torch 2.8-2.15 with gloo (real 2-4 rank jobs, ``tests/scripts/fr_job.py``) and
read in torch's source for NCCL:

* **Numbering.** A collective is numbered by ``collective_seq_id``, per group. The backend pairs the ranks'
  collectives by that count (gloo's collective tags, NCCL's ``seqCollective_``); ``op_id`` also counts the
  rank's point-to-point ops, which differ from rank to rank (a send only its two ranks make), so across ranks
  only ``collective_seq_id`` lines the calls up. (A watched run maps FR entries onto dtwatch's own numbers
  instead: :mod:`dtwatch.diagnose.flight`.)
* **Completion.** NCCL's watchdog moves an entry's ``state`` from ``scheduled`` (enqueued) through ``started``
  to ``completed``; gloo's stays ``scheduled`` and the entry is ``retired`` when its work ends. An entry is
  taken as completed when either says so. gloo retires a collective that failed on a lost peer too: such
  an entry reads as completed.
* **Point-to-point.** NCCL records send/recv (``is_p2p``, ``nccl:send 0->1``); gloo's recorder does not:
  its p2p ops show only as numbers ``op_id`` skips (:func:`p2p_gaps`).
* **Groups.** ``pg_config`` maps each group's name to its ranks on NCCL; gloo's dumps hold one entry keyed
  ``""`` whose ranks are not those of any one group: members are then the ranks whose dumps use the group
  (:func:`group_members`).

What a dump does not hold, and the state therefore leaves unknown: the process (pid, host, alive or not, how
it ended), where a rank is when it is in no collective (no stack), step counts and loader lengths. The state
says so (``origin`` :data:`FLIGHT_RECORDER`, ``alive`` None, ``exit_state`` :data:`UNKNOWN`, ``step`` -1),
and the diagnosis words its findings for such ranks accordingly.
"""
from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from dtwatch.diagnose.flight import frame_sites
from dtwatch.diagnose.rank_state import Call, GroupProgress, RankState
from dtwatch.diagnose.wording.dump_words import dump_fault, entry_fault

FLIGHT_RECORDER = "flight_recorder"  # RankState.origin of a state made from a dump
UNKNOWN = "unknown"  # RankState.exit_state when nothing says whether or how the process ended
P2P_GROUP_SUFFIX = ":p2p"  # NCCL's point-to-point entries are kept apart from the group's collectives
COMPLETED = "completed"
REQUIRED = ("process_group", "collective_seq_id", "profiling_name")
MAX_NUMBER = 2**40  # a counter past this is garbled (as the ring reader bounds sequence numbers)
MAX_RANKS = 2**20  # a rank past this is garbled (the ranks without a dump are listed one by one)
_P2P = re.compile(r"^(?P<op>send|recv)\s+(?P<a>\d+)\s*(?:->|<-)\s*(?P<b>\d+)$")
_DTYPES = {"Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16", "Long": "int64",
           "Int": "int32", "Short": "int16", "Char": "int8", "Byte": "uint8", "Bool": "bool",
           "ComplexFloat": "complex64", "ComplexDouble": "complex128"}


@dataclass
class Dump:
    """One rank's dump, as read (``path``: where it came from; ``written``: when, if known, else 0)."""

    rank: int
    doc: dict
    path: str = ""
    written: float = 0.0
    fmt: str = "pickle"  # "pickle" / "json"

    @property
    def version(self) -> str:
        return str(self.doc.get("version", ""))

    @property
    def entries(self) -> list[dict]:
        return list(self.doc.get("entries") or [])

    @property
    def has_frames(self) -> bool:
        return any(e.get("frames") for e in self.entries)


def dump_problem(doc: Any) -> str | None:
    """What makes ``doc`` (an unpickled or JSON-decoded file) not a Flight Recorder dump; None if it is one."""
    if not isinstance(doc, dict):
        return dump_fault("not_a_dict", found=type(doc).__name__)
    if "entries" not in doc or "version" not in doc:
        return dump_fault("no_keys", missing=[k for k in ("version", "entries") if k not in doc])
    if not isinstance(doc["version"], str):
        return dump_fault("version_not_text", found=type(doc["version"]).__name__)
    entries = doc["entries"]
    if not isinstance(entries, list):
        return dump_fault("entries_not_a_list", found=type(entries).__name__)
    for i, e in enumerate(entries):
        wrong = _entry_problem(i, e)
        if wrong is not None:
            return wrong
    for key in ("pg_config", "pg_status"):
        if doc.get(key) is not None and not isinstance(doc[key], dict):
            return dump_fault("config_not_a_dict", found=type(doc[key]).__name__, key=key)
    return None


def _entry_problem(i: int, e: Any) -> str | None:
    """What makes entry ``i`` of a dump not a Flight Recorder entry; None if it is one."""
    if not isinstance(e, dict):
        return entry_fault(i, "not_a_dict", found=type(e).__name__)
    missing = [k for k in REQUIRED if k not in e]
    if missing:
        return entry_fault(i, "no_keys", missing=missing)
    pg = e["process_group"]
    if not isinstance(pg, (list, tuple)) or not pg or not isinstance(pg[0], str):
        return entry_fault(i, "process_group_not_a_pair")
    if not isinstance(e["profiling_name"], str) or not all(isinstance(x, str) for x in pg):
        return entry_fault(i, "names_not_text")
    for key in ("collective_seq_id", "op_id", "p2p_seq_id"):
        if (key == "collective_seq_id" or e.get(key) is not None) and not (
                _is_int(e[key]) and 0 <= e[key] < MAX_NUMBER):
            return entry_fault(i, "number_out_of_range", key=key)
    for key in ("time_created_ns", "time_discovered_started_ns", "time_discovered_completed_ns"):
        if e.get(key) is not None and not (_is_int(e[key]) and e[key] >= 0):
            return entry_fault(i, "time_not_ns", key=key)
    dtypes = e.get("input_dtypes") or []
    if not isinstance(e.get("state") or "", str) or not isinstance(dtypes, list) or \
            not all(isinstance(d, str) for d in dtypes):
        return entry_fault(i, "state_or_dtypes_not_text")
    frames, sizes = e.get("frames") or [], e.get("input_sizes") or []
    if not isinstance(frames, list) or not isinstance(sizes, list):
        return entry_fault(i, "frames_or_sizes_not_lists")
    if not all(isinstance(f, dict) and isinstance(f.get("filename", ""), str) and
               (f.get("line") is None or _is_int(f["line"])) for f in frames):
        return entry_fault(i, "frame_not_a_site")
    if not all(isinstance(d, list) and all(_is_int(x) for x in d) for d in sizes):
        return entry_fault(i, "sizes_not_integers")
    return None


def _is_int(v: Any) -> bool:
    return type(v) is int  # not a bool (a subclass of int), nor anything else


@functools.lru_cache(maxsize=1024)
def split_name(profiling_name: str) -> tuple[str, str, int]:
    """(backend, op, peer) of a profiling name: ``gloo:all_reduce`` -> (gloo, all_reduce, -1);
    ``nccl:send 0->1`` -> (nccl, send, 1); ``nccl:recv 1<-0`` -> (nccl, recv, 0)."""
    backend, _, op = profiling_name.rpartition(":")
    m = _P2P.match(op.strip())
    if m:
        return backend, m.group("op"), int(m.group("b"))
    return backend, op.strip(), -1


def completed(entry: dict) -> bool:
    """The entry's work ended: NCCL's state says so, or the work was retired (gloo's only sign)."""
    return entry.get("state") == COMPLETED or entry.get("retired") is True


def fingerprint(op: str, entry: dict) -> str:
    """``all_reduce[float32:4x3]`` from the entry's first input (``barrier[]`` with none)."""
    sizes = entry.get("input_sizes") or []
    dtypes = entry.get("input_dtypes") or []
    if not sizes or not isinstance(sizes[0], (list, tuple)):
        return f"{op}[]"
    dtype = str(dtypes[0]) if dtypes else "?"
    shape = "x".join(str(d) for d in sizes[0])
    return f"{op}[{_DTYPES.get(dtype, dtype.lower())}:{shape}]"


_RANK_LIST = re.compile(r"\[\s*(\d+\s*(,\s*\d+\s*)*)?,?\s*\]")


def parse_ranks(value: Any) -> list[int] | None:
    """A pg_config ``ranks`` field (a list, or its text ``"[0, 1]"``) as a list; None if it is neither."""
    if isinstance(value, str):
        text = value.strip() or "[]"
        value = list(_parse_rank_text(text)) if _RANK_LIST.fullmatch(text) else None
    if isinstance(value, (list, tuple)) and all(_is_int(r) and 0 <= r < MAX_RANKS for r in value):
        return [int(r) for r in value]
    return None


@functools.lru_cache(maxsize=64)
def _parse_rank_text(text: str) -> tuple[int, ...]:
    """``"[0, 1, 2]"`` (checked by the caller) as (0, 1, 2); every rank's dump repeats the same text: parsed once."""
    return tuple(int(x) for x in text.strip("[] ").split(",") if x.strip())


def listed_ranks(doc: dict) -> set[int]:
    """Every rank any group config of a dump lists (gloo's unnamed one included): ranks of the job."""
    out: set[int] = set()
    for cfg in (doc.get("pg_config") or {}).values():
        if isinstance(cfg, dict):
            out.update(parse_ranks(cfg.get("ranks")) or [])
    return out


def configured_groups(doc: dict) -> dict[str, list[int]]:
    """Group name -> ranks, from a dump's pg_config where it names groups (NCCL); gloo's single entry keyed
    ``""`` names none and gives nothing."""
    out: dict[str, list[int]] = {}
    for key, cfg in (doc.get("pg_config") or {}).items():
        if not key or not isinstance(cfg, dict):
            continue
        ranks = parse_ranks(cfg.get("ranks"))
        if ranks:
            out[str(key)] = ranks
    return out


def _group(entry: dict) -> tuple[str, str]:
    pg = entry["process_group"]
    return str(pg[0]), str(pg[1]) if len(pg) > 1 else ""


def is_default(name: str, desc: str) -> bool:
    return desc == "default_pg" or (name == "0" and not desc)


@dataclass
class JobFacts:
    """What the dumps of one job say about it as a whole (see :func:`job_facts`)."""

    world_size: int
    world_known: bool  # a named group config states the world; False: the highest rank dumped or listed bounds it
    members: dict[str, list[int]]  # group -> member ranks
    members_inferred: list[str] = field(default_factory=list)  # groups whose members only the entries tell
    dumped: list[int] = field(default_factory=list)
    no_dump: list[int] = field(default_factory=list)  # ranks of the world with no dump

    def to_dict(self) -> dict:
        return {"world_size": self.world_size, "world_size_known": self.world_known, "members": self.members,
                "members_inferred": self.members_inferred, "dumped": self.dumped, "no_dump": self.no_dump}


def job_facts(dumps: Iterable[Dump]) -> JobFacts:
    """World size, group members and the ranks that left no dump."""
    dumps = list(dumps)
    dumped = sorted({d.rank for d in dumps})
    configured: dict[str, list[int]] = {}
    for d in dumps:
        for name, ranks in configured_groups(d.doc).items():
            configured.setdefault(name, ranks)
    users: dict[str, set[int]] = {}
    default: set[str] = set()
    for d in dumps:
        for e in d.entries:
            name, desc = _group(e)
            users.setdefault(name, set()).add(d.rank)
            if is_default(name, desc):
                default.add(name)
    world_cfg = max((len(r) for n, r in configured.items() if n in default or n == "0"), default=0)
    listed = set().union(*(listed_ranks(d.doc) for d in dumps)) if dumps else set()
    world = max(world_cfg, max(dumped, default=-1) + 1, max(listed, default=-1) + 1)
    members, inferred = {}, []
    for name in sorted(set(users) | set(configured)):
        if name in configured:
            members[name] = sorted(configured[name])
        elif name in default:
            members[name] = list(range(world))
        else:
            members[name] = sorted(users.get(name, set()))
            inferred.append(name)
    return JobFacts(world, world_cfg > 0, members, inferred, dumped, sorted(set(range(world)) - set(dumped)))


def p2p_gaps(entries: list[dict]) -> dict[str, int]:
    """Per group, how many op numbers a gloo dump skips: point-to-point ops its recorder does not log (NCCL's
    log them, and then none is skipped)."""
    out: dict[str, int] = {}
    by_group: dict[str, list[tuple[int, int]]] = {}
    for e in entries:
        if _is_int(e.get("op_id")) and not e.get("is_p2p"):
            by_group.setdefault(_group(e)[0], []).append((int(e["collective_seq_id"]), int(e["op_id"])))
    for name, pairs in by_group.items():
        pairs = sorted(set(pairs))
        # Before the first entry too, where it is the group's first collective (the buffer has not wrapped).
        skipped = pairs[0][1] - 1 if pairs[0][0] == 1 else 0
        skipped += sum(max(0, (b - a) - (q - p)) for (p, a), (q, b) in zip(pairs, pairs[1:], strict=False))
        if skipped:
            out[name] = skipped
    return out


def _sites(frames: list) -> tuple[dict | None, dict | None]:
    """:func:`~dtwatch.diagnose.flight.frame_sites` of an entry's frames, once per distinct stack (every rank's
    dump repeats the same few); copies, so that no two calls share a dict."""
    try:
        site, user = _sites_of(tuple(tuple(f.items()) for f in frames))
    except (TypeError, AttributeError):  # a value that cannot be a key (a crafted dump): no cache
        site, user = frame_sites([f for f in frames if isinstance(f, dict)])
    site = dict(site) if site is not None else None
    return site, (site if user == site else dict(user) if user is not None else None)


@functools.lru_cache(maxsize=4096)
def _sites_of(key: tuple) -> tuple[dict | None, dict | None]:
    return frame_sites([dict(items) for items in key])


def _call(e: dict, name: str) -> Call:
    _, op, peer = split_name(str(e["profiling_name"]))
    site, user = _sites(list(e.get("frames") or []))
    t = (e.get("time_created_ns") or 0) / 1e9
    done = completed(e)
    t_done = (e.get("time_discovered_completed_ns") or 0) / 1e9
    seq = int(e["p2p_seq_id"] if e.get("is_p2p") and _is_int(e.get("p2p_seq_id")) else e["collective_seq_id"])
    return Call(op=op, group=name, seq=seq, site=site, t_enter=t, t_exit=max(t, t_done, 1e-9) if done else 0.0,
                fingerprint=fingerprint(op, e), is_async=not done, user_site=user, peer=peer)


def _contiguous_tail(calls: list[Call]) -> list[Call]:
    """The newest run of calls without a gap in their numbers: a gap would be read as calls issued from C++."""
    calls = sorted(calls, key=lambda c: c.seq)
    start = 0
    for i in range(1, len(calls)):
        if calls[i].seq > calls[i - 1].seq + 1:
            start = i
    return calls[start:]


def rank_state(dump: Dump, facts: JobFacts) -> RankState:
    """One rank's :class:`RankState` from its dump (see the module doc for what it leaves unknown)."""
    by_group: dict[str, list[Call]] = {}
    backend = ""
    newest = 0.0
    for e in dump.entries:
        name, _ = _group(e)
        b, _, _ = split_name(str(e["profiling_name"]))
        backend = backend or b
        if e.get("is_p2p"):
            name += P2P_GROUP_SUFFIX
        call = _call(e, name)
        newest = max(newest, call.t_enter, call.t_exit)
        by_group.setdefault(name, []).append(call)
    groups: dict[str, GroupProgress] = {}
    for name, calls in by_group.items():
        p2p = name.endswith(P2P_GROUP_SUFFIX)
        kept = sorted(calls, key=lambda c: c.seq) if p2p else _contiguous_tail(calls)
        seq = max(c.seq for c in kept)
        done = [c.seq for c in kept if not c.in_flight]
        base = name[: -len(P2P_GROUP_SUFFIX)] if p2p else name
        groups[name] = GroupProgress(
            name=name, members=list(facts.members.get(base) or []) or None, seq=seq,
            completed=max(done, default=0), py_seq=seq, cpp_seq=0, cpp_seq_time=0.0, recent=kept,
            complete=not p2p and kept[0].seq == 1 and len(kept) == len(calls),
        )
    open_calls = sorted((c for g in groups.values() for c in g.recent if c.in_flight), key=lambda c: c.t_enter)
    written = dump.written or newest
    return RankState(
        rank=dump.rank, local_rank=-1, world_size=facts.world_size, host="", pid=0, job_id="", start_time=0.0,
        restart_count=0, backend=backend, alive=None, proc_state="", exit_state=UNKNOWN, exit_reason="",
        exit_time=0.0, heartbeat_time=written, step=-1, step_time=0.0, groups=groups, open_calls=open_calls,
        main_site=None, main_top_site=None, main_site_since=0.0, main_stack=[], loaders=[], last_activity=newest,
        origin=FLIGHT_RECORDER,
    )


def states_from_dumps(dumps: Iterable[Dump]) -> tuple[list[RankState], JobFacts]:
    """Every dumped rank's state, and the job's facts (world size, members, ranks that left no dump)."""
    dumps = list(dumps)
    facts = job_facts(dumps)
    return [rank_state(d, facts) for d in sorted(dumps, key=lambda d: d.rank)], facts


__all__ = ["COMPLETED", "Dump", "FLIGHT_RECORDER", "JobFacts", "MAX_RANKS", "P2P_GROUP_SUFFIX", "UNKNOWN", "completed",
           "configured_groups", "dump_problem", "fingerprint", "job_facts", "listed_ranks", "p2p_gaps", "parse_ranks",
           "rank_state", "split_name", "states_from_dumps"]
