"""Pure pieces of the diagnosis: wording rules, loop structure, rank tests, how a process ended."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from dtwatch.bundle.process_endings import main_thread_frames_of, process_ending
from dtwatch.diagnose.source import innermost_loop, loops
from dtwatch.diagnose.wording.phrases import fmt_ranks, trim, verb
from dtwatch.lint.checker import rank_branches
from dtwatch.paths import ending_files

REPO = Path(__file__).resolve().parent.parent

REASON = ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
          "[127.0.0.1]:29500. This is typically caused by a peer process exiting, for example because it "
          "crashed or was killed.")


def test_trim_cuts_at_a_sentence_or_word_never_mid_word():
    for limit in (40, 80, 120, 170):
        short = trim(REASON, limit)
        body = short.removesuffix(" ...")
        assert len(short) <= limit + 4 and REASON.startswith(body)
        assert not REASON[len(body):][:1].isalnum(), (limit, short)  # ends at a word boundary
    assert trim(REASON, 120).endswith("29500.")  # a sentence end when there is one
    assert trim("short text", 50) == "short text"


def test_rank_lists_and_verbs_agree():
    assert fmt_ranks([3, 0, 1, 2]) == "ranks 0-3"
    assert fmt_ranks([1]) == "rank 1"
    assert fmt_ranks([0, 2, 3]) == "ranks 0,2-3"
    assert verb([1], "waits", "wait") == "waits" and verb([1, 2], "waits", "wait") == "wait"


def test_loops_and_their_early_exits():
    src = (
        "def train(loader):\n"          # 1
        "    for batch in loader:\n"     # 2
        "        if bad(batch):\n"       # 3
        "            break\n"            # 4
        "        for x in batch:\n"      # 5
        "            if x: break\n"      # 6
        "        step(batch)\n"          # 7
        "    barrier()\n"                # 8
    )
    found = loops(src)
    outer = innermost_loop(found, 7)
    assert (outer.start, outer.end) == (2, 7)
    assert [line for line, _ in outer.exits] == [4]  # the nested loop's break leaves only the nested loop
    assert innermost_loop(found, 6).start == 5
    assert innermost_loop(found, 8) is None


def test_rank_tests_through_attributes_and_flags():
    src = (
        "import os\n"
        "import torch.distributed as dist\n"
        "master_process = int(os.environ['RANK']) == 0\n"
        "class Trainer:\n"
        "    def __init__(self):\n"
        "        self.gpu_id = int(os.environ['LOCAL_RANK'])\n"
        "    def epoch(self):\n"
        "        if self.gpu_id == 0:\n"
        "            dist.barrier()\n"
        "if master_process:\n"
        "    dist.all_reduce(x)\n"
    )
    branches = rank_branches(src)
    assert branches[9] == (8, "if self.gpu_id == 0")
    assert branches[11] == (10, "if master_process")
    assert 7 not in branches


def test_process_ending_reads_faulthandler_output(tmp_path):
    run_dir = str(tmp_path)
    fatal, term = ending_files(run_dir, 3)
    os.makedirs(os.path.dirname(fatal))
    start = time.time() - 1
    assert process_ending(run_dir, 3, start) is None
    with open(fatal, "w") as f:
        f.write("Fatal Python error: Aborted\n\n"
                "Current thread 0x1 (most recent call first):\n  File \"t.py\", line 3\n")
    assert process_ending(run_dir, 3, start)["signal"] == "SIGABRT"
    assert process_ending(run_dir, 3, time.time() + 60) is None  # written before this process started
    os.remove(fatal)
    with open(term, "w") as f:
        f.write("Current thread 0x1 (most recent call first):\n")
    assert process_ending(run_dir, 3, start)["signal"] == "SIGTERM"


def test_main_thread_frames_of_a_faulthandler_dump():
    dump = (
        "Fatal Python error: Aborted\n\n"
        "Thread 0x00007f01 (most recent call first):\n"
        '  File "/usr/lib/python3.11/threading.py", line 320 in wait\n'
        '  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap\n\n'
        "Current thread 0x00007f02 (most recent call first):\n"
        '  File "train.py", line 110 in save\n'
        '  File "train.py", line 140 in main\n'
        '  File "train.py", line 150 in <module>\n'
    )
    frames = main_thread_frames_of(dump)
    assert [(f["line"], f["function"]) for f in frames] == [(110, "save"), (140, "main"), (150, "<module>")]


def test_ranks_at_one_line_are_told_apart_by_shape_only_where_every_rank_passes_the_same_shape():
    from dtwatch.diagnose.compare import _signature
    from dtwatch.diagnose.model import Position
    from dtwatch.diagnose.rank_state import Call

    class Ctx:
        def user_site(self, rank, call):
            return call.user_site or call.site

    line = {"file": "train.py", "line": 40, "function": "main"}

    def at(rank: int, op: str, fingerprint: str) -> Position:
        return Position(rank, "blocked", Call(op, "0", 7, line, 0.0, fingerprint=fingerprint, user_site=line))

    # An uneven all_to_all_single, a scatter's root-only input: shapes that legitimately differ.
    differing = (("all_to_all_single", "[float32:6]", "[float32:10]"), ("scatter", "[float32:16x16]", "[unknown:]"))
    for op, a, b in differing:
        assert _signature(Ctx(), at(0, op, op + a)) == _signature(Ctx(), at(1, op, op + b)), op
    # An all_reduce of different shapes at one line is a real disagreement.
    assert _signature(Ctx(), at(0, "all_reduce", "all_reduce[float32:4]")) != _signature(
        Ctx(), at(1, "all_reduce", "all_reduce[float32:8]"))


_REPLAY_WITHOUT_IO = """
import importlib.util, json, pathlib, sys
assert importlib.util.find_spec("torch") is not None  # torch is there to import: not importing it is the point
fixtures = [json.loads(p.read_text()) for p in sorted(pathlib.Path("tests/incidents").glob("*.json"))]
opened = []
sys.addaudithook(lambda event, args: opened.append(str(args[0])) if event == "open" else None)
import dtwatch.diagnose
kinds = [[f.kind for f in dtwatch.diagnose.diagnose_fixture(fx)] for fx in fixtures]
print(json.dumps({"torch": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")),
                  "opened": [p for p in opened if not p.endswith((".py", ".pyc")) and "__pycache__" not in p],
                  "replayed": len(kinds), "found": sum(1 for k in kinds if k)}))
"""


def test_the_diagnosis_imports_no_torch_and_reads_no_file_while_it_replays_every_incident():
    """``dtwatch.diagnose`` is pure: importing it and replaying the whole recorded corpus loads no torch module and
    opens no file (no /proc, no source file: evidence comes in through the ``Evidence`` it is handed)."""
    out = subprocess.run([sys.executable, "-c", _REPLAY_WITHOUT_IO], capture_output=True, text=True, timeout=120,
                         cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["torch"] == [], got["torch"]
    assert got["opened"] == [], got["opened"]
    assert got["replayed"] == len(list((REPO / "tests" / "incidents").glob("*.json"))) > 50
    assert got["found"] > 50  # the corpus was diagnosed, not skipped
