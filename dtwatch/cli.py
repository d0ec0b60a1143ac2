"""The ``dtwatch`` command: run, watch, analyze, capture, checks, lint.

Exit codes: 0 success / nothing found; 1 ``analyze``/``lint`` found a problem; 2 usage or configuration
error; 3 ``run``/``watch`` ended a hung job (``--fail-fast``); 4 ``watch``: another watchdog already
runs for this job on this node. ``run`` otherwise exits with its command's status (a crash dtwatch
diagnosed keeps it).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from dtwatch.config import WATCH_OPTIONS, ConfigError, Option, WatchOptions
from dtwatch.paths import EXIT_FAILED_FAST, EXIT_FOUND, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE
from dtwatch.version import __version__

EPILOG = (f"Documentation: README.md (quickstart, metrics, runbook). Exit codes: {EXIT_OK} ok, {EXIT_FOUND} problem "
          f"found, {EXIT_USAGE} usage error, {EXIT_FAILED_FAST} hung job ended by --fail-fast; `run` otherwise exits "
          "with its command's status.")
OFF = "off"


def _typed(name: str) -> Callable[[str], Any]:
    """The argparse type of the watchdog option ``name``: parsed and checked as :data:`WATCH_OPTIONS` says,
    so a bad value is an error naming the flag and what is allowed."""
    option: Option = WATCH_OPTIONS[name]

    def parse(text: str) -> Any:
        try:
            return option.from_text(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is invalid: allowed {option.allowed}") from None

    parse.__name__ = name  # argparse names the type in some messages
    return parse


def _env(name: str) -> str:
    return f"env {WATCH_OPTIONS[name].env}"


def _add_watch_options(p: argparse.ArgumentParser, *, for_run: bool) -> None:
    """The watchdog's options. Not given, an option is absent from the namespace (argparse.SUPPRESS), so the
    environment and the defaults apply (see :func:`dtwatch.config.watch_options`)."""
    unset = argparse.SUPPRESS
    p.add_argument("--dir", type=_typed("dir"), default=unset,
                   help=f"root of run directories ({_env('dir')}; default <tmp>/dtwatch)")
    p.add_argument("--job-id", type=_typed("job_id"), default=unset,
                   help=f"job id ({_env('job_id')}; default: torchrun's run id or MASTER_ADDR-PORT"
                   + ("; `run` generates one" if for_run else "") + ")")
    p.add_argument("--stall-window", type=_typed("stall_window"), default=unset,
                   help="seconds without progress while a rank waits before a stall is declared "
                        f"({_env('stall_window')}; default: adapts to the job, 20-600 s)")
    p.add_argument("--window-floor", type=_typed("window_floor"), default=unset,
                   help="lower bound of the adaptive window (default 20)")
    p.add_argument("--window-ceiling", type=_typed("window_ceiling"), default=unset,
                   help="upper bound of the adaptive window (default 600)")
    p.add_argument("--metrics-addr", type=_typed("metrics_addr"), default=unset,
                   help=f"Prometheus bind address ({_env('metrics_addr')}; default 0.0.0.0)")
    p.add_argument("--metrics-port", type=_typed("metrics_port"), default=unset,
                   help=f"Prometheus port, 0 = any free port, 'off' = none ({_env('metrics_port')}; default 9464"
                        + (", `run` uses 0" if for_run else "") + ")")
    p.add_argument("--webhook", type=_typed("webhook"), default=unset,
                   help=f"URL to POST a JSON alert to on a stall ({_env('webhook')})")
    p.add_argument("--fail-fast", action="store_true", default=unset,
                   help="after writing the diagnosis, end the node's ranks and every process they started (DataLoader "
                        "workers, subprocesses): SIGTERM, then SIGKILL after --fail-fast-grace, so the job fails now "
                        f"({_env('fail_fast')}=1)")
    p.add_argument("--fail-fast-grace", type=_typed("fail_fast_grace"), default=unset,
                   help="seconds between SIGTERM and SIGKILL for --fail-fast (default 5)")
    p.add_argument("--console", type=_typed("console"), default=unset, metavar="{auto,stderr,off}",
                   help="where diagnoses and warnings are shown, once each: auto = the stderr of a live local rank "
                        "(torchrun's console; the trainer's log in a Kubernetes pod), stderr = the watchdog's own, "
                        f"off ({_env('console')}; default auto"
                        + (", `run` uses stderr: its terminal" if for_run else "") + ")")
    p.add_argument("--otlp-endpoint", type=_typed("otlp_endpoint"), default=unset,
                   help="OTLP endpoint for spans/metrics (default: OTEL_EXPORTER_OTLP_ENDPOINT)")
    p.add_argument("--no-pyspy", dest="pyspy", action="store_false", default=unset,
                   help="do not run py-spy on a stall (faulthandler stacks only)")


_WATCH_FIELDS = frozenset(WatchOptions.__dataclass_fields__)
RUN_DEFAULTS = {"job_id": "", "metrics_port": 0, "console": "stderr"}
"""What `dtwatch run` defaults to differently from `dtwatch watch`: a job id it generates, any free port,
its own terminal."""


def _watch_options(args: argparse.Namespace, *, for_run: bool) -> WatchOptions:
    from dtwatch.config import watch_options

    given = {k: v for k, v in vars(args).items() if k in _WATCH_FIELDS}
    return watch_options(given, defaults=RUN_DEFAULTS if for_run else None)


def _run_watch_args(opts: WatchOptions) -> list[str]:
    """The command line of the watchdog `dtwatch run` starts: the options as resolved here."""
    args = [] if opts.stall_window is None else ["--stall-window", str(opts.stall_window)]
    port = OFF if opts.metrics_port is None else str(opts.metrics_port)
    args += ["--window-floor", str(opts.window_floor), "--window-ceiling", str(opts.window_ceiling),
             "--metrics-addr", opts.metrics_addr, "--metrics-port", port]
    if opts.webhook:
        args += ["--webhook", opts.webhook]
    if opts.fail_fast:
        args.append("--fail-fast")
    if opts.otlp_endpoint:
        args += ["--otlp-endpoint", opts.otlp_endpoint]
    if not opts.pyspy:
        args.append("--no-pyspy")
    args += ["--console", opts.console, "--fail-fast-grace", str(opts.fail_fast_grace), "--idle-exit", "3"]
    return args


def cmd_watch(args: argparse.Namespace) -> int:
    from dtwatch.watchdog.watch import Watchdog

    return Watchdog(_watch_options(args, for_run=False)).run()


def cmd_run(args: argparse.Namespace) -> int:
    from dtwatch.watchdog.runner import run

    command = args.command
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print("dtwatch run: give the command after --, e.g. dtwatch run -- torchrun --nproc-per-node 2 train.py",
              file=sys.stderr)
        return EXIT_USAGE
    opts = _watch_options(args, for_run=True)
    return run(command, root=opts.dir, job_id=opts.job_id, watch_args=_run_watch_args(opts))


def cmd_analyze(args: argparse.Namespace) -> int:
    from dtwatch.bundle.file_evidence import FileEvidence
    from dtwatch.render.report_text import render_text
    from dtwatch.render.timeline import render_html, render_svg
    from dtwatch.report.analyze import analyze

    missing = [p for p in args.paths if not os.path.exists(p)]
    if missing:
        print(f"dtwatch analyze: no such path: {', '.join(missing)}", file=sys.stderr)
        return EXIT_USAGE
    result = analyze(args.paths, window=args.window)
    if not result.states and not result.problems:
        print("dtwatch analyze: no rings, bundles or Flight Recorder dumps found under " + ", ".join(args.paths),
              file=sys.stderr)
        return EXIT_USAGE
    text = render_text(result.findings, result.states, now=result.now, warnings=result.warnings,
                       verdict=result.verdict, live_warnings=result.live_warnings,
                       dumps=result.dumps.to_dict() if result.dumps is not None else None, evidence=FileEvidence(),
                       endings=result.endings)
    if args.svg or args.html:
        svg = render_svg(result.states, result.findings, now=result.now)
        if args.svg:
            with open(args.svg, "w") as f:
                f.write(svg)
        if args.html:
            with open(args.html, "w") as f:
                f.write(render_html(svg, text))
    if args.json:
        print(json.dumps(result.to_dict(), indent=2, default=str))
    else:
        print(text, end="")
    if not result.states:
        return EXIT_USAGE  # every input is damaged: nothing could be diagnosed (the report names them)
    return EXIT_FOUND if result.stalled or result.unreadable else EXIT_OK


def cmd_capture(args: argparse.Namespace) -> int:
    from dtwatch.report.capture import main_capture

    return main_capture(args.src, args.output, name=args.name, relative_to=args.relative_to, recent=args.recent,
                        fr_entries=args.fr_entries, window=args.window, truth_file=args.truth)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dtwatch",
        description="Makes hung and desynchronised PyTorch distributed jobs explain themselves: which rank, "
                    "which collective, which line.",
        epilog=EPILOG,
    )
    parser.add_argument("--version", action="version", version=f"dtwatch {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")

    p = sub.add_parser("run", help="run a training command under dtwatch (zero code changes)",
                       description="Run COMMAND (e.g. torchrun ... train.py) with dtwatch installed in every worker "
                                   "and a watchdog diagnosing stalls.",
                       epilog="Example: dtwatch run --stall-window 10 --fail-fast -- "
                              "torchrun --nproc-per-node 4 train.py")
    _add_watch_options(p, for_run=True)
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- followed by the command to run")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("watch", help="run the node watchdog (one per job per node)",
                       description="Watch the rings of this node's ranks, diagnose stalls, write incident bundles, "
                                   "serve Prometheus metrics. Started automatically by the first rank of a node unless "
                                   "DTWATCH_WATCHDOG=off (e.g. when a Kubernetes sidecar runs it).")
    _add_watch_options(p, for_run=False)
    unset = argparse.SUPPRESS
    p.add_argument("--node", type=_typed("node"), default=unset,
                   help=f"this node's name ({_env('node')}; default: host name)")
    p.add_argument("--store", type=_typed("store"), default=unset,
                   help="HOST:PORT of the job's c10d store for cross-node comparison, or 'none' "
                        f"({_env('store')}; default: MASTER_ADDR:MASTER_PORT)")
    p.add_argument("--serve-store", action="store_true", default=unset,
                   help="serve a TCPStore for dtwatch's exchange at --store's port on this node, so that its traffic "
                        "stays off the job's own store (give every node's watchdog the same --store HOST:PORT)")
    p.add_argument("--store-interval", type=_typed("store_interval"), default=unset,
                   help="seconds between cross-node exchanges while a rank is in a collective, 5x that otherwise "
                        "(default 2)")
    p.add_argument("--full-view-ranks", type=_typed("full_view_ranks"), default=unset,
                   help="jobs of up to this many ranks: every node's diagnosis sees every rank; beyond, the ranks "
                        "that stand out and a sample of the others, which keeps each exchange small "
                        f"({_env('full_view_ranks')}; default 64)")
    p.add_argument("--idle-exit", type=_typed("idle_exit"), default=unset,
                   help="exit when all ranks are gone and nothing new appeared for this many seconds; 0 = never "
                        f"({_env('idle_exit')}; default 30)")
    p.add_argument("--rank-wait", type=_typed("rank_wait"), default=unset,
                   help="exit if no rank has appeared this many seconds after start; 0 = wait forever "
                        f"({_env('rank_wait')}; default 3600, longer than torch's 30-minute rendezvous timeout)")
    p.add_argument("--exit-with-launcher", action="store_true", default=unset,
                   help="stdin is a pipe held open by the launcher (`dtwatch run` does this): once it closes, "
                        "because the command ended or the launcher died (even by SIGKILL), exit as soon as no rank "
                        "of this node is alive")
    p.add_argument("--log-file", default=None, help="write the watchdog's log to this file instead of stderr")
    p.add_argument("--poll-interval", type=_typed("poll_interval"), default=unset,
                   help="seconds between looks at the rings (default 1)")
    p.set_defaults(func=cmd_watch)

    p = sub.add_parser("analyze", help="merge run directories / incident bundles into one report",
                       description="Merge any number of nodes' run directories and incident bundles: findings first, "
                                   "then per-rank state, then evidence. Also diagnoses a job that ran without dtwatch "
                                   "from torch's own Flight Recorder dumps (one file per rank, pickle or JSON, found "
                                   "by content; never unpickled beyond plain data). Exit status 1 when a stall is "
                                   "found.",
                       epilog="Example: dtwatch analyze /tmp/nccl_dumps/  (torch's per-rank Flight Recorder files)")
    p.add_argument("paths", nargs="+", metavar="DIR",
                   help="run directories, bundles, ring files, or Flight Recorder dump directories or files")
    p.add_argument("--json", action="store_true", help="print JSON: {findings: [...], warnings, ranks, bundles}")
    p.add_argument("--svg", metavar="FILE", help="write the per-rank timeline as SVG")
    p.add_argument("--html", metavar="FILE", help="write the timeline and report as one HTML page")
    p.add_argument("--window", type=float, default=0.0,
                   help="for rings without a recorded diagnosis: seconds without progress that count as a stall "
                        "(default 0: any rank still inside a collective)")
    p.set_defaults(func=cmd_analyze)

    p = sub.add_parser("capture", help="pack an incident bundle or run directory into one sanitised JSON fixture",
                       description="Pack an incident (bundle directory) or a run directory (its rings, read now) into "
                                   "one compact JSON file with paths and host names sanitised: for bug reports and "
                                   "replay tests.",
                       epilog="Example: dtwatch capture /tmp/dtwatch/JOB/incidents/INC/NODE -o incident.json")
    p.add_argument("src", metavar="SRC", help="incident bundle (or incident) directory, or run directory")
    p.add_argument("-o", "--output", required=True, metavar="FIXTURE.json", help="file to write")
    p.add_argument("--name", default=None, help="the fixture's name (default: SRC's directory name)")
    p.add_argument("--relative-to", default=None, metavar="DIR", help="paths under DIR become relative (default: cwd)")
    p.add_argument("--recent", type=int, default=16, help="recent calls kept per group per rank (default 16)")
    p.add_argument("--fr-entries", type=int, default=8,
                   help="latest Flight Recorder entries kept per group (default 8)")
    p.add_argument("--window", type=float, default=0.0, help="stall window recorded for a run directory (default 0)")
    p.add_argument("--truth", default=None, metavar="FILE",
                   help="JSON file with what really happened, stored as `truth`")
    p.set_defaults(func=cmd_capture)

    from dtwatch.report.checks import add_checks_parser

    add_checks_parser(sub)
    try:
        from dtwatch.lint.lint_command import add_lint_parser

        add_lint_parser(sub)
    except ImportError:
        pass
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    verbose = getattr(args, "verbose", False) or args.verb == "watch"
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s", filename=getattr(args, "log_file", None))
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        return int(args.func(args) or EXIT_OK)
    except ConfigError as exc:
        print(f"dtwatch {args.verb}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
