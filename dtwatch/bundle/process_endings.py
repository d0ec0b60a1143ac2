"""How a rank's process ended, read from the files it wrote as it ended (part of the incident's files).

The recorder writes them (:mod:`dtwatch.record.endings`, faulthandler's fatal and SIGTERM dumps); the watchdog,
``dtwatch analyze`` and ``dtwatch capture`` read them here, the same way.
"""
from __future__ import annotations

import json
import os
import re

import dtwatch.paths as paths
from dtwatch.paths import ending_files

# faulthandler's first line for each fatal signal it handles (CPython's faulthandler.c).
_FATAL_TEXT = {
    "Aborted": "SIGABRT", "Segmentation fault": "SIGSEGV", "Bus error": "SIGBUS",
    "Floating point exception": "SIGFPE", "Illegal instruction": "SIGILL",
}


def process_ending(run_dir: str, rank: int, since: float) -> dict | None:
    """How a rank's process ended, from the files it wrote as it ended (none written since ``since``, the
    process's start, count): the fatal signal faulthandler reported (SIGABRT from a gloo/NCCL check,
    SIGSEGV...) or SIGTERM (``signal``, ``text``, ``frames``), and the exit file (``exit``: an uncaught
    exception whole, or the ``sys.exit``/``os._exit`` call; :mod:`dtwatch.record.endings`). None when
    there is neither."""
    out: dict = {}
    facts = _exit_facts(paths.exit_file(run_dir, rank), since)
    if facts is not None:
        out["exit"] = facts
    fatal, term = ending_files(run_dir, rank)
    for path, kind in ((fatal, "fatal"), (term, "term")):
        try:
            if os.path.getmtime(path) < since:
                continue
            with open(path, "rb") as f:
                f.seek(max(0, os.path.getsize(path) - 65536))
                text = f.read().decode("utf-8", "replace")
        except OSError:
            continue
        if not text.strip():
            continue
        frames = main_thread_frames_of(text)
        if kind == "term":
            return {**out, "signal": "SIGTERM", "text": text[-4000:], "frames": frames}
        name = next((n for words, n in _FATAL_TEXT.items() if f"Fatal Python error: {words}" in text),
                    "unknown fatal signal")
        return {**out, "signal": name, "text": text[-4000:], "frames": frames}
    return out or None


def _exit_facts(path: str, since: float) -> dict | None:
    """The exit file's facts, if written since ``since`` and well formed."""
    try:
        if os.path.getmtime(path) < since:
            return None
        with open(path) as f:
            facts = json.load(f)
    except (OSError, ValueError):
        return None
    return facts if isinstance(facts, dict) and isinstance(facts.get("how"), str) else None


_FH_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<function>.*)$')


def main_thread_frames_of(text: str) -> list[dict]:
    """The main thread's frames (innermost first) in a faulthandler dump: the thread whose outermost
    frame is a module's top level, else the current thread."""
    blocks: list[tuple[str, list[dict]]] = []
    for line in text.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x", "Stack (most recent call first)")):
            blocks.append((line, []))
            continue
        m = _FH_FRAME.match(line)
        if m and blocks:
            frame = {"file": m.group("file"), "line": int(m.group("line")), "function": m.group("function")}
            blocks[-1][1].append(frame)
    main = next((fr for _, fr in blocks if fr and fr[-1]["function"] == "<module>"), None)
    if main is None:
        main = next((fr for head, fr in blocks if head.startswith(("Current thread", "Stack"))), [])
    return main
