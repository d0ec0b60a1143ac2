"""torch's Flight Recorder entries mapped onto dtwatch's sequence numbers (pure functions, no I/O).

dtwatch numbers a group's collectives with torch's own counter, ``ProcessGroup._get_sequence_number_for_group()``
read after issuing the call. A Flight Recorder (FR) entry carries three counters, and which one equals
that number depends on the backend (measured with real 2-rank gloo jobs on torch 2.13.0 and 2.14.1;
NCCL from torch's source):

* **gloo**: the group counter advances for every op, p2p included, and FR's ``op_id`` equals it;
  ``collective_seq_id`` counts collectives only (gloo's FR logs no send/recv), so it falls behind by
  the p2p ops issued earlier in the group. Mapping: ``op_id``, offset 0.
* **NCCL**: the group counter is ``seqCollective_`` (p2p ops do not advance it), bumped before the
  entry is recorded, so ``collective_seq_id`` equals it; ``op_id`` also counts p2p ops.
  Mapping: ``collective_seq_id``, offset 0.

Those are the defaults (:func:`default_mapping`). Because the numbering has changed across torch
versions, :func:`calibrate` checks them against data first: an FR entry that matches one of the rank's
own Python-issued calls (same group, op family and, where comparable, input shape) at the mapped number
confirms a mapping; the candidate (field, offset) that explains the most of those calls wins.

Entries are those of :func:`summarize_entry` (``group``, ``seq`` = ``collective_seq_id``, ``op_id``,
``op``, ``input_sizes``, ...), as kept in an incident bundle's ``fr/rank-R.json``.
"""
from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from dtwatch.code_paths import INTERNAL, USER, classify_file
from dtwatch.ops import P2P_NAMES

SEQ, OP_ID = "seq", "op_id"  # summary keys of collective_seq_id and op_id
_OFFSETS = (0, -1, 1)
_P2P = P2P_NAMES
# Single-input ops whose first input's shape dtwatch's fingerprint and FR's input_sizes both state.
_SHAPED = {"all_reduce", "broadcast", "reduce"}


@dataclass(frozen=True)
class SeqMapping:
    """dtwatch seq = ``entry[field] + offset``; ``evidence``: Python-issued calls that confirmed it (0: default)."""

    field: str
    offset: int = 0
    evidence: int = 0

    def seq_of(self, entry: dict) -> int | None:
        value = entry.get(self.field)
        return int(value) + self.offset if value is not None else None

    def to_dict(self) -> dict:
        return {"field": "collective_seq_id" if self.field == SEQ else self.field, "offset": self.offset,
                "evidence": self.evidence}


def default_mapping(backend: str) -> SeqMapping:
    """The mapping measured (gloo) or read in torch's source (NCCL) for torch 2.13-2.14; see the module doc."""
    return SeqMapping(OP_ID if "gloo" in (backend or "").lower() else SEQ)


@functools.lru_cache(maxsize=256)
def op_family(name: str) -> str:
    """A collective's kind, the same for dtwatch's op names and FR's profiling names.

    ``all_gather_into_tensor``, ``_allgather_base``, ``allgather`` -> ``allgather``; object collectives
    map to the op they run (``all_gather_object`` -> ``allgather``); NCCL's barrier is an all-reduce.
    """
    n = name.split(":")[-1].lower().replace("_", "")
    for family in ("reducescatter", "allreduce", "allgather", "alltoall", "broadcast", "barrier", "scatter",
                   "gather", "reduce", "send", "recv"):
        if family in n:
            return "allreduce" if family == "barrier" else family
    return n


def _fingerprint_shape(fingerprint: str) -> list[int] | None:
    """``all_reduce[float32:4x3]`` -> [4, 3]; None where it states no shape."""
    try:
        shape = fingerprint.rsplit(":", 1)[1].rstrip("]")
    except IndexError:
        return None
    if not shape or shape == "object":
        return None
    try:
        return [int(d) for d in shape.split("x")]
    except ValueError:
        return None


def _score(call: Any, entry: dict) -> int:
    """+2: same op and input shape; +1: same op; 0: only the same op family (a barrier facing an all_reduce
    proves nothing: NCCL records its barrier as one, and gloo's neighbouring all_reduces would match too);
    -2: a different op (or shape) at that number."""
    entry_op = str(entry.get("op", ""))
    if op_family(call.op) != op_family(entry_op):
        return -2
    if ("barrier" in call.op) != ("barrier" in entry_op.lower()):
        return 0
    if call.op in _SHAPED:
        shape, sizes = _fingerprint_shape(call.fingerprint), entry.get("input_sizes")
        if shape is not None and sizes:
            return 2 if list(sizes[0]) == shape else -2
    return 1


def calibrate(entries: list[dict], calls: Iterable[Any], backend: str = "") -> SeqMapping:
    """The mapping that best explains the rank's own Python-issued ``calls`` (dtwatch.diagnose.rank_state.Call-like:
    ``op``, ``group``, ``seq``, ``span``, ``fingerprint``) by these FR ``entries``; the default if none does."""
    # The backend from the caller (the ring), else from the entries' profiling names ("gloo:all_reduce").
    backend = backend or next((str(e["backend"]) for e in entries if e.get("backend")), "")
    default = default_mapping(backend)
    usable = [c for c in calls if c.span == 1 and c.op not in _P2P and c.seq > 0]
    candidates = [default] + [SeqMapping(f, o) for f in (OP_ID, SEQ) for o in _OFFSETS
                              if (f, o) != (default.field, default.offset)]
    best, best_score, best_hits = default, 0, 0
    for cand in candidates:
        index = index_entries(entries, cand)
        score = hits = 0
        for call in usable:
            entry = index.get((str(call.group), call.seq))
            if entry is not None:
                s = _score(call, entry)
                score += s
                hits += s > 0
        if score > best_score:  # strictly better: ties keep the earlier candidate (the default first)
            best, best_score, best_hits = cand, score, hits
    return SeqMapping(best.field, best.offset, best_hits)


def index_entries(entries: list[dict], mapping: SeqMapping) -> dict[tuple[str, int], dict]:
    """(group, dtwatch seq) -> the first entry mapped there."""
    out: dict[tuple[str, int], dict] = {}
    for e in entries:
        seq = mapping.seq_of(e)
        if seq is not None:
            out.setdefault((str(e.get("group")), seq), e)
    return out


def entry_for(entries: list[dict], group: str, seq: int, mapping: SeqMapping) -> dict | None:
    """The FR entry of ``group``'s collective number ``seq`` (dtwatch's numbering), if recorded."""
    return index_entries(entries, mapping).get((str(group), seq))


# ---------------------------------------------------------------------------------------------------
# Summaries of raw FR entries
# ---------------------------------------------------------------------------------------------------
def frame_sites(frames: list[dict]) -> tuple[dict | None, dict | None]:
    """(site, user site) of an FR entry's Python frames (innermost first), as for Python-issued calls:
    the first frame outside torch/dtwatch, and the first frame of user code (``site`` when none)."""
    site = user = None
    for fr in frames:
        name = str(fr.get("filename") or "")
        kind = classify_file(name) if name else INTERNAL
        if kind == INTERNAL:
            continue
        here = {"file": name, "line": int(fr.get("line") or 0), "function": str(fr.get("name") or "")}
        if site is None:
            site = here
        if kind == USER:
            user = here
            break
    return site, user if user is not None else site


def summarize_entry(e: dict) -> dict:
    """The fields of one raw FR entry that matter to a reader, with its call sites."""
    frames = e.get("frames") or []
    site, user_site = frame_sites(frames)
    backend, _, op = str(e.get("profiling_name", "")).rpartition(":")
    return {
        "group": (e.get("process_group") or ["?"])[0], "seq": e.get("collective_seq_id"),
        "p2p_seq": e.get("p2p_seq_id"), "op_id": e.get("op_id"),
        "op": op, "backend": backend,
        "input_sizes": e.get("input_sizes"), "input_dtypes": e.get("input_dtypes"), "state": e.get("state"),
        "time_created_ns": e.get("time_created_ns"),
        "frames": [f"{fr.get('name')} ({fr.get('filename')}:{fr.get('line')})" for fr in frames[:6]],
        "site": site, "user_site": user_site,
    }
