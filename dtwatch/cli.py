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
import socket
import sys
import tempfile

EPILOG = ("Documentation: README.md (quickstart, metrics, runbook). Exit codes: 0 ok, 1 problem found, 2 usage error, "
          "3 hung job ended by --fail-fast; `run` otherwise exits with its command's status.")


class SettingError(ValueError):
    """A command-line or environment setting has a value that is not allowed."""


def _env_float(name: str, default: float | None, low: float, high: float) -> float | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SettingError(f"{name}={raw!r} is not a number; allowed: seconds from {low:g} to {high:g}") from None
    if not low <= value <= high:
        raise SettingError(f"{name}={raw!r} is out of range; allowed: seconds from {low:g} to {high:g}")
    return value


def _env_choice(name: str, allowed: tuple[str, ...], default: str) -> str:
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw not in allowed:
        raise SettingError(f"{name}={raw!r} is not allowed; allowed: {', '.join(allowed)}")
    return raw


def _env_bool(name: str) -> bool:
    raw = os.environ.get(name, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise SettingError(f"{name}={raw!r} is not allowed; allowed: 1/0, true/false")


PORT_OFF = -1  # "--metrics-port off": no endpoint (distinct from "not given")


def _port(text: str) -> int:
    if text.lower() in ("off", "none", "-1"):
        return PORT_OFF
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port; allowed: 0-65535 (0 = any free port) or 'off'") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is out of range; allowed: 0-65535 (0 = any free port) or 'off'")
    return port


def _seconds(low: float, high: float):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds ({low:g}-{high:g})") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value:g} is out of range; allowed: {low:g}-{high:g} seconds")
        return value
    return parse


def _default_dir() -> str:
    return os.environ.get("DTWATCH_DIR") or os.path.join(tempfile.gettempdir(), "dtwatch")


def _add_watch_options(p: argparse.ArgumentParser, *, for_run: bool) -> None:
    p.add_argument("--dir", default=None, help="root of run directories (env DTWATCH_DIR; default <tmp>/dtwatch)")
    p.add_argument("--job-id", default=None, help="job id (env DTWATCH_JOB_ID; default: torchrun's run id or MASTER_ADDR-PORT"
                   + ("; `run` generates one" if for_run else "") + ")")
    p.add_argument("--stall-window", type=_seconds(0.5, 86400), default=None,
                   help="seconds without progress while a rank waits before a stall is declared "
                        "(env DTWATCH_STALL_WINDOW; default: adapts to the job, 20-600 s)")
    p.add_argument("--window-floor", type=_seconds(0.5, 86400), default=None, help="lower bound of the adaptive window (default 20)")
    p.add_argument("--window-ceiling", type=_seconds(0.5, 86400), default=None, help="upper bound of the adaptive window (default 600)")
    p.add_argument("--metrics-addr", default=None, help="Prometheus bind address (env DTWATCH_METRICS_ADDR; default 0.0.0.0)")
    p.add_argument("--metrics-port", type=_port, default=None,
                   help="Prometheus port, 0 = any free port, 'off' = none (env DTWATCH_METRICS_PORT; default 9464"
                        + (", `run` uses 0" if for_run else "") + ")")
    p.add_argument("--webhook", default=None, help="URL to POST a JSON alert to on a stall (env DTWATCH_WEBHOOK)")
    p.add_argument("--fail-fast", action="store_true", default=None,
                   help="after writing the diagnosis, end the node's ranks and every process they started (DataLoader "
                        "workers, subprocesses): SIGTERM, then SIGKILL after --fail-fast-grace, so the job fails now "
                        "(env DTWATCH_FAIL_FAST=1)")
    p.add_argument("--fail-fast-grace", type=_seconds(0, 600), default=None,
                   help="seconds between SIGTERM and SIGKILL for --fail-fast (default 5)")
    p.add_argument("--console", choices=("auto", "stderr", "off"), default=None,
                   help="where diagnoses and warnings are shown, once each: auto = the stderr of a live local rank "
                        "(torchrun's console; the trainer's log in a Kubernetes pod), stderr = the watchdog's own, "
                        "off (env DTWATCH_CONSOLE; default auto" + (", `run` uses stderr: its terminal" if for_run else "") + ")")
    p.add_argument("--otlp-endpoint", default=None, help="OTLP endpoint for spans/metrics (default: OTEL_EXPORTER_OTLP_ENDPOINT)")
    p.add_argument("--no-pyspy", action="store_true", help="do not run py-spy on a stall (faulthandler stacks only)")


def _watch_options(args: argparse.Namespace, *, for_run: bool):
    from dtwatch.config import default_job_id
    from dtwatch.watchdog.watch import WatchOptions

    stall_window = args.stall_window if args.stall_window is not None else _env_float("DTWATCH_STALL_WINDOW", None, 0.5, 86400)
    port = args.metrics_port
    if port is None and not for_run:
        raw = os.environ.get("DTWATCH_METRICS_PORT")
        if raw:
            try:
                port = _port(raw)
            except argparse.ArgumentTypeError as exc:
                raise SettingError(f"DTWATCH_METRICS_PORT: {exc}") from None
        else:
            port = 9464
    elif port is None and for_run:
        port = 0
    if port == PORT_OFF:
        port = None
    opts = dict(
        dir=args.dir or _default_dir(),
        job_id=args.job_id or os.environ.get("DTWATCH_JOB_ID") or ("" if for_run else default_job_id()),
        stall_window=stall_window,
        metrics_addr=args.metrics_addr or os.environ.get("DTWATCH_METRICS_ADDR") or "0.0.0.0",
        metrics_port=port,
        webhook=args.webhook or os.environ.get("DTWATCH_WEBHOOK", ""),
        fail_fast=bool(args.fail_fast) or _env_bool("DTWATCH_FAIL_FAST"),
        otlp_endpoint=args.otlp_endpoint or "",
        pyspy=not args.no_pyspy,
        console=args.console or _env_choice("DTWATCH_CONSOLE", ("auto", "stderr", "off"), "stderr" if for_run else "auto"),
    )
    if args.fail_fast_grace is not None:
        opts["fail_fast_grace"] = args.fail_fast_grace
    if args.window_floor is not None:
        opts["window_floor"] = args.window_floor
    if args.window_ceiling is not None:
        opts["window_ceiling"] = args.window_ceiling
    if for_run:
        return opts
    opts["node"] = args.node or os.environ.get("DTWATCH_NODE") or socket.gethostname()
    opts["store"] = args.store if args.store is not None else os.environ.get("DTWATCH_STORE", "")
    idle = args.idle_exit if args.idle_exit is not None else _env_float("DTWATCH_IDLE_EXIT", 30.0, 0, 86400 * 365)
    opts["idle_exit"] = idle
    opts["rank_wait"] = args.rank_wait if args.rank_wait is not None else _env_float("DTWATCH_RANK_WAIT", 3600.0, 0, 86400 * 365)
    opts["exit_with_launcher"] = args.exit_with_launcher
    opts["poll_interval"] = args.poll_interval
    return WatchOptions(**opts)


def cmd_watch(args: argparse.Namespace) -> int:
    from dtwatch.watchdog.watch import Watchdog

    opts = _watch_options(args, for_run=False)
    return Watchdog(opts).run()


def cmd_run(args: argparse.Namespace) -> int:
    from dtwatch.watchdog.runner import run

    command = args.command
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print("dtwatch run: give the command after --, e.g. dtwatch run -- torchrun --nproc-per-node 2 train.py", file=sys.stderr)
        return 2
    opts = _watch_options(args, for_run=True)
    watch_args = []
    if opts["stall_window"] is not None:
        watch_args += ["--stall-window", str(opts["stall_window"])]
    for key, flag in (("window_floor", "--window-floor"), ("window_ceiling", "--window-ceiling")):
        if key in opts:
            watch_args += [flag, str(opts[key])]
    watch_args += ["--metrics-addr", opts["metrics_addr"], "--metrics-port", "off" if opts["metrics_port"] is None else str(opts["metrics_port"])]
    if opts["webhook"]:
        watch_args += ["--webhook", opts["webhook"]]
    if opts["fail_fast"]:
        watch_args.append("--fail-fast")
    if opts["otlp_endpoint"]:
        watch_args += ["--otlp-endpoint", opts["otlp_endpoint"]]
    if not opts["pyspy"]:
        watch_args.append("--no-pyspy")
    watch_args += ["--console", opts["console"]]
    if "fail_fast_grace" in opts:
        watch_args += ["--fail-fast-grace", str(opts["fail_fast_grace"])]
    watch_args += ["--idle-exit", "3"]
    return run(command, dir=opts["dir"], job_id=opts["job_id"], watch_args=watch_args)


def cmd_analyze(args: argparse.Namespace) -> int:
    from dtwatch.report.analyze import analyze
    from dtwatch.report.text import render_text
    from dtwatch.report.timeline import render_html, render_svg

    missing = [p for p in args.paths if not os.path.exists(p)]
    if missing:
        print(f"dtwatch analyze: no such path: {', '.join(missing)}", file=sys.stderr)
        return 2
    result = analyze(args.paths, window=args.window)
    if not result.states:
        print("dtwatch analyze: no rings or bundles found under " + ", ".join(args.paths), file=sys.stderr)
        return 2
    text = render_text(result.findings, result.states, now=result.now, warnings=result.warnings,
                       verdict=result.verdict, live_warnings=result.live_warnings)
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
    return 1 if result.stalled else 0


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
    parser.add_argument("--version", action="version", version=f"dtwatch {__import__('dtwatch').__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")

    p = sub.add_parser("run", help="run a training command under dtwatch (zero code changes)",
                       description="Run COMMAND (e.g. torchrun ... train.py) with dtwatch installed in every worker "
                                   "and a watchdog diagnosing stalls.",
                       epilog="Example: dtwatch run --stall-window 10 --fail-fast -- torchrun --nproc-per-node 4 train.py")
    _add_watch_options(p, for_run=True)
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- followed by the command to run")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("watch", help="run the node watchdog (one per job per node)",
                       description="Watch the rings of this node's ranks, diagnose stalls, write incident bundles, "
                                   "serve Prometheus metrics. Started automatically by the first rank of a node unless "
                                   "DTWATCH_WATCHDOG=off (e.g. when a Kubernetes sidecar runs it).")
    _add_watch_options(p, for_run=False)
    p.add_argument("--node", default=None, help="this node's name (env DTWATCH_NODE; default: host name)")
    p.add_argument("--store", default=None,
                   help="HOST:PORT of the job's c10d store for cross-node comparison, or 'none' "
                        "(env DTWATCH_STORE; default: MASTER_ADDR:MASTER_PORT)")
    p.add_argument("--idle-exit", type=_seconds(0, 86400 * 365), default=None,
                   help="exit when all ranks are gone and nothing new appeared for this many seconds; 0 = never (env DTWATCH_IDLE_EXIT; default 30)")
    p.add_argument("--rank-wait", type=_seconds(0, 86400 * 365), default=None,
                   help="exit if no rank has appeared this many seconds after start; 0 = wait forever (env DTWATCH_RANK_WAIT; "
                        "default 3600, longer than torch's 30-minute rendezvous timeout)")
    p.add_argument("--exit-with-launcher", action="store_true",
                   help="stdin is a pipe held open by the launcher (`dtwatch run` does this): once it closes, because the "
                        "command ended or the launcher died (even by SIGKILL), exit as soon as no rank of this node is alive")
    p.add_argument("--log-file", default=None, help="write the watchdog's log to this file instead of stderr")
    p.add_argument("--poll-interval", type=_seconds(0.05, 60), default=1.0, help="seconds between looks at the rings (default 1)")
    p.set_defaults(func=cmd_watch)

    p = sub.add_parser("analyze", help="merge run directories / incident bundles into one report",
                       description="Merge any number of nodes' run directories and incident bundles: findings first, then "
                                   "per-rank state, then evidence. Exit status 1 when a stall is found.")
    p.add_argument("paths", nargs="+", metavar="DIR", help="run directories, bundles or ring files")
    p.add_argument("--json", action="store_true", help="print JSON: {findings: [...], warnings, ranks, bundles}")
    p.add_argument("--svg", metavar="FILE", help="write the per-rank timeline as SVG")
    p.add_argument("--html", metavar="FILE", help="write the timeline and report as one HTML page")
    p.add_argument("--window", type=float, default=0.0,
                   help="for rings without a recorded diagnosis: seconds without progress that count as a stall (default 0: "
                        "any rank still inside a collective)")
    p.set_defaults(func=cmd_analyze)

    p = sub.add_parser("capture", help="pack an incident bundle or run directory into one sanitised JSON fixture",
                       description="Pack an incident (bundle directory) or a run directory (its rings, read now) into one "
                                   "compact JSON file with paths and host names sanitised: for bug reports and replay tests.",
                       epilog="Example: dtwatch capture /tmp/dtwatch/JOB/incidents/INC/NODE -o incident.json")
    p.add_argument("src", metavar="SRC", help="incident bundle (or incident) directory, or run directory")
    p.add_argument("-o", "--output", required=True, metavar="FIXTURE.json", help="file to write")
    p.add_argument("--name", default=None, help="the fixture's name (default: SRC's directory name)")
    p.add_argument("--relative-to", default=None, metavar="DIR", help="paths under DIR become relative (default: cwd)")
    p.add_argument("--recent", type=int, default=16, help="recent calls kept per group per rank (default 16)")
    p.add_argument("--fr-entries", type=int, default=8, help="latest Flight Recorder entries kept per group (default 8)")
    p.add_argument("--window", type=float, default=0.0, help="stall window recorded for a run directory (default 0)")
    p.add_argument("--truth", default=None, metavar="FILE", help="JSON file with what really happened, stored as `truth`")
    p.set_defaults(func=cmd_capture)

    from dtwatch.report.checks import add_checks_parser

    add_checks_parser(sub)
    try:
        from dtwatch.lint.cli import add_lint_parser

        add_lint_parser(sub)
    except ImportError:
        pass
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) or args.verb == "watch" else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s", filename=getattr(args, "log_file", None))
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except SettingError as exc:
        print(f"dtwatch {args.verb}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
