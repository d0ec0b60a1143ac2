#!/usr/bin/env python3
"""Makes the README's pictures from a real hang. Run by hand; not part of the test suite.

    . .venv/bin/activate && python docs/make_pictures.py

It runs the demo's job, examples/hang_rank_conditional.py on 4 CPU ranks, under
``dtwatch run --stall-window 5 --fail-fast -- torchrun --nproc-per-node 4 ...`` (as examples/demo.sh
does) while a real Prometheus scrapes the watchdog every second, and writes

* ``docs/images/timeline.svg``: ``dtwatch analyze <run dir> --svg``, the analyzer's per-rank timeline;
* ``docs/images/prometheus-drift.png``: headless Chromium's screenshot of Prometheus's graph page
  plotting the watchdog's per-rank stall state (``dtwatch_rank_stalled + dtwatch_rank_culprit``)
  through that run.

Needs ``prometheus`` (``.ci/tools/prometheus.sh`` puts it in ``.tools/bin``), Chromium and the JavaScript
libraries that Debian's Prometheus web UI links to::

    apt-get install -y --no-install-recommends chromium libjs-jquery libjs-rickshaw libjs-d3 \\
      libjs-bootstrap4 libjs-moment libjs-moment-timezone libjs-mustache \\
      libjs-eonasdan-bootstrap-datetimepicker libjs-jquery-hotkeys libjs-popper.js fonts-glyphicons-halflings
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.prom_servers import Prometheus, until  # noqa: E402

IMAGES = REPO / "docs" / "images"
EXAMPLE = "examples/hang_rank_conditional.py"
DEBIAN_WEB = Path("/usr/share/prometheus/web")
# What the screenshot plots, per rank: 0 running, 1 stalled (waiting), 2 stalled and named the culprit.
GRAPH = "max by (rank) (dtwatch_rank_stalled + dtwatch_rank_culprit)"


def find_tool(name: str) -> str:
    for candidate in (REPO / ".tools" / "bin" / name, shutil.which(name)):
        if candidate and os.access(candidate, os.X_OK):
            return str(candidate)
    sys.exit(f"{name} not found: see this script's docstring")


def web_assets(prometheus: str, tmp: Path) -> Path:
    """Debian's Prometheus web UI: its templates and scripts, with the libjs-* symlinks made absolute.

    The package links ``static/jquery`` etc. to ``../../../javascript/...``, which only resolves when the
    UI is installed at /usr/share/prometheus/web; .ci/tools/prometheus.sh unpacks it elsewhere.
    """
    if (DEBIAN_WEB / "templates" / "graph.html").exists():
        return DEBIAN_WEB
    unpacked = Path(os.path.realpath(prometheus)).parent.parent / "share" / "prometheus" / "web"
    if not (unpacked / "templates" / "graph.html").exists():
        sys.exit(f"Prometheus's web UI is not at {unpacked}: see this script's docstring")
    web = tmp / "web"
    shutil.copytree(unpacked, web, symlinks=True)
    for link in [p for p in web.rglob("*") if p.is_symlink()]:
        target = os.readlink(link)
        if not os.path.isabs(target):
            absolute = os.path.normpath(DEBIAN_WEB / link.parent.relative_to(web) / target)
            if not os.path.exists(absolute):
                sys.exit(f"{absolute} is missing (for {link.relative_to(web)}): see this script's docstring")
            link.unlink()
            link.symlink_to(absolute)
    return web


def main() -> int:
    prometheus_bin, chromium = find_tool("prometheus"), find_tool("chromium")
    IMAGES.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="dtwatch-pictures-"))
    root = tmp / "dtwatch"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env = {k: v for k, v in env.items() if not k.startswith("DTWATCH_")}
    run = prometheus = None
    try:
        web = web_assets(prometheus_bin, tmp)
        run = subprocess.Popen(
            [sys.executable, "-m", "dtwatch", "run", "--dir", str(root), "--stall-window", "5", "--fail-fast",
             "--metrics-addr", "127.0.0.1", "--",
             sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", EXAMPLE],
            cwd=REPO, env=env, stdout=(tmp / "run.log").open("wb"), stderr=subprocess.STDOUT,
        )
        ready = until("the watchdog's metrics address", lambda: [
            json.loads(p.read_text()) for p in root.glob("*/watchdog-*.json")], timeout=60)[0]
        run_dir = next(root.glob("*/watchdog-*.json")).parent
        target = urllib.parse.urlsplit(ready["url"]).netloc
        # Debian's build serves its web UI from --web.local-assets
        prometheus = Prometheus(prometheus_bin, tmp / "prometheus", [target], extra_args=[f"--web.local-assets={web}/"])
        prometheus.wait_target_up()
        started = time.time()
        code = run.wait(timeout=300)
        print((tmp / "run.log").read_text(errors="replace")[-3000:])
        if code != 3:
            sys.exit(f"dtwatch run exited {code}, not 3 (a diagnosed hang ended by --fail-fast)")
        time.sleep(2)  # the last scrapes

        svg = IMAGES / "timeline.svg"
        analyze = subprocess.run([sys.executable, "-m", "dtwatch", "analyze", str(run_dir), "--svg", str(svg)],
                                 cwd=REPO, env=env, capture_output=True, text=True)
        print(analyze.stdout[-2000:])
        if analyze.returncode != 1 or not svg.exists():  # 1: a stall was found
            sys.exit(f"dtwatch analyze exited {analyze.returncode}: {analyze.stderr}")
        svg.write_text(svg.read_text().replace(str(REPO) + "/", ""))  # repository-relative paths

        span = int(time.time() - started) + 5  # the whole run, ending now
        url = f"{prometheus.url}/graph?" + urllib.parse.urlencode(
            {"g0.expr": GRAPH, "g0.tab": "0", "g0.range_input": f"{span}s", "g0.stacked": "0"})
        png = IMAGES / "prometheus-drift.png"
        subprocess.run(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--no-first-run", f"--user-data-dir={tmp / 'chromium'}",
             "--hide-scrollbars", "--window-size=1400,860",  # 860: the legend of 4 ranks "--virtual-time-budget=10000",
             f"--screenshot={png}", url],
            check=True, capture_output=True, timeout=120,
        )
        print(f"{svg} ({svg.stat().st_size} bytes)\n{png} ({png.stat().st_size} bytes)\n{url}")
        return 0
    finally:
        if run is not None and run.poll() is None:
            run.terminate()
            run.wait(timeout=60)
        if prometheus is not None:
            prometheus.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
