"""Damaged inputs, fuzzed: rings and bundle files cut short, bit-flipped, replaced by random bytes or by another
format are named with what is wrong, and everything else is still read (issue 24).

Real rings come from the project's own writer (4 ranks, a hang: ranks 0, 1 and 3 in a barrier, rank 2 in an
all_reduce), and a bundle from the project's own Bundle. Each input damages one file of a pristine run directory
(or bundle), then runs the reader, the watchdog's ring reader and the whole ``analyze`` path (the function, its
JSON and its text; a few through the CLI), and checks:

* nothing raises;
* a damaged file is named, with a reason, in the result, the JSON and the text. Bit flips and garbled bytes may
  also leave a file that still parses: then it is either read exactly as before (a flip in bytes nothing reads)
  or changed in a way no check can see (a flipped bit of a sequence number; the format has no checksums): those
  are counted, not failed;
* every rank is read or listed as unreadable: none is silently lost.

The seed and the clock are fixed and the inputs bounded (a few hundred, a few seconds), so the figures ``pytest -s``
prints are the same on every run.
"""
from __future__ import annotations

import dataclasses
import gzip
import json
import random
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from unittest import mock

import pytest

from dtwatch.bundle.files import Bundle, BundleFileError, parse_bundle_file
from dtwatch.diagnose import Finding
from dtwatch.diagnose.rank_state import RankState
from dtwatch.render.report_text import render_text
from dtwatch.report.analyze import analyze
from dtwatch.ring import EXIT_CLEAN, FLAG_MARKER, RingWriter, ring_filename
from dtwatch.ring.layout import FACTS_OFFSET, HEADER_SIZE, LIVE_OFFSET, RECORD_SIZE, STATIC
from dtwatch.ring.reader import try_read_ring
from dtwatch.ring.setup_facts import encode_facts, write_facts
from dtwatch.watchdog.ring_poll import RingReader

SEED = 24
WORLD = 4
ODD = 2  # the rank in the all_reduce
HOST = "fuzz-node"
JOB = "fuzz-job"
CAPACITY = 32  # records per ring: 41 are written, so each ring has wrapped
NOW = 1_800_000_000.0  # the inputs' clock (and the writers' pids) are fixed: the same bytes on every run


# ---------------------------------------------------------------------------------------------------
# Pristine inputs
# ---------------------------------------------------------------------------------------------------
def write_ring(run_dir: Path, rank: int, now: float, *, hung: bool = True) -> None:
    """Rank ``rank``'s ring: 20 steps of an all_reduce, then (``hung``) the hang, else a clean exit."""
    with mock.patch("dtwatch.ring.writer.time.time", return_value=now - 90.0), \
            mock.patch("dtwatch.ring.writer.os.getpid", return_value=4000 + rank):
        _write_ring(run_dir, rank, now, hung)


def _write_ring(run_dir: Path, rank: int, now: float, hung: bool) -> None:
    w = RingWriter(run_dir / ring_filename(rank), rank=rank, local_rank=rank, world_size=WORLD, job_id=JOB,
                   host=HOST, backend="gloo", capacity=CAPACITY, groups=4, sites=8, loaders=2, members=64)
    step_site = w.add_site("/srv/fuzz/train.py", 20, "train_step")
    odd_site = w.add_site("/srv/fuzz/train.py", 30, "evaluate")
    barrier_site = w.add_site("/srv/fuzz/train.py", 40, "main")
    slot = w.add_group("0", "default_pg", list(range(WORLD)), rank)
    w.add_loader(step_site)
    t = now - 60.0
    stamp = 0
    for seq in range(1, 21):
        te = t + seq
        stamp += 1
        w.write_record(stamp, op="all_reduce", seq=seq, t_enter=te, t_exit=te + 0.01, dtype="float32",
                       shape=(1024,), group_slot=slot, site=step_site, step=seq - 1)
        stamp += 1
        w.write_record(stamp, op="step", seq=seq, t_enter=te + 0.02, t_exit=te + 0.02, seq_span=0,
                       flags=FLAG_MARKER, ntensors=0, numel=0, group_slot=slot, step=seq)
        w.add_seq_time(slot, seq, te)
        w.set_step(seq, te + 0.02)
    hang = now - 30.0
    stamp += 1
    if not hung:
        w.set_exit(EXIT_CLEAN, 0, "")
    elif rank == ODD:  # in flight: t_exit stays 0
        w.write_record(stamp, op="all_reduce", seq=21, t_enter=hang, dtype="float32", shape=(1,), group_slot=slot,
                       site=odd_site, step=20)
        w.set_main_site(odd_site, odd_site, hang)
    else:
        w.write_record(stamp, op="barrier", seq=21, t_enter=hang, numel=0, group_slot=slot, site=barrier_site,
                       step=20)
        w.set_main_site(barrier_site, barrier_site, hang)
    w.set_group_cpp_seq(slot, 21 if hung else 20, hang)
    write_facts(w.mm, encode_facts({"rank": rank, "backend": "gloo"}))
    w.heartbeat(now, 100)
    w.close()


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """(run dir of 4 rings, bundle-only dir, the bundle's path, the rings' bytes by rank)."""
    root = tmp_path_factory.mktemp("fuzz")
    now = NOW
    run_dir = root / "run" / JOB
    run_dir.mkdir(parents=True)
    for rank in range(WORLD):
        write_ring(run_dir, rank, now)
    result = analyze([str(run_dir)])
    assert [s.rank for s in result.states] == list(range(WORLD)) and result.stalled and not result.problems
    # A bundle alone (no rings): its rank files are the only copy of each rank.
    bundle_root = root / "bundle-only"
    bundle = Bundle(str(bundle_root), "inc-r0-g0-s21-desync", HOST)
    clock = mock.patch("dtwatch.bundle.files.time.time", return_value=NOW)
    clock.start()
    bundle.write_findings(result.findings, result.states, {"job_id": JOB, "detected": now, "verdict": "stall",
                                                           "world_size": WORLD, "local_ranks": list(range(WORLD))})
    findings = [f.to_dict() for f in result.findings]
    bundle.add_json("evidence.json", {"incident_id": bundle.id, "refined": False, "complete": True,
                                      "collected": now, "files": [], "findings": findings})
    bundle.write_index(result.findings, complete=True)
    clock.stop()
    rings = {rank: (run_dir / ring_filename(rank)).read_bytes() for rank in range(WORLD)}
    return run_dir, bundle_root, bundle.path, rings


# ---------------------------------------------------------------------------------------------------
# Damage
# ---------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Case:
    family: str  # ring / bundle
    kind: str  # truncate, flip1, flipN, random, empty, foreign, extend, garble, shape
    target: str  # the damaged file, relative to its directory
    data: bytes
    must_name: bool  # no reading of it can be right: it must be named
    ranks: tuple[int, ...]  # the ranks the file holds


def flip(data: bytes, offsets: list[int], rng: random.Random) -> bytes:
    out = bytearray(data)
    for off in offsets:
        out[off] ^= 1 << rng.randrange(8)
    return bytes(out)


def ring_regions(data: bytes) -> list[tuple[int, int]]:
    """The ring's parts, for offsets spread over each (a flip in the large sequence clock is mostly harmless)."""
    st = STATIC.unpack(data)
    records_end = st["records_off"] + st["capacity"] * RECORD_SIZE
    return [(0, STATIC.size), (LIVE_OFFSET, FACTS_OFFSET + 64), (HEADER_SIZE, st["members_off"]),
            (st["records_off"], records_end), (records_end, len(data))]


def ring_cases(rings: dict[int, bytes], rng: random.Random) -> list[Case]:
    victim = 1
    data = rings[victim]
    size = len(data)
    st = STATIC.unpack(data)
    rec, rec_end = st["records_off"], st["records_off"] + st["capacity"] * RECORD_SIZE
    cases: list[Case] = []

    def add(kind: str, damaged: bytes, must_name: bool = True, rank: int = victim) -> None:
        cases.append(Case("ring", kind, ring_filename(rank), damaged, must_name, (rank,)))

    cuts = {0, 1, 7, 8, 9, 100, STATIC.size - 1, STATIC.size, LIVE_OFFSET + 10, FACTS_OFFSET + 4, HEADER_SIZE - 1,
            HEADER_SIZE, HEADER_SIZE + 1, st["groups_off"] + 10, st["sites_off"] + 100, st["loaders_off"] + 1,
            st["members_off"] + 3, rec - 1, rec, rec + RECORD_SIZE // 2, rec + 5 * RECORD_SIZE, rec_end - 1, rec_end,
            rec_end + 1, rec_end + 8, (rec_end + size) // 2, size - 24, size - 1, 5000}
    cuts |= {rng.randrange(1, size) for _ in range(8)}
    for cut in sorted(cuts):
        add("truncate", data[:cut])
    for cut in (0, 5000, rec + 3 * RECORD_SIZE, size - 1):  # rank 0 too: a rank number that is falsy
        add("truncate", rings[0][:cut], rank=0)
    add("extend", data + b"\0")
    add("extend", data + bytes(rng.getrandbits(8) for _ in range(4096)))
    regions = ring_regions(data)
    for _ in range(150):
        lo, hi = regions[rng.randrange(len(regions))]
        add("flip1", flip(data, [rng.randrange(lo, hi)], rng), must_name=False)
    for _ in range(60):
        offsets = []
        for _ in range(rng.randint(2, 16)):
            lo, hi = regions[rng.randrange(len(regions))]
            offsets.append(rng.randrange(lo, hi))
        add("flipN", flip(data, offsets, rng), must_name=False)
    for n in (1, 7, 8, 9, 100, 4095, 4096, 4097, 5000, 20000, size - 1, size, size + 1):
        add("random", bytes(rng.getrandbits(8) for _ in range(n)))
    add("empty", b"")
    version = STATIC.offset("version")
    add("foreign", b'{"rank": 1, "note": "not a ring"}\n')
    add("foreign", b"hello\n")
    add("foreign", b"\x89PNG\r\n\x1a\n" + bytes(rng.getrandbits(8) for _ in range(2000)))
    add("foreign", gzip.compress(data))
    add("foreign", bytes(size))
    add("foreign", data[:8] + bytes(rng.getrandbits(8) for _ in range(size - 8)))
    add("foreign", data[:version] + (3).to_bytes(4, "little") + data[version + 4:])  # a version it does not know
    add("foreign", data[:version] + (0).to_bytes(4, "little") + data[version + 4:])
    rs = STATIC.offset("record_size")
    add("foreign", data[:rs] + (256).to_bytes(4, "little") + data[rs + 4:])
    add("foreign", rings[3])  # another rank's ring under rank 1's name
    return cases


def bundle_cases(bundle: Path, rng: random.Random) -> list[Case]:
    cases: list[Case] = []
    targets = ["index.json", "findings.json", "evidence.json", "ranks/rank-00001.json", "ranks/rank-00000.json"]
    for rel in targets:
        data = (bundle / rel).read_bytes()
        ranks = (int(rel[-10:-5]),) if rel.startswith("ranks/") else ()

        def add(kind: str, damaged: bytes, must_name: bool = True, rel: str = rel, ranks: tuple = ranks) -> None:
            cases.append(Case("bundle", kind, rel, damaged, must_name, ranks))

        for cut in sorted({0, 1, len(data) // 3, len(data) // 2, len(data) - 1, rng.randrange(1, len(data))}):
            add("truncate", data[:cut])
        for _ in range(12):
            garbled = bytearray(data)
            for _ in range(rng.randint(1, 4)):
                garbled[rng.randrange(len(data))] = rng.choice(b'0123456789."{}[],:-eEtfn \x00\xff')
            add("garble", bytes(garbled), must_name=False)
        add("random", bytes(rng.getrandbits(8) for _ in range(len(data))))
        add("empty", b"")
        for other in (b"{}", b"null", b'"text"', b"[1, 2]", b"\xef\xbb\xbf{"):
            add("shape", other)
    cases.append(Case("bundle", "shape", "ranks/rank-00001.json", (bundle / "ranks/rank-00002.json").read_bytes(),
                      True, (1,)))  # another rank's state under rank 1's name
    return cases


# ---------------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------------
def ring_read(path: Path) -> str:
    """What the reader makes of a ring: everything but where and when it was read."""
    snap, _ = try_read_ring(path)
    if snap is None:
        return "unreadable"
    d = {f.name: getattr(snap, f.name) for f in dataclasses.fields(snap) if f.name not in ("path", "read_time",
                                                                                         "problem")}
    d["records"], d["seq_clock"] = snap.records.tobytes(), snap.seq_clock.tobytes()
    return repr(d)


def bundle_read(rel: str, data: bytes) -> str:
    try:
        doc = parse_bundle_file(rel, data)
    except BundleFileError:
        return "unreadable"
    if isinstance(doc, RankState):
        return repr(doc.to_dict())
    if isinstance(doc, list):
        return repr([f.to_dict() for f in doc if isinstance(f, Finding)])
    return repr(doc)


def run_case(case: Case, base: Path, where: Path, pristine_read: str, tally: Counter, failures: list[str]) -> None:
    """Damage ``base / case.target``, analyze ``where``, check, restore."""
    path = base / case.target
    original = path.read_bytes()
    path.write_bytes(case.data)
    label = f"{case.family}/{case.kind} {case.target} ({len(case.data)} bytes)"
    try:
        if case.family == "ring":
            try_read_ring(path)
            RingReader(str(where), HOST).read()  # the live watchdog's poll: never an exception
            now_read = ring_read(path)
        else:
            now_read = bundle_read(case.target, case.data)
        result = analyze([str(where)])
        doc = json.loads(json.dumps(result.to_dict(), default=str))
        text = render_text(result.findings, result.states, now=result.now, warnings=result.warnings,
                           verdict=result.verdict, live_warnings=result.live_warnings)
    except Exception as e:  # noqa: BLE001 - the count of these is the point
        tally["exceptions"] += 1
        failures.append(f"{label}: {type(e).__name__}: {e}")
        return
    finally:
        path.write_bytes(original)
    named = [p for p in result.problems if p.path == str(path)]
    read = {s.rank for s in result.states}
    lost = set(range(WORLD)) - read - set(result.unreadable)
    if lost:
        failures.append(f"{label}: ranks {sorted(lost)} neither read nor listed as unreadable")
    if named:
        tally["named"] += 1
        p = named[0]
        if not p.detail or str(path) not in text or str(path) not in {d["path"] for d in doc["damaged_inputs"]}:
            failures.append(f"{label}: named without a reason, or missing from the text or the JSON")
        if not p.read and not set(case.ranks) <= read | set(result.unreadable):
            failures.append(f"{label}: its ranks {case.ranks} are not listed as unreadable")
        if result.unreadable and "No stall.\n" in text:
            failures.append(f"{label}: 'No stall.' with ranks {result.unreadable} unread")
    elif case.must_name:
        failures.append(f"{label}: not named")
    elif now_read == pristine_read:
        tally["unchanged"] += 1  # the damage hit bytes nothing reads
    else:
        tally["undetected"] += 1  # read, and different: no check can see it (the format has no checksums)


def test_damaged_inputs_are_named_and_no_rank_is_lost(pristine):
    run_dir, bundle_root, bundle, rings = pristine
    rng = random.Random(SEED)
    tally: Counter = Counter()
    kinds: Counter = Counter()
    failures: list[str] = []
    started = time.perf_counter()
    pristine_rings = {rank: ring_read(run_dir / ring_filename(rank)) for rank in range(WORLD)}
    for case in ring_cases(rings, rng):
        kinds[f"ring {case.kind}"] += 1
        run_case(case, run_dir, run_dir, pristine_rings[case.ranks[0]], tally, failures)
    for case in bundle_cases(bundle, rng):
        kinds[f"bundle {case.kind}"] += 1
        original = (bundle / case.target).read_bytes()
        run_case(case, bundle, bundle_root, bundle_read(case.target, original), tally, failures)
    inputs = sum(kinds.values())
    print(f"\nfuzz (seed {SEED}): {inputs} inputs in {time.perf_counter() - started:.1f}s: "
          + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())))
    print(f"fuzz: exceptions {tally['exceptions']}, damaged files named {tally['named']}, read unchanged (damage in "
          f"bytes nothing reads) {tally['unchanged']}, changed but undetectable {tally['undetected']}")
    assert not failures, f"{len(failures)} of {inputs}:\n" + "\n".join(failures[:40])
    assert tally["exceptions"] == 0


# ---------------------------------------------------------------------------------------------------
# The CLI, on a few of them
# ---------------------------------------------------------------------------------------------------
def test_the_cli_names_damaged_inputs(pristine):
    run_dir, bundle_root, bundle, rings = pristine
    rng = random.Random(SEED + 1)
    ring = run_dir / ring_filename(1)
    st = STATIC.unpack(rings[1])
    inputs = [
        (run_dir, ring, rings[1][:5000], [1]),  # cut inside its tables
        (run_dir, ring, bytes(rng.getrandbits(8) for _ in range(len(rings[1]))), [1]),  # random bytes
        (run_dir, ring, flip(rings[1], [st["records_off"] + RECORD_SIZE * 3 + 120], rng), []),  # a torn record
        (bundle_root, bundle / "ranks/rank-00001.json",
         (bundle / "ranks/rank-00001.json").read_bytes()[:200], [1]),
    ]
    for where, path, data, unreadable in inputs:
        original = path.read_bytes()
        path.write_bytes(data)
        try:
            proc = subprocess.run([sys.executable, "-m", "dtwatch", "analyze", str(where), "--json"],
                                  capture_output=True, text=True, timeout=120)
        finally:
            path.write_bytes(original)
        assert proc.returncode in (0, 1), proc.stderr
        doc = json.loads(proc.stdout)
        damaged = {d["path"]: d for d in doc["damaged_inputs"]}
        assert str(path) in damaged and damaged[str(path)]["detail"], doc["damaged_inputs"]
        assert doc["unreadable_ranks"] == unreadable
        seen = {r["rank"] for r in doc["ranks"]}
        assert seen | set(unreadable) == set(range(WORLD)) and not seen & set(unreadable)
        assert any(w["kind"] == "damaged_input" for w in doc["warnings"])
