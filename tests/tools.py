"""Locating the real external tools the tests drive (promtool, prometheus, helm, tsc, py-spy...).

Tools are installed by the scripts in ``.ci/tools/`` into ``.tools/bin`` (or ``$DTWATCH_TOOLS_DIR/bin``).
With ``CI=true`` a missing tool fails the test: CI must never skip a real component. Locally the
test is skipped with the command that installs the tool.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TOOLS_DIR = Path(os.environ.get("DTWATCH_TOOLS_DIR", REPO / ".tools"))
ON_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require_tool(name: str, installer: str) -> str:
    """Return the path of tool ``name``; fail on CI (skip locally) if it is not installed."""
    for candidate in (TOOLS_DIR / "bin" / name,):
        if candidate.exists() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which(name)
    if found:
        return found
    message = f"{name} not installed: run .ci/tools/{installer}"
    if ON_CI:
        pytest.fail(message)
    pytest.skip(message)
