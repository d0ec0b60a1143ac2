"""torch's own Flight Recorder dumps found and read for ``dtwatch analyze`` (a job that ran without dtwatch).

torch writes one file per rank, named ``<prefix><rank>`` (``TORCH_FR_DUMP_TEMP_FILE`` /
``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``, e.g. ``/tmp/nccl_trace_rank_3``), or a program writes the bytes of
``_dump_fr_trace()`` / ``_dump_nccl_trace()`` (a pickle) or of their ``_json`` variants itself. A dump is known
by its content, not its name: a pickle or a JSON object whose first bytes hold the dump's keys (``version``,
``entries``, ``pg_config``), or a pickle named like a dump. It is read with the restricted unpickler
(:func:`~dtwatch.bundle.safe_pickle.load_plain`: nothing in a file is ever run) and checked
(:func:`~dtwatch.diagnose.fr_states.dump_problem`). The rank is the number the file name ends in.

A file that is cut short, garbled, refused (it asks to run code), not a dump after all, or of another dump
format version than the rest of the set is named with what is wrong (an
:class:`~dtwatch.ring.reader.InputProblem`) and left out; the rest is read. Where two files hold the same rank
(a pickle and its JSON twin), the pickle is used: only it carries the entries' Python frames.
"""
from __future__ import annotations

import contextlib
import gc
import json
import os
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from dtwatch.bundle.safe_pickle import UnsafePickleError, load_plain
from dtwatch.diagnose.fr_states import MAX_RANKS, Dump, completed, dump_problem, p2p_gaps, split_name
from dtwatch.diagnose.wording.phrases import fmt_ranks
from dtwatch.ring.reader import IO_ERROR, InputProblem

HEAD = 4096  # bytes read to recognise a dump
_PICKLE = re.compile(rb"\A\x80[\x02-\x05]")
_PICKLE_KEYS = (b"version", b"entries", b"pg_config")
_JSON_KEYS = (b'"entries"', b'"pg_config"', b'"version"')
_RANK = re.compile(r"(\d+)(?:\.(?:pkl|pickle|json|bin))?$")

BAD_DUMP = "bad_dump"  # cut short or garbled: not a readable pickle or JSON
UNSAFE = "unsafe_pickle"  # a pickle that asks to build objects or call functions: refused, nothing run
NOT_A_DUMP = "not_a_dump"  # readable, but not a Flight Recorder dump
NO_RANK = "no_rank"  # a dump whose file name ends in no rank number
MIXED_VERSION = "mixed_version"  # a dump of another format version than the rest of the set


def dump_kind(head: bytes, name: str) -> str | None:
    """"pickle" / "json" when a file's first bytes (``head``) look like a Flight Recorder dump, else None."""
    if _PICKLE.match(head):
        return "pickle" if any(k in head for k in _PICKLE_KEYS) or _RANK.search(name) else None
    text = head.lstrip()
    if text.startswith(b"{") and any(k in text for k in _JSON_KEYS):
        return "json"
    return None


_OWN = re.compile(r"rank-(\d+)\.\d+\.pkl$")  # dtwatch's own copies: rank-00003.<request>.pkl


def rank_of(path: str | os.PathLike) -> int | None:
    """The rank a dump's file name ends in (``nccl_trace_rank_12`` -> 12; ``rank_3.json`` -> 3)."""
    name = os.path.basename(str(path))
    m = _OWN.search(name) or _RANK.search(name)
    return int(m.group(1)) if m else None


def candidates(files: list[Path]) -> list[tuple[Path, str]]:
    """The files among ``files`` that look like dumps, with their format."""
    out = []
    for p in files:
        try:
            with open(p, "rb") as f:
                head = f.read(HEAD)
        except OSError:
            continue
        kind = dump_kind(head, p.name)
        if kind is not None:
            out.append((p, kind))
    return out


@dataclass
class DumpSet:
    """What a set of dump files gave: the dumps used, the files named as bad, and the copies not used."""

    dumps: list[Dump] = field(default_factory=list)
    problems: list[InputProblem] = field(default_factory=list)
    unused: list[str] = field(default_factory=list)  # a second file of a rank (a JSON twin of its pickle)


def parse_dump(data: bytes, path: str, kind: str) -> Dump:
    """One file's bytes as a dump; raises :class:`DumpFileError` naming what is wrong."""
    rank = rank_of(path)
    ranks = (rank,) if rank is not None else ()
    try:
        doc = load_plain(data, path) if kind == "pickle" else json.loads(data)
    except UnsafePickleError as e:
        raise DumpFileError(InputProblem(path, UNSAFE, str(e).removeprefix(f"{path}: "), ranks)) from e
    except Exception as e:  # a damaged pickle or JSON can raise anything
        detail = "empty file (0 bytes)" if not data else f"cut short or garbled ({type(e).__name__}: {str(e)[:80]})"
        raise DumpFileError(InputProblem(path, BAD_DUMP, f"not a readable Flight Recorder dump: {detail}",
                                         ranks)) from e
    wrong = dump_problem(doc)
    if wrong is not None:
        raise DumpFileError(InputProblem(path, NOT_A_DUMP, wrong, ranks))
    if rank is None or rank >= MAX_RANKS:
        raise DumpFileError(InputProblem(path, NO_RANK, "a Flight Recorder dump whose file name ends in no rank "
                                         "number (torch names them <prefix><rank>), so whose it is is not known"))
    return Dump(rank, doc, path, fmt=kind)


class DumpFileError(ValueError):
    def __init__(self, problem: InputProblem) -> None:
        super().__init__(problem.line())
        self.problem = problem


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic garbage collector held off: dumps are trees of many small dicts (a 1,024-rank set, millions)
    that reference counting frees, and each pass of the collector over them would cost seconds."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def read_dumps(files: list[tuple[Path, str]]) -> DumpSet:
    """Read every candidate file (see the module doc); bad files are named, never raised."""
    with collector_paused():
        return _read_dumps(files)


def _read_dumps(files: list[tuple[Path, str]]) -> DumpSet:
    out = DumpSet()
    read: list[Dump] = []
    for path, kind in files:
        try:
            data = path.read_bytes()
            written = path.stat().st_mtime
        except OSError as e:
            rank = rank_of(path)
            out.problems.append(InputProblem(str(path), IO_ERROR, f"could not be read ({e.strerror or e})",
                                             (rank,) if rank is not None else ()))
            continue
        try:
            dump = parse_dump(data, str(path), kind)
        except DumpFileError as e:
            out.problems.append(e.problem)
            continue
        dump.written = written
        read.append(dump)
    versions = Counter(d.version for d in read)
    if len(versions) > 1:
        (usual, n), *_ = versions.most_common()
        for d in [d for d in read if d.version != usual]:
            out.problems.append(InputProblem(d.path, MIXED_VERSION, f"its format version {d.version!r} differs from "
                                             f"the {n} other dump(s)' {usual!r}: a dump of another job or torch "
                                             "install, left out", (d.rank,)))
        read = [d for d in read if d.version == usual]
    by_rank: dict[int, list[Dump]] = {}
    for d in read:
        by_rank.setdefault(d.rank, []).append(d)
    for _rank, same in sorted(by_rank.items()):
        # The pickle (it has the frames), then the one with more entries, then the newest file.
        same.sort(key=lambda d: (d.fmt == "pickle", d.has_frames, len(d.entries), d.written), reverse=True)
        out.dumps.append(same[0])
        out.unused.extend(d.path for d in same[1:])
    return out


def dump_facts(dump: Dump) -> dict:
    """What a dump says beyond its entries, for the diagnosis (:meth:`dtwatch.diagnose.Evidence.dump_facts`)."""
    return {"p2p_unrecorded": p2p_gaps(dump.entries), "frames": dump.has_frames, "file": dump.path,
            "format": dump.fmt, "version": dump.version}


def in_flight(dump: Dump) -> list[dict]:
    """The dump's entries that had not completed when it was written, as the report lists them: op, group,
    number, torch's own state (``scheduled``: enqueued; ``started``: running; gloo's stay ``scheduled``)."""
    from dtwatch.diagnose.flight import frame_sites

    out = []
    for e in dump.entries:
        if completed(e):
            continue
        _, op, peer = split_name(str(e.get("profiling_name", "")))
        _, user = frame_sites(list(e.get("frames") or []))
        out.append({"op": op, "group": str(e["process_group"][0]), "seq": e.get("collective_seq_id"),
                    "state": e.get("state"), "input_sizes": e.get("input_sizes"),
                    "input_dtypes": e.get("input_dtypes"), "peer": peer if peer >= 0 else None, "site": user})
    return out


NEXT_TIME = "dtwatch run -- torchrun --nproc-per-node N train.py"


def limits(dumps: list[Dump], no_dump: list[int], world_known: bool) -> list[str]:
    """What these dumps cannot show, each as a line of the report, and the line that would have shown it."""
    out = ["A Flight Recorder dump holds each rank's collectives and nothing else: not where a rank in no "
           "collective is (no stack), not whether a process still runs or how one ended, not step counts or "
           "DataLoader lengths."]
    if dumps and not any(d.has_frames for d in dumps):
        out.append("These dumps carry no Python frames (JSON dumps never do): no line of the program can be named.")
    if any(d.entries and split_name(str(d.entries[0].get("profiling_name", "")))[0] == "gloo" for d in dumps):
        out.append("gloo's Flight Recorder does not record send/recv: a rank blocked in one shows no call in flight.")
    if no_dump:
        out.append(f"{fmt_ranks(no_dump)} left no dump: whether {'it' if len(no_dump) == 1 else 'they'} crashed, "
                   "hung or could not write one is not in the dumps.")
    if not world_known:
        out.append("The dumps do not state the job's world size (gloo's dumps name no group): a missing rank above "
                   "the highest one dumped would go unnoticed.")
    out.append(f"Next time, run the job under dtwatch to see all of this, and get the diagnosis as it hangs: "
               f"{NEXT_TIME}")
    return out


__all__ = ["BAD_DUMP", "DumpSet", "collector_paused", "MIXED_VERSION", "NEXT_TIME", "NOT_A_DUMP", "NO_RANK",
           "UNSAFE", "candidates", "dump_facts", "dump_kind", "in_flight", "limits", "parse_dump", "rank_of",
           "read_dumps"]
