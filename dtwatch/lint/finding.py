"""What the lint reports: a finding, its codes, and the finding for a file it could not parse."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

CODES: dict[str, str] = {
    "DTW000": "could not parse",
    "DTW001": "collective inside a rank-conditional branch",
    "DTW002": "rank-conditional early exit before a collective",
    "DTW003": "point-to-point op inside a rank-conditional branch",
}


@dataclass(frozen=True)
class LintFinding:
    """One problem. ``line`` and ``col`` are 1-based, as in flake8 and editors."""

    path: str
    line: int
    col: int
    code: str
    call: str  # "dist.barrier()", or the exit ("return") for DTW002; empty for DTW000
    condition: str  # "if rank == 0", "@rank_zero_only"...; empty for DTW000
    message: str

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def unparsable(path: str, exc: BaseException) -> LintFinding:
    """The DTW000 finding for a file that could not be read or parsed."""
    if isinstance(exc, SyntaxError):
        line, col, reason = exc.lineno or 1, exc.offset or 1, f"{exc.msg}"
    elif isinstance(exc, RecursionError):
        line, col, reason = 1, 1, "nested too deeply to check"
    else:
        line, col, reason = 1, 1, str(exc)
    return LintFinding(path, line, col, "DTW000", "", "", f"could not parse: {reason}")
