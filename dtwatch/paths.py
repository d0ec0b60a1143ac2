"""Names of the files in a run directory, and dtwatch's exit codes: spelled here once.

A run directory (``<dir>/<job id>/``, one per job per node) holds::

    rank-00003.ring                 each rank's ring (dtwatch.ring)
    stacks/rank-00003.txt           faulthandler stacks written on the stack signal
    stacks/rank-00003.fatal.txt     how the rank ended on a fatal signal; .term.txt on SIGTERM
    fr/rank-00003.<request>.pkl     a Flight Recorder dump the watchdog requested through the ring
    fr/torch-fr-rank-<rank>         torch's own dumps (TORCH_FR_DUMP_TEMP_FILE)
    watchdog-<node>.lock            held (flock) by the node's watchdog for its whole life
    watchdog-<node>.json            the watchdog's ready file (pid, metrics URL)
    watchdog-<node>.log             the watchdog's log when a rank or ``dtwatch run`` started it
    events-<node>.jsonl             what the node's watchdog reported, one JSON object a line
    incidents/<id>/<node>/          an incident bundle (see :mod:`dtwatch.bundle.files`)

Imports nothing from dtwatch: code in the training process, the watchdog and the reports all use it.
"""
from __future__ import annotations

import os

# -- exit codes ---------------------------------------------------------------------------------------
EXIT_OK = 0
EXIT_FOUND = 1
"""``analyze`` / ``lint`` found a problem."""
EXIT_USAGE = 2
"""A usage or configuration error."""
EXIT_FAILED_FAST = 3
"""``run`` / ``watch`` ended a hung job (``--fail-fast``)."""
EXIT_LOCKED = 4
"""``watch``: another watchdog already runs for this job on this node."""
EXIT_INTERRUPTED = 130
"""Ctrl-C (128 + SIGINT), as shells report it."""

# -- the run directory --------------------------------------------------------------------------------
RING_SUFFIX = ".ring"
RING_GLOB = f"rank-*{RING_SUFFIX}"
EVENTS_PREFIX, EVENTS_SUFFIX = "events-", ".jsonl"
INCIDENTS = "incidents"
STACKS, FLIGHT_RECORDS = "stacks", "fr"


def run_dir(root: str, job_id: str) -> str:
    """``<root>/<job id>``: where one job's files live on this node."""
    return os.path.join(root, job_id)


def rank_stem(rank: int) -> str:
    """``rank-00003``: how every per-rank file is named."""
    return f"rank-{rank:05d}"


def ring_name(rank: int) -> str:
    """File name of the ring of global ``rank`` inside a run directory."""
    return rank_stem(rank) + RING_SUFFIX


def stack_file(run_dir: str, rank: int) -> str:
    """Where a rank's faulthandler appends all threads' stacks on the stack signal."""
    return os.path.join(run_dir, STACKS, rank_stem(rank) + ".txt")


def ending_files(run_dir: str, rank: int) -> tuple[str, str]:
    """Where a rank's faulthandler writes on a fatal signal, and on SIGTERM."""
    base = os.path.join(run_dir, STACKS, rank_stem(rank))
    return base + ".fatal.txt", base + ".term.txt"


def exit_file(run_dir: str, rank: int) -> str:
    """How a rank's process ended, whole (exception, sys.exit, os._exit): :mod:`dtwatch.record.endings`."""
    return os.path.join(run_dir, STACKS, rank_stem(rank) + ".exit.json")


def flight_record_file(run_dir: str, rank: int, request: int) -> str:
    """A Flight Recorder dump a rank's sampler wrote for the watchdog's request ``request``."""
    return os.path.join(run_dir, FLIGHT_RECORDS, f"{rank_stem(rank)}.{request}.pkl")


def torch_fr_prefix(run_dir: str) -> str:
    """torch's own Flight Recorder dump prefix (``TORCH_FR_DUMP_TEMP_FILE``)."""
    return os.path.join(run_dir, FLIGHT_RECORDS, "torch-fr-rank-")


def watchdog_lock_file(run_dir: str, node: str) -> str:
    return os.path.join(run_dir, f"watchdog-{node}.lock")


def watchdog_ready_file(run_dir: str, node: str) -> str:
    return os.path.join(run_dir, f"watchdog-{node}.json")


def watchdog_log_file(run_dir: str, node: str) -> str:
    return os.path.join(run_dir, f"watchdog-{node}.log")


def events_file(run_dir: str, node: str) -> str:
    return os.path.join(run_dir, f"{EVENTS_PREFIX}{node}{EVENTS_SUFFIX}")


def is_events_file(name: str) -> bool:
    return name.startswith(EVENTS_PREFIX) and name.endswith(EVENTS_SUFFIX)


# -- an incident bundle (``incidents/<id>/<node>/``) ----------------------------------------------------
BUNDLE_INDEX = "index.json"
BUNDLE_FINDINGS = "findings.json"
"""The findings as diagnosed and sent, written once at detection."""
BUNDLE_EVIDENCE = "evidence.json"
"""What the evidence added, written once when it is in: the findings revised with it, the files."""
BUNDLE_REPORT = "report.txt"
BUNDLE_TIMELINE = "timeline.svg"
BUNDLE_INDEX_GLOB = f"{INCIDENTS}/*/*/{BUNDLE_INDEX}"


def bundle_dir(run_dir: str, incident_id: str, node: str) -> str:
    return os.path.join(run_dir, INCIDENTS, incident_id, node)


def bundle_rank_file(kind: str, rank: int, suffix: str) -> str:
    """A per-rank file inside a bundle, relative to it: ``<kind>/rank-00003<suffix>``
    (kinds: ``ranks``, ``rings``, ``stacks``, ``fr``, ``endings``)."""
    return f"{kind}/{rank_stem(rank)}{suffix}"
