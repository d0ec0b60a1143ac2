"""dtwatch lint: rank-conditional collectives, found statically.

Fixtures in ``tests/lint_fixtures/`` mark each line that must be reported with ``# expect: CODE``;
every unmarked line must stay clean, so each fixture checks positives and negatives at once.
"""
from __future__ import annotations

import argparse
import ast
import doctest
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import dtwatch.lint.checker
from dtwatch.lint.checker import COLLECTIVES, LintFinding, is_rank_conditional_line, lint_file, lint_paths, lint_source
from dtwatch.lint.lint_command import add_lint_parser
from dtwatch.lint.visitor import ModuleChecker
from dtwatch.ops import OP_KINDS, P2P_NAMES

REPO = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "lint_fixtures"
FIXTURE_FILES = sorted(FIXTURES.glob("*.py"))
EXPECT = re.compile(r"# expect: (?P<codes>DTW\d{3}(?:\s*,\s*DTW\d{3})*)\s*$")


def expected_findings(path: Path) -> set[tuple[int, str]]:
    expected = set()
    for number, text in enumerate(path.read_text().splitlines(), start=1):
        match = EXPECT.search(text)
        if match:
            expected |= {(number, code.strip()) for code in match["codes"].split(",")}
    return expected


def line_of(path: Path, fragment: str) -> int:
    """The 1-based number of the only line of ``path`` containing ``fragment``."""
    numbers = [n for n, text in enumerate(path.read_text().splitlines(), start=1) if fragment in text]
    assert len(numbers) == 1, f"{fragment!r} found on lines {numbers} of {path.name}"
    return numbers[0]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dtwatch.lint.lint_command", *args],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )


# --- the fixtures: exactly the marked lines are reported --------------------------------------

@pytest.mark.parametrize("path", FIXTURE_FILES, ids=lambda p: p.name)
def test_fixture_reports_exactly_the_marked_lines(path: Path) -> None:
    found = {(f.line, f.code) for f in lint_file(path)}
    assert found == expected_findings(path)


def test_fixtures_cover_every_code_and_some_clean_files() -> None:
    codes = {code for path in FIXTURE_FILES for _, code in expected_findings(path)}
    clean = {path.name for path in FIXTURE_FILES if not expected_findings(path)}
    assert codes == {"DTW001", "DTW002", "DTW003"}
    assert {"clean_train.py", "not_rank.py"} <= clean


# --- what a finding says ---------------------------------------------------------------------

def test_finding_names_the_call_the_condition_and_its_line() -> None:
    path = FIXTURES / "basic.py"
    [finding] = lint_file(path)
    if_line = line_of(path, "torch.save(") - 1
    assert (finding.code, finding.call, finding.condition) == ("DTW001", "dist.barrier()", "if rank == 0")
    assert finding.message.startswith(
        f"dist.barrier() inside rank-conditional branch 'if rank == 0' (line {if_line}): "
        "only some ranks will call it and the others will hang"
    )
    assert finding.col == 9  # 1-based, like flake8


def test_else_and_elif_sides_say_which_side() -> None:
    path = FIXTURES / "else_branch.py"
    messages = {f.line: f.message for f in lint_file(path)}
    all_reduce = messages[line_of(path, "dist.all_reduce(tensor)  #")]
    assert "else branch of rank-conditional 'if rank == 0'" in all_reduce
    broadcast = messages[line_of(path, "dist.broadcast(")]
    assert "rank-conditional branch 'elif rank == world_size - 1'" in broadcast


def test_rank_zero_only_function_is_the_condition() -> None:
    findings = lint_file(FIXTURES / "rank_zero_only.py")
    assert [(f.call, f.condition) for f in findings] == [
        ("dist.all_reduce()", "@rank_zero_only"),
        ("dist.barrier()", "@accelerator.on_main_process"),
    ]
    assert "rank-restricted function '@rank_zero_only'" in findings[0].message


def test_early_exit_names_the_collective_it_skips() -> None:
    path = FIXTURES / "early_exit.py"
    by_line = {f.line: f for f in lint_file(path)}
    exit_finding = by_line[line_of(path, "return  # expect")]
    assert exit_finding.call == "return"
    assert exit_finding.condition == "if rank != 0"
    assert f"skips dist.barrier() (line {line_of(path, '    dist.barrier()')})" in exit_finding.message
    assert "sys.exit()" in by_line[line_of(path, "sys.exit(1)")].message
    assert "skips dist.destroy_process_group()" in by_line[line_of(path, "sys.exit(1)")].message


def test_sync_dist_keyword_is_reported_with_its_value() -> None:
    calls = [f.call for f in lint_file(FIXTURES / "receivers.py")]
    assert "self_.log(..., sync_dist=True)" in calls
    assert "tdist.gather()" in calls and "dist_reduce()" in calls


def test_to_dict_has_every_field() -> None:
    [finding] = lint_source("if rank == 0:\n    dist.barrier()\n", "x.py")
    assert finding.to_dict() == {
        "path": "x.py", "line": 2, "col": 5, "code": "DTW001", "call": "dist.barrier()",
        "condition": "if rank == 0", "message": finding.message,
    }
    with pytest.raises(AttributeError):
        finding.line = 3  # type: ignore[misc]  # frozen: the assignment must fail


# --- rank tests and collectives, one expression at a time ------------------------------------

@pytest.mark.parametrize("test", [
    "rank == 0", "global_rank", "not local_rank", "self.rank == 0", "args.local_rank in [-1, 0]",
    "os.environ['RANK'] == '0'", "os.environ.get('LOCAL_RANK') == '0'", "int(os.getenv('RANK', 0)) == 0",
    "dist.get_rank() == 0", "torch.distributed.get_rank() == 0", "get_rank() == 0", "dist.get_rank(group) == 0",
    "get_local_rank() == 0", "is_main_process", "is_main_process()", "is_master", "is_rank_zero",
    "is_local_main_process", "accelerator.is_main_process", "trainer.is_global_zero", "is_global_zero",
    "main_process", "my_rank == 1", "world_rank == 1", "RANK == 0", "myRank == 0", "ok and rank == 0",
    "local_rank == -1 or local_rank == 0",
    # Accelerate, Lightning and Fabric.
    "accelerator.process_index == 0", "accelerator.local_process_index == 0", "accelerator.is_last_process",
    "state.is_main_process", "self.global_rank == 0", "self.trainer.is_global_zero", "self.local_rank == 0",
    "fabric.is_global_zero", "fabric.global_rank == 0", "fabric.node_rank == 0",
])
def test_rank_conditional_tests(test: str) -> None:
    findings = lint_source(f"if {test}:\n    dist.barrier()\n", "t.py")
    assert [(f.code, f.condition) for f in findings] == [("DTW001", f"if {test}")]


@pytest.mark.parametrize("test", [
    "rankings", "ranker", "num_ranks > 1", "franks", "crank", "rank_filter", "world_size > 1",
    "dist.get_world_size() > 1", "local_rank == -1", "args.local_rank != -1", "rank is None",
    "os.environ.get('WORLD_SIZE')", "mode == 'rank'", "src_rank == 0", "peer_rank > 1",
    "dist.get_global_rank(group, 0) == 0", "per_rank_sizes",
])
def test_tests_that_are_not_rank_conditional(test: str) -> None:
    assert lint_source(f"if {test}:\n    dist.barrier()\n", "t.py") == []


@pytest.mark.parametrize("call", [
    "dist.all_gather_into_tensor(a, b)", "dist.all_to_all_single(a, b)", "dist.reduce_scatter_tensor(a, b)",
    "dist._all_gather_base(a, b)", "dist.broadcast_object_list(x)", "dist.gather_object(x)",
    "dist.scatter_object_list(a, b)", "dist.init_process_group('nccl')", "dist.destroy_process_group()",
    "torch.distributed.broadcast(t, 0)", "c10d.reduce(t, 0)", "distributed_c10d.gather(t)",
    "accelerator.gather(t)", "self.trainer.strategy.broadcast(x)", "fabric.broadcast(x)",
    "barrier()", "anything.all_gather(t)", "FSDP.summon_full_params(model)",
    "dist.all_gather_single(a, b)", "dist.reduce_scatter_single(a, b)", "c10d.all_gather_single(a, b)",
    # Accelerate, Lightning, Fabric and Distributed Checkpoint.
    "accelerator.wait_for_everyone()", "self.accelerator.check_trigger()", "accelerator.pad_across_processes(t)",
    "trainer.strategy.barrier()", "self.trainer.strategy.reduce_boolean_decision(d)", "self.all_gather(t)",
    "trainer.save_checkpoint(path)", "self._trainer.save_checkpoint(path)", "fabric.save(path, state)",
    "self.fabric.load(path, state)", "fabric.all_reduce(t)", "torch.distributed.checkpoint.save(state)",
    "torch.distributed.checkpoint.state_dict_saver.save(state)", "dist.checkpoint.load(state)",
])
def test_collective_calls(call: str) -> None:
    [finding] = lint_source(f"if rank == 0:\n    {call}\n", "t.py")
    assert finding.code == "DTW001"
    assert finding.call.endswith("()")


@pytest.mark.parametrize("call", [
    "gather(t)", "reduce(f, xs)", "np.broadcast(a, b)", "torch.scatter(t, 0, i, s)", "sock.send(b)",
    "queue.recv()", "print(rank)", "dist.get_rank()", "dist.is_initialized()",
    # The same names where they are not collectives: the receiver or module decides.
    "torch.save(m, path)", "accelerator.save(m, path)", "save(m, path)", "torch.load(path)", "json.load(f)",
    "strategy.save(x)", "dist.save(x)", "model.load_state_dict(sd)", "load_state_dict(sd)",
    "save_checkpoint(path)", "callback.save_checkpoint(path)", "get_model_state_dict(model)",
    "self.get_state_dict()", "check_trigger()", "accelerator.set_trigger()", "accelerator.print(x)",
    "fabric.print(x)", "fabric.log('loss', t)",
])
def test_calls_that_are_not_collectives(call: str) -> None:
    assert lint_source(f"if rank == 0:\n    {call}\n", "t.py") == []


def test_import_aliases_make_plain_names_collectives() -> None:
    source = (
        "from torch.distributed import broadcast as bcast, reduce\n"
        "from torch import distributed as td\n"
        "if rank == 0:\n    bcast(t, 0)\n    reduce(t, 0)\n    td.gather(t)\n"
    )
    assert [f.call for f in lint_source(source, "t.py")] == ["bcast()", "reduce()", "td.gather()"]


def test_checkpoint_names_count_only_from_distributed_checkpoint() -> None:
    source = (
        "from torch.distributed.checkpoint import save as dcp_save, load_state_dict\n"
        "from torch.distributed import checkpoint\n"
        "from accelerate.utils import save\n"
        "import torch.distributed.checkpoint.state_dict as sd\n"
        "if rank == 0:\n    dcp_save(s)\n    load_state_dict(s)\n    checkpoint.load(s)\n"
        "    sd.get_model_state_dict(m)\n    save(s, path)\n    torch.save(s, path)\n"
    )
    assert [f.call for f in lint_source(source, "t.py")] == [
        "dcp_save()", "load_state_dict()", "checkpoint.load()", "sd.get_model_state_dict()"]


def test_log_dir_is_a_collective_when_read_from_a_trainer() -> None:
    source = (
        "if trainer.is_global_zero:\n"
        "    path = trainer.log_dir\n    other = args.log_dir\n    logger.log_dir\n    trainer.log_dir = path\n"
    )
    [finding] = lint_source(source, "t.py")
    assert (finding.line, finding.code, finding.call) == (2, "DTW001", "trainer.log_dir")
    assert finding.message.startswith("trainer.log_dir inside rank-conditional branch 'if trainer.is_global_zero'")


def test_main_process_first_is_not_a_rank_test() -> None:
    source = (
        "with accelerator.main_process_first():\n    accelerator.wait_for_everyone()\n"
        "with fabric.rank_zero_first():\n    fabric.barrier()\n"
    )
    assert lint_source(source, "t.py") == []
    assert dtwatch.lint.checker.rank_branches(source, "t.py") == {}


def test_a_same_file_function_is_a_collective_when_it_calls_one() -> None:
    path = FIXTURES / "wrappers.py"
    by_line = {f.line: f for f in lint_file(path)}
    save = by_line[line_of(path, "checkpointer.save(model)  # expect")]
    assert save.call == "checkpointer.save()"
    gather_line = line_of(path, "return get_model_state_dict(model)")
    assert save.message.startswith(
        f"checkpointer.save() (it calls self._full_state_dict() at line {gather_line - 5}, which calls "
        f"get_model_state_dict() at line {gather_line}) inside rank-conditional branch 'if rank == 0'")
    chained = by_line[line_of(path, "self.sync(t)  # expect")]
    assert "which calls sync_all() at line" in chained.message and "which calls dist.all_reduce()" in chained.message
    stop = by_line[line_of(path, "return  # expect: DTW002")]
    assert f"skips checkpointer.save() (line {line_of(path, 'return  # expect: DTW002') + 1}; it calls " in stop.message


def test_a_same_file_function_shadows_a_collective_name() -> None:
    source = (
        "import torch.distributed as dist\n"
        "def barrier():\n    print('a local barrier that waits for nobody')\n"
        "class Sync:\n    def all_gather(self, t):\n        return [t]\n"
        "    def run(self, rank, t):\n        if rank == 0:\n            self.all_gather(t)\n"
        "if rank == 0:\n    barrier()\n    dist.barrier()\n"
    )
    assert [(f.line, f.call) for f in lint_source(source, "t.py")] == [(12, "dist.barrier()")]


def test_rank_branches_know_the_libraries_rank_tests() -> None:
    """The diagnosis asks which rank test a line runs under: the libraries' tests and decorators count."""
    source = (
        "if accelerator.is_last_process:\n    accelerator.wait_for_everyone()\n"
        "@rank_zero_experiment\ndef experiment(self):\n    return self.trainer.log_dir\n"
        "if fabric.global_rank == 0:\n    fabric.save(path, state)\n"
    )
    branches = dtwatch.lint.checker.rank_branches(source, "t.py")
    assert branches[2] == (1, "if accelerator.is_last_process")
    assert branches[5] == (4, "@rank_zero_experiment")
    assert branches[7] == (6, "if fabric.global_rank == 0")


def test_single_tensor_collectives_imported_by_name_are_collectives() -> None:
    source = (
        "from torch.distributed import all_gather_single, reduce_scatter_single as rss\n"
        "if rank == 0:\n    all_gather_single(out, t)\n    rss(out, t)\n"
    )
    assert [(f.line, f.code, f.call) for f in lint_source(source, "t.py")] == [
        (3, "DTW001", "all_gather_single()"), (4, "DTW001", "rss()")]


def test_every_op_the_recorder_wraps_is_a_collective_for_the_lint() -> None:
    """One table: what dtwatch records at runtime, the lint finds statically, p2p ops as p2p."""
    assert set(OP_KINDS) <= set(COLLECTIVES)
    assert {name for name in OP_KINDS if COLLECTIVES[name].p2p} == P2P_NAMES
    source = "def f():\n    if rank == 0:\n        return\n    dist.reduce_scatter_single(out, t)\n"
    [finding] = lint_source(source, "t.py")
    assert (finding.code, finding.line, finding.call) == ("DTW002", 3, "return")


def test_derived_name_is_local_to_its_function() -> None:
    source = (
        "ok = rank == 0\n"
        "def f():\n    ok = load()\n    if ok:\n        dist.barrier()\n"
        "def g():\n    if ok:\n        dist.barrier()\n"
    )
    assert [(f.line, f.condition) for f in lint_source(source, "t.py")] == [(8, "if ok")]


# --- suppression -------------------------------------------------------------------------------

def test_suppression_comments_hide_only_their_line() -> None:
    path = FIXTURES / "suppressed.py"
    source = path.read_text()
    assert [f.line for f in lint_source(source, str(path))] == [line_of(path, "E501")]
    stripped = re.sub(r"#.*", "", source)  # the same code without comments: all four are reported
    assert len(lint_source(stripped, str(path))) == 4


def test_noqa_for_another_code_does_not_hide_dtw002() -> None:
    source = "def f():\n    if rank == 0:\n        return  # noqa: DTW001\n    dist.barrier()\n"
    assert [f.code for f in lint_source(source, "t.py")] == ["DTW002"]
    assert lint_source(source.replace("DTW001", "DTW002"), "t.py") == []


# --- files and directories -------------------------------------------------------------------

def test_lint_paths_recurses_and_reports_unparsable_files(tmp_path: Path) -> None:
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "sub" / "train.py").write_text("if rank == 0:\n    dist.barrier()\n")
    (tmp_path / "pkg" / "broken.py").write_text("def f(:\n")
    (tmp_path / "pkg" / "latin1.py").write_bytes(b"x = '\xe9'\n")  # not UTF-8, no coding cookie
    (tmp_path / "pkg" / "notes.txt").write_text("if rank == 0: dist.barrier()\n")
    (tmp_path / "pkg" / ".venv").mkdir()
    (tmp_path / "pkg" / ".venv" / "skipped.py").write_text("if rank == 0:\n    dist.barrier()\n")

    findings = lint_paths([tmp_path / "pkg"])
    by_file = {Path(f.path).name: f for f in findings}
    assert sorted(by_file) == ["broken.py", "latin1.py", "train.py"]
    assert by_file["train.py"].code == "DTW001"
    assert by_file["broken.py"].code == "DTW000" and by_file["broken.py"].line == 1
    assert by_file["broken.py"].message.startswith("could not parse")
    assert by_file["latin1.py"].code == "DTW000"


def test_lint_paths_checks_a_named_file_once_and_rejects_missing_paths(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("if rank == 0:\n    dist.barrier()\n")
    assert len(lint_paths([script, tmp_path, str(script)])) == 1
    with pytest.raises(FileNotFoundError):
        lint_paths([tmp_path / "missing.py"])


def test_lint_source_reports_syntax_errors_instead_of_raising() -> None:
    [finding] = lint_source("x = 1\nif rank == 0\n", "bad.py")
    assert (finding.code, finding.path, finding.line) == ("DTW000", "bad.py", 2)


def test_long_generated_expressions_do_not_hit_the_recursion_limit() -> None:
    chain = " + ".join(["x"] * 1500)  # "x + x + ...": nested 1500 deep, fine for ast.parse
    source = f"total = {chain}\nif rank == 0:\n    total = {chain} + dist.all_reduce(t)\n"
    assert [(f.line, f.code) for f in lint_source(source, "generated.py")] == [(3, "DTW001")]


def test_module_docstring_example_runs() -> None:
    result = doctest.testmod(dtwatch.lint.checker)
    assert result.attempted >= 1 and result.failed == 0


# --- is_rank_conditional_line -----------------------------------------------------------------

def test_is_rank_conditional_line_on_fixtures() -> None:
    basic = FIXTURES / "basic.py"
    assert is_rank_conditional_line(basic, line_of(basic, "torch.save("))
    assert is_rank_conditional_line(basic, line_of(basic, 'print("saved"'))
    assert not is_rank_conditional_line(basic, line_of(basic, "outside any branch"))
    assert not is_rank_conditional_line(basic, line_of(basic, "torch.save(") - 1)  # the if line itself
    assert not is_rank_conditional_line(basic, line_of(basic, "only defined here"))  # nested def body

    else_branch = FIXTURES / "else_branch.py"
    assert is_rank_conditional_line(else_branch, line_of(else_branch, "dist.all_reduce(tensor)  #"))
    rank_zero = FIXTURES / "rank_zero_only.py"
    assert is_rank_conditional_line(rank_zero, line_of(rank_zero, "print(metrics)"))
    assert not is_rank_conditional_line(rank_zero, line_of(rank_zero, "return metrics"))


def test_is_rank_conditional_line_in_expressions_loops_and_balanced_branches() -> None:
    expressions = FIXTURES / "expressions.py"
    assert is_rank_conditional_line(expressions, line_of(expressions, "out = dist.all_reduce(t) if rank == 0"))
    assert is_rank_conditional_line(expressions, line_of(expressions, "world -= 1"))
    assert not is_rank_conditional_line(expressions, line_of(expressions, "return out, callback"))
    balanced = FIXTURES / "balanced.py"  # not reported, but still code that only some ranks run
    assert is_rank_conditional_line(balanced, line_of(balanced, "dist.scatter(t, None, src=src)"))


def test_is_rank_conditional_line_for_missing_or_broken_files(tmp_path: Path) -> None:
    assert not is_rank_conditional_line(tmp_path / "missing.py", 1)
    assert not is_rank_conditional_line("<string>", 1)
    broken = tmp_path / "broken.py"
    broken.write_text("if rank == 0:\n    dist.barrier(\n")
    assert not is_rank_conditional_line(broken, 2)


def test_is_rank_conditional_line_sees_a_file_change(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("if rank == 0:\n    dist.barrier()\n")
    assert is_rank_conditional_line(script, 2)
    script.write_text("if ready:\n    dist.barrier()\n")
    os.utime(script, ns=(0, 10**9))  # a different mtime even on coarse clocks
    assert not is_rank_conditional_line(script, 2)


# --- the CLI, as a real subprocess --------------------------------------------------------------

def test_cli_exit_0_on_clean_code() -> None:
    result = run_cli(str(FIXTURES / "clean_train.py"), str(FIXTURES / "not_rank.py"))
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    assert "no rank-conditional collectives found, 2 files checked" in result.stderr


def test_cli_exit_1_prints_flake8_style_lines() -> None:
    path = FIXTURES / "basic.py"
    result = run_cli(str(path))
    assert result.returncode == 1
    [line] = result.stdout.splitlines()
    barrier_line = line_of(path, "# expect: DTW001")
    assert line.startswith(f"{path}:{barrier_line}:9: DTW001 dist.barrier() inside rank-conditional branch")
    assert "1 finding in 1 of 1 file checked" in result.stderr


def test_cli_exit_2_on_usage_errors(tmp_path: Path) -> None:
    missing = run_cli(str(tmp_path / "missing.py"))
    assert missing.returncode == 2 and "no such file or directory" in missing.stderr
    bad_code = run_cli("--select", "E501", str(FIXTURES))
    assert bad_code.returncode == 2 and "unknown code E501" in bad_code.stderr
    no_paths = run_cli()
    assert no_paths.returncode == 2 and "PATH" in no_paths.stderr


def test_cli_reports_unparsable_files_and_keeps_going(tmp_path: Path) -> None:
    (tmp_path / "broken.py").write_text("def f(:\n")
    (tmp_path / "train.py").write_text("if dist.get_rank() == 0:\n    dist.barrier()\n")
    result = run_cli(str(tmp_path))
    assert result.returncode == 1
    assert [line.split(": ")[1][:6] for line in result.stdout.splitlines()] == ["DTW000", "DTW001"]
    assert "2 findings in 2 of 2 files checked" in result.stderr


def test_cli_json_shape() -> None:
    result = run_cli("--json", str(FIXTURES))
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert set(report) == {"findings", "files_checked"}
    assert report["files_checked"] == len(FIXTURE_FILES)
    assert set(report["findings"][0]) == {"path", "line", "col", "code", "call", "condition", "message"}
    codes = {f["code"] for f in report["findings"]}
    assert codes == {"DTW001", "DTW002"}  # DTW003 only when selected
    expected = sum(
        1 for path in FIXTURE_FILES for _, code in expected_findings(path) if code != "DTW003"
    )
    assert len(report["findings"]) == expected


def test_cli_select_and_ignore() -> None:
    p2p = str(FIXTURES / "p2p.py")
    assert run_cli(p2p).returncode == 0
    selected = run_cli("--select", "DTW003", "--json", p2p)
    assert selected.returncode == 1
    assert [f["code"] for f in json.loads(selected.stdout)["findings"]] == ["DTW003", "DTW003"]
    ignored = run_cli("--ignore", "DTW001,DTW002", str(FIXTURES / "early_exit.py"), str(FIXTURES / "basic.py"))
    assert ignored.returncode == 0 and ignored.stdout == ""
    only_exits = run_cli("--select", "DTW002", "--json", str(FIXTURES))
    assert {f["code"] for f in json.loads(only_exits.stdout)["findings"]} == {"DTW002"}


def test_cli_help_describes_the_check() -> None:
    result = run_cli("--help")
    assert result.returncode == 0
    assert "rank-conditional" in result.stdout and "DTW002" in result.stdout and "exit status" in result.stdout


def test_add_lint_parser_registers_a_lint_verb(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="dtwatch")
    add_lint_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["lint", "--json", str(FIXTURES / "rank_zero_only.py")])
    assert args.func(args) == 1
    report = json.loads(capsys.readouterr().out)
    assert [f["condition"] for f in report["findings"]] == ["@rank_zero_only", "@accelerator.on_main_process"]
    assert all(isinstance(LintFinding(**f), LintFinding) for f in report["findings"])


def test_collectives_after_a_rank_conditional_return_run_under_that_test() -> None:
    # The DDP tutorial's snapshot with an early return for ranks != 0: its barrier is reached by rank 0 only.
    source = (
        "import torch.distributed as dist\n"
        "def save(model, rank):\n"
        "    if rank != 0:\n"
        "        return\n"
        "    dist.barrier()\n"
        "def train(rank):\n"
        "    for step in range(3):\n"
        "        if rank == 1 and step == 2:\n"
        "            continue\n"
        "        dist.all_reduce(x)\n"
    )
    branches = dtwatch.lint.checker.rank_branches(source, "t.py")
    assert branches[5] == (3, "if rank != 0: return")
    assert 10 not in branches  # a rank that skips one iteration still reaches the call in the others


# --- rank tests inherited from the callers of a same-file function ------------------------------

HELPER = (
    "import torch\n"                                       # 1
    "import torch.distributed as dist\n"                   # 2
    "def save(model, step):\n"                             # 3
    "    torch.save(model.state_dict(), f'ckpt-{step}.pt')\n"  # 4
    "    dist.barrier()\n"                                 # 5
    "def train(rank):\n"                                   # 6
    "    for step in range(10):\n"                         # 7
    "        dist.all_reduce(g)\n"                         # 8
    "        if rank == 0:\n"                              # 9
    "            save(model, step)\n"                      # 10
    "        dist.barrier()\n"                             # 11
)


def test_a_helper_called_only_under_a_rank_test_runs_under_it() -> None:
    branches = dtwatch.lint.checker.rank_branches(HELPER, "t.py")
    assert branches[5] == (9, "if rank == 0 (calls save() at line 10)")
    assert branches[4] == (9, "if rank == 0 (calls save() at line 10)")
    assert branches[10] == (9, "if rank == 0")
    assert 3 not in branches and 8 not in branches and 11 not in branches


def test_the_brief_example_maps_the_helper_barrier_to_the_callers_test() -> None:
    source = (
        "def save(model, step):\n"
        "    torch.save(model.state_dict(), f\"ckpt-{step}.pt\")\n"
        "    dist.barrier()\n"
        "\n"
        "def train(rank):\n"
        "    for step in range(10):\n"
        "        dist.all_reduce(g)\n"
        "        if rank == 0:\n"
        "            save(model, step)\n"
        "        dist.barrier()\n"
    )
    assert dtwatch.lint.checker.rank_branches(source, "t.py")[3] == (8, "if rank == 0 (calls save() at line 9)")


def test_a_helper_also_called_on_every_rank_inherits_nothing() -> None:
    assert 5 not in dtwatch.lint.checker.rank_branches(HELPER + "    save(model, 10)\n", "t.py")
    # never called, or used as a value: nothing is guessed
    unused = HELPER.replace("            save(model, step)\n", "            print(step)\n")
    assert 5 not in dtwatch.lint.checker.rank_branches(unused, "t.py")
    passed = HELPER + "    callbacks = [save]\n"
    assert 5 not in dtwatch.lint.checker.rank_branches(passed, "t.py")
    deferred = HELPER + "    if rank == 0:\n        hook = lambda: save(model, 0)\n"
    assert 5 not in dtwatch.lint.checker.rank_branches(deferred, "t.py")


def test_a_helper_called_on_both_sides_of_one_test_runs_on_every_rank() -> None:
    source = HELPER + "        else:\n            save(model, -1)\n"
    assert 5 not in dtwatch.lint.checker.rank_branches(source, "t.py")


def test_a_helper_called_from_several_rank_tests_names_the_first() -> None:
    source = HELPER + "    if dist.get_rank() == 0:\n        save(model, 10)\n"
    assert dtwatch.lint.checker.rank_branches(source, "t.py")[5] == (9, "if rank == 0 (calls save() at line 10)")


def test_a_method_called_only_under_a_rank_test_runs_under_it() -> None:
    source = (
        "import torch\n"                                   # 1
        "import torch.distributed as dist\n"               # 2
        "class Trainer:\n"                                 # 3
        "    def save(self, path):\n"                      # 4
        "        torch.save(self.model.state_dict(), path)\n"  # 5
        "        dist.barrier()\n"                         # 6
        "    def fit(self):\n"                             # 7
        "        for step in range(10):\n"                 # 8
        "            if self.rank == 0:\n"                 # 9
        "                self.save('ckpt.pt')\n"           # 10
        "            dist.barrier()\n"                     # 11
    )
    branches = dtwatch.lint.checker.rank_branches(source, "t.py")
    assert branches[6] == (9, "if self.rank == 0 (calls self.save() at line 10)")
    assert 11 not in branches
    # the same name called on an object of unknown class may run this method anywhere: nothing is guessed
    assert 6 not in dtwatch.lint.checker.rank_branches(source + "trainer.save('x')\n", "t.py")


def test_a_chain_of_helpers_inherits_the_test_and_keeps_its_own_tests() -> None:
    source = (
        "import torch.distributed as dist\n"               # 1
        "def write(state):\n"                              # 2
        "    dist.barrier()\n"                             # 3
        "def save(model, rank):\n"                         # 4
        "    state = model.state_dict()\n"                 # 5
        "    if rank == 0:\n"                              # 6
        "        print('own test')\n"                      # 7
        "    write(state)\n"                               # 8
        "def train(rank):\n"                               # 9
        "    if rank == 0:\n"                              # 10
        "        save(model, rank)\n"                      # 11
    )
    branches = dtwatch.lint.checker.rank_branches(source, "t.py")
    assert branches[8] == (10, "if rank == 0 (calls save() at line 11)")
    assert branches[3] == (10, "if rank == 0 (calls save() at line 11, which calls write() at line 8)")
    assert branches[7] == (6, "if rank == 0")  # its own, innermost test


def test_a_chain_is_followed_a_bounded_number_of_steps() -> None:
    helpers = "".join(f"def f{i}():\n    f{i + 1}()\n" for i in range(8))
    source = "import torch.distributed as dist\n" + helpers + "def f8():\n    dist.barrier()\nif rank == 0:\n    f0()\n"
    branches = dtwatch.lint.checker.rank_branches(source, "t.py")
    assert 3 in branches  # f0's body
    assert 19 not in branches  # f8's body: deeper than followed


def test_a_recursive_helper_inherits_without_looping() -> None:
    source = (
        "import torch.distributed as dist\n"               # 1
        "def walk(node):\n"                                # 2
        "    dist.barrier()\n"                             # 3
        "    for child in node.children:\n"                # 4
        "        walk(child)\n"                            # 5
        "def ping(n):\n"                                   # 6
        "    pong(n - 1)\n"                                # 7
        "def pong(n):\n"                                   # 8
        "    ping(n - 1)\n"                                # 9
        "if rank == 0:\n"                                  # 10
        "    walk(tree)\n"                                 # 11
        "    ping(3)\n"                                    # 12
    )
    branches = dtwatch.lint.checker.rank_branches(source, "t.py")
    assert branches[3] == (10, "if rank == 0 (calls walk() at line 11)")
    assert branches[5] == (10, "if rank == 0 (calls walk() at line 11)")
    assert 7 not in branches and 9 not in branches  # ping is also called from pong: not only under the test


def test_a_return_gated_collective_in_a_helper_keeps_its_exit() -> None:
    source = (
        "import torch.distributed as dist\n"               # 1
        "def save(model, rank):\n"                         # 2
        "    if rank != 0:\n"                              # 3
        "        return\n"                                 # 4
        "    dist.barrier()\n"                             # 5
        "def train(rank):\n"                               # 6
        "    if step % 10 == 0 and rank == 0:\n"           # 7
        "        save(model, rank)\n"                      # 8
    )
    branches = dtwatch.lint.checker.rank_branches(source, "t.py")
    assert branches[5] == (3, "if rank != 0: return")
    assert branches[4] == (3, "if rank != 0")
    assert branches[3] == (7, "if step % 10 == 0 and rank == 0 (calls save() at line 8)")


def test_inherited_tests_do_not_change_the_findings() -> None:
    """Inheriting is for rank_branches only: the findings and is_rank_conditional_line stay as they were."""
    for path in FIXTURE_FILES:
        assert {(f.line, f.code) for f in lint_file(path)} == expected_findings(path)
        source = path.read_text()
        branches = dtwatch.lint.checker.rank_branches(source, path.name)
        assert set(branches) >= {n for n in range(1, len(source.splitlines()) + 1) if is_rank_conditional_line(path, n)}
    # the call of save() under the test is reported (it runs a barrier), its body is not
    assert [(f.line, f.code, f.call) for f in lint_source(HELPER, "t.py")] == [(10, "DTW001", "save()")]
    assert not is_rank_conditional_line_of_source(HELPER, 5)


def is_rank_conditional_line_of_source(source: str, line: int) -> bool:
    checker = ModuleChecker(source, "t.py", ast.parse(source)).run()
    return line in checker.conditional_lines


def test_a_rank_conditional_return_gates_only_what_follows_it() -> None:
    # The lines after the return in the same block (and after its enclosing statements) run only on the ranks
    # that did not return; another arm of an enclosing if, and the loop body before the return, do not.
    source = (
        "import torch.distributed as dist\n"
        "def main(rank, scenario):\n"
        "    if scenario == 'a':\n"
        "        for step in range(5):\n"
        "            dist.all_reduce(x)\n"
        "            if rank == 1 and step == 3:\n"
        "                return\n"
        "            dist.barrier()\n"
        "    elif scenario == 'b':\n"
        "        dist.all_reduce(y)\n"
    )
    branches = dtwatch.lint.checker.rank_branches(source, "t.py")
    assert branches[8] == (6, "if rank == 1 and step == 3: return")
    assert 5 not in branches and 10 not in branches
