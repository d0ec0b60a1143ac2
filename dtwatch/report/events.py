"""The warnings the watchdogs wrote to their events files while the job ran (one JSON object a line)."""
from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path


def warnings_in(event_files: Iterable[Path]) -> list[dict]:
    """Every warning event of these files, once each (several nodes may issue the same), oldest first; the
    ``event`` field dropped, so each is a Finding's dict."""
    seen: dict[tuple, dict] = {}
    for path in event_files:
        try:
            lines = path.read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if not isinstance(event, dict) or event.get("event") != "warning":
                continue
            w = {k: v for k, v in event.items() if k != "event"}
            seen.setdefault((w.get("kind"), tuple(w.get("ranks") or ()), w.get("group"), w.get("seq")), w)
    return sorted(seen.values(), key=lambda w: float(w.get("detected") or 0.0))
