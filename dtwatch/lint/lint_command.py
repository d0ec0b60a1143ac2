"""``dtwatch lint``: the command-line face of :mod:`dtwatch.lint.checker`.

The main CLI registers the verb with ``add_lint_parser(subparsers)`` (which sets ``func=run_lint``);
``python -m dtwatch.lint.lint_command PATH...`` runs the same check on its own.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dtwatch.lint.checker import CODES, iter_python_files, lint_file
from dtwatch.paths import EXIT_FOUND, EXIT_OK, EXIT_USAGE

DEFAULT_SELECT = ("DTW000", "DTW001", "DTW002")  # DTW003 (p2p) is opt-in

DESCRIPTION = """\
Find collectives that only some ranks will reach: a dist.barrier(), all_reduce, broadcast...
inside a rank-conditional branch (if rank == 0:, its else side, @rank_zero_only), or skipped by a
rank-conditional return/break/continue/sys.exit(). Static: the code is parsed, never run."""

EPILOG = """\
codes:
  DTW000  could not parse the file
  DTW001  collective inside a rank-conditional branch
  DTW002  rank-conditional early exit that skips a later collective
  DTW003  point-to-point op inside a rank-conditional branch (off unless --select'ed)

Silence one line with "# dtwatch: ignore" or "# noqa: DTW001".
exit status: 0 nothing found, 1 findings, 2 usage error or missing path.

example:
  dtwatch lint train.py src/ --ignore DTW002"""


def add_lint_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``lint`` verb to a main CLI's subparsers; the parsed args go to :func:`run_lint`."""
    parser = subparsers.add_parser(
        "lint",
        help="find collectives inside rank-conditional branches (static check)",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_arguments(parser)
    parser.set_defaults(func=run_lint)
    return parser


def run_lint(args: argparse.Namespace) -> int:
    """Lint ``args.paths``, print the findings, return the exit status (0, 1 or 2)."""
    try:
        select = _parse_codes(args.select, "--select") if args.select else DEFAULT_SELECT
        ignore = _parse_codes(args.ignore, "--ignore") if args.ignore else ()
    except ValueError as exc:
        return _usage_error(str(exc))
    missing = [str(p) for p in args.paths if not Path(p).exists()]
    if missing:
        return _usage_error("no such file or directory: " + ", ".join(missing))

    files = list(iter_python_files(args.paths))
    findings = [
        f for path in files for f in lint_file(path)
        if f.code.startswith(select) and not (ignore and f.code.startswith(ignore))
    ]
    if args.json:
        json.dump({"findings": [f.to_dict() for f in findings], "files_checked": len(files)}, sys.stdout, indent=2)
        print()
    else:
        for f in findings:
            print(f"{f.path}:{f.line}:{f.col}: {f.code} {f.message}")
        print(_summary(len(findings), len({f.path for f in findings}), len(files)), file=sys.stderr)
    return EXIT_FOUND if findings else EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """``python -m dtwatch.lint.lint_command PATH... [--json] [--select CODES] [--ignore CODES]``."""
    parser = argparse.ArgumentParser(
        prog="python -m dtwatch.lint.lint_command",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_arguments(parser)
    return run_lint(parser.parse_args(argv))


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", nargs="+", metavar="PATH", help="Python files, or directories to search for *.py")
    parser.add_argument("--json", action="store_true", help='print {"findings": [...], "files_checked": N}')
    parser.add_argument("--select", metavar="CODES",
                        help=f"comma-separated codes or prefixes to report (default: {','.join(DEFAULT_SELECT)})")
    parser.add_argument("--ignore", metavar="CODES", help="comma-separated codes or prefixes not to report")


def _parse_codes(text: str, option: str) -> tuple[str, ...]:
    codes = tuple(c.strip().upper() for c in text.split(",") if c.strip())
    unknown = [c for c in codes if not any(known.startswith(c) for known in CODES)]
    if not codes or unknown:
        raise ValueError(f"{option}: unknown code {', '.join(unknown) or repr(text)} (known: {', '.join(CODES)})")
    return codes


def _summary(found: int, files_with: int, checked: int) -> str:
    checked_text = f"{checked} file{'s' if checked != 1 else ''} checked"
    if not found:
        return f"dtwatch lint: no rank-conditional collectives found, {checked_text}"
    return f"dtwatch lint: {found} finding{'s' if found != 1 else ''} in {files_with} of {checked_text}"


def _usage_error(message: str) -> int:
    print(f"dtwatch lint: error: {message}", file=sys.stderr)
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
