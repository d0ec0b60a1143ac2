"""Every end-to-end scenario and what really happened in it (the truth the diagnosis is judged by).

Truth fields (``Scenario.truth()``):

* ``kind``: the finding kind a right diagnosis gives (``desync`` for an op-order swap or a data-dependent
  extra call, where the rank condition is not in the code);
* ``ranks``: the culprits: the ranks that deviated (called a collective the others did not, skipped one
  their peers issued, left the loop early, raised, stopped), never the ranks left waiting on them;
* ``op``: the collective at the point where the ranks diverged that the culprit called extra, skipped,
  or called differently; ``None`` when the culprit has none (it exited, hangs outside, is wedged);
* ``file``/``line``: the root-cause line in the user's script, the call or branch that made the ranks
  differ (never a library line); ``lines``: every line accepted as that (the call and its branch);
* ``present``/``absent``: phrases the finding's text must contain / no stall finding may contain;
* ``tags``: how the collectives are issued (python, cpp, subgroup, p2p, object, async, library).

Scripts mark lines with ``# site:<marker>`` comments; the truth names markers, resolved to line numbers
here, so editing a script never silently moves a truth.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent

KINDS = ("rank_conditional", "uneven_iterations", "stuck_outside_collective", "rank_exited", "mismatch",
         "unresponsive", "stalled_collective", "desync")
TAGS = ("python", "cpp", "subgroup", "p2p", "object", "async", "library", "crash")


def marker_line(script: Path, marker: str) -> int:
    for i, text in enumerate(script.read_text().splitlines(), 1):
        if re.search(rf"#\s*site:{re.escape(marker)}\b", text):
            return i
    raise KeyError(f"{script.name}: no '# site:{marker}'")


@dataclass(frozen=True)
class Scenario:
    name: str
    script: str
    args: tuple[str, ...]
    healthy: bool = False
    kind: str | None = None
    ranks: tuple[int, ...] = ()
    op: str | None = None
    line: str | None = None  # marker of the root-cause line
    also: tuple[str, ...] = ()  # markers of other lines accepted as the root cause (its branch)
    present: tuple[str, ...] = ()
    absent: tuple[str, ...] = ()
    kinds_ok: tuple[str, ...] = ()
    tags: tuple[str, ...] = ()
    nproc: int = 4
    timeout: float = 150.0
    env: dict = field(default_factory=dict)
    note: str = ""

    @property
    def path(self) -> Path:
        return HERE / self.script

    def truth(self) -> dict:
        rel = str(self.path.relative_to(REPO))
        if self.healthy:
            return {"healthy": True, "file": rel, "tags": list(self.tags), "note": self.note}
        line = marker_line(self.path, self.line)
        lines = sorted({line, *(marker_line(self.path, m) for m in self.also)})
        return {
            "healthy": False, "kind": self.kind, "kinds_ok": list(self.kinds_ok), "ranks": list(self.ranks),
            "op": self.op, "file": rel, "line": line, "marker": self.line, "lines": lines,
            "present": list(self.present), "absent": list(self.absent), "tags": list(self.tags), "note": self.note,
        }


def incident(name: str, script: str, *args: str, kind: str, ranks: tuple[int, ...], op: str | None, line: str,
             also: tuple[str, ...] = (), tags: tuple[str, ...] = (), **kw) -> Scenario:
    assert kind in KINDS and all(t in TAGS for t in tags), (kind, tags)
    return Scenario(name, script, args, kind=kind, ranks=tuple(ranks), op=op, line=line, also=also, tags=tags, **kw)


def healthy(name: str, script: str, *args: str, tags: tuple[str, ...] = (), **kw) -> Scenario:
    return Scenario(name, script, args, healthy=True, tags=tags, **kw)


RC, UN, SO, EX, MM, UR, DS, PT, LB, HC = (
    "rank_conditional.py", "uneven.py", "stuck_outside.py", "exited.py", "mismatch.py", "unresponsive.py",
    "desync.py", "patterns.py", "library.py", "healthy.py",
)
PO = "program_order.py"
ASYNC_BACKEND = {"SCENARIO_BACKEND": "gloo_async"}  # NCCL's execution model (dtwatch.testing)
NEVER = ("never called",)  # false for ranks that call it one step later, or in another order
NOT_OOM = ("OOM", "SIGKILL")  # a desync's crash is not a kill

SCENARIOS: tuple[Scenario, ...] = (
    # -- a collective only some ranks call ----------------------------------------------------------
    incident("rc_python", RC, "python", kind="rank_conditional", ranks=(0,), op="all_reduce",
             line="python_extra", also=("python_branch",), tags=("python",)),
    incident("rc_ddp_python_side", RC, "ddp_py", kind="rank_conditional", ranks=(0,), op="barrier",
             line="ddp_py_extra", also=("ddp_py_branch",), tags=("python", "cpp")),
    incident("rc_ddp_cpp_side", RC, "ddp_cpp", kind="rank_conditional", ranks=(0,), op="all_reduce",
             line="ddp_cpp_extra", also=("ddp_cpp_branch",), tags=("cpp",)),
    incident("rc_subgroup_member_skips", RC, "sub_skip", kind="rank_conditional", ranks=(2,), op="all_reduce",
             line="sub_skip_branch", also=("sub_skip_call",), tags=("subgroup",),
             note="ranks 0,1 wait in the subgroup all_reduce for member rank 2, which moved on to the world barrier"),
    incident("rc_subgroup_extra_call", RC, "sub_extra", kind="rank_conditional", ranks=(0,), op="all_reduce",
             line="sub_extra_call", also=("sub_extra_branch",), tags=("subgroup",)),
    incident("rc_p2p_send_skipped", RC, "p2p_skip", kind="rank_conditional", ranks=(0,), op="send",
             line="p2p_skip_branch", also=("p2p_send",), tags=("p2p",),
             note="rank 0 moved past the send rank 1 waits for (recv)"),
    incident("rc_object_gather", RC, "object", kind="rank_conditional", ranks=(0,), op="all_gather_object",
             line="obj_extra", also=("obj_branch",), tags=("object",)),
    incident("rc_object_broadcast_skipped", RC, "object_skip", kind="rank_conditional", ranks=(0,),
             op="broadcast_object_list", line="obj_skip_branch", also=("obj_skip_call",), tags=("object",),
             note="ranks 1-3 wait in broadcast_object_list from src 0; rank 0 skipped it"),
    incident("rc_async_wait", RC, "async", kind="rank_conditional", ranks=(0,), op="all_reduce",
             line="async_extra", also=("async_branch", "async_wait"), tags=("async",)),
    # -- uneven iterations --------------------------------------------------------------------------
    incident("uneven_python", UN, "python", kind="uneven_iterations", ranks=(2,), op="barrier",
             line="python_count", also=("python_loop",), absent=NEVER, tags=("python",)),
    incident("uneven_ddp_loader", UN, "ddp", kind="uneven_iterations", ranks=(1,), op="barrier",
             line="ddp_size", also=("ddp_loader", "ddp_loop"), absent=NEVER, tags=("cpp",)),
    incident("uneven_ddp_exit", UN, "ddp_exit", kind="uneven_iterations", ranks=(1,), op=None,
             line="ddp_size", also=("ddp_loader", "ddp_loop", "ddp_exit"), absent=NEVER, tags=("cpp",),
             note="the short rank's process ends normally after its loop; the others then fail on the closed connection"),
    incident("uneven_subgroup", UN, "subgroup", kind="uneven_iterations", ranks=(3,), op="barrier",
             line="sub_count", also=("sub_loop",), absent=NEVER, tags=("subgroup",)),
    incident("uneven_p2p", UN, "p2p", kind="uneven_iterations", ranks=(2,), op="barrier",
             line="p2p_count", also=("p2p_loop",), absent=NEVER, tags=("p2p",)),
    incident("uneven_object", UN, "object", kind="uneven_iterations", ranks=(1,), op="barrier",
             line="obj_count", also=("obj_loop",), absent=NEVER, tags=("object",)),
    incident("uneven_async", UN, "async", kind="uneven_iterations", ranks=(3,), op="barrier",
             line="async_count", also=("async_loop",), absent=NEVER, tags=("async",)),
    incident("uneven_fsdp2", UN, "fsdp2", kind="uneven_iterations", ranks=(0,), op="barrier",
             line="fsdp_steps", also=("fsdp_loop",), absent=NEVER, tags=("python", "library"),
             note="FSDP2 (fully_shard) on CPU/gloo: its all_gather/reduce_scatter are issued from torch's Python code"),
    incident("lib_early_stopping", LB, "early_stop", kind="uneven_iterations", ranks=(1,), op="barrier",
             line="es_break", also=("es_check",), absent=NEVER, tags=("cpp", "library"),
             note="rank 1 breaks out of the epoch loop on its local validation loss"),
    # -- a live rank outside any collective -----------------------------------------------------------
    incident("stuck_python", SO, "python", kind="stuck_outside_collective", ranks=(1,), op=None,
             line="read_blocks", also=("python_read",), tags=("python",)),
    incident("stuck_ddp", SO, "ddp", kind="stuck_outside_collective", ranks=(1,), op=None,
             line="read_blocks", also=("ddp_read",), tags=("cpp",)),
    incident("stuck_subgroup", SO, "subgroup", kind="stuck_outside_collective", ranks=(3,), op=None,
             line="sub_poll", also=("sub_poll_sleep",), tags=("subgroup",)),
    incident("stuck_p2p", SO, "p2p", kind="stuck_outside_collective", ranks=(0,), op=None,
             line="p2p_get", tags=("p2p",)),
    incident("stuck_object", SO, "object", kind="stuck_outside_collective", ranks=(2,), op=None,
             line="obj_relock", tags=("object",)),
    incident("stuck_async", SO, "async", kind="stuck_outside_collective", ranks=(1,), op=None,
             line="async_solver", also=("async_solve_call",), tags=("async",)),
    incident("stuck_rank0_checkpoint", SO, "ckpt", kind="stuck_outside_collective", ranks=(0,), op=None,
             line="ckpt_write", also=("ckpt_call",), tags=("cpp",)),
    # -- a rank ended -------------------------------------------------------------------------------
    incident("exit_exception", EX, "exception", kind="rank_exited", ranks=(1,), op=None, line="exc_raise",
             also=("exc_call",), present=("ValueError",), tags=("python",)),
    incident("exit_ddp_forward_raises", EX, "ddp_raise", kind="rank_exited", ranks=(2,), op=None,
             line="ddp_raise", also=("ddp_forward",), present=("RuntimeError",), tags=("cpp",)),
    incident("exit_keyerror", EX, "keyerror", kind="rank_exited", ranks=(3,), op=None, line="key_lookup",
             present=("KeyError",), tags=("python",)),
    incident("exit_returned_subgroup", EX, "returned", kind="rank_exited", ranks=(3,), op=None,
             line="ret_return", tags=("subgroup",)),
    incident("exit_sigkill_p2p", EX, "sigkill", kind="rank_exited", ranks=(1,), op=None, line="kill_kill",
             also=("kill_recv",), tags=("p2p",)),
    incident("exit_sys_exit_object", EX, "sys_exit", kind="rank_exited", ranks=(2,), op=None,
             line="sysexit_exit", tags=("object",)),
    incident("exit_os_exit_async", EX, "os_exit", kind="rank_exited", ranks=(0,), op=None, line="osexit_exit",
             tags=("async",)),
    incident("exit_segfault", EX, "segfault", kind="rank_exited", ranks=(1,), op=None, line="segv_crash",
             also=("segv_step",), tags=("python", "crash")),
    incident("exit_loader_worker_raises", EX, "worker", kind="rank_exited", ranks=(1,), op=None,
             line="worker_raise", also=("worker_loop",), present=("corrupt sample 33", "DataLoader worker"),
             absent=("Original Traceback",), tags=("python",)),
    incident("exit_ddp_unused_parameters", EX, "unused", kind="rank_exited", ranks=(1,), op=None,
             line="unused_forward", present=("did not receive grad for rank 1",), tags=("cpp",),
             note="rank 1's reducer never finishes step 3's buckets; DDP raises on its next forward"),
    incident("exit_runner_sys_exit_1", EX, "runner", kind="rank_exited", ranks=(2,), op=None,
             line="runner_raise", present=("status 1", "learning rate must be positive"),
             absent=("exited normally",), tags=("python",)),
    incident("exit_every_rank_at_start", EX, "startup", kind="rank_exited", ranks=(0, 1, 2, 3), op=None,
             line="startup_gather", present=("invalid output tensor list",), tags=("python", "crash")),
    # -- same collective, different op/shape/dtype --------------------------------------------------
    incident("mismatch_op", MM, "op", kind="mismatch", ranks=(1,), op="barrier", line="op_call",
             also=("op_config",), tags=("python",)),
    incident("mismatch_shape", MM, "shape", kind="mismatch", ranks=(1,), op="all_reduce", line="shape_call",
             also=("shape_size",), absent=NOT_OOM, tags=("python",),
             note="gloo either hangs or aborts a rank on the size mismatch, depending on timing"),
    incident("mismatch_dtype_subgroup", MM, "dtype", kind="mismatch", ranks=(3,), op="all_reduce",
             line="dtype_call", also=("dtype_choice",), absent=NOT_OOM, tags=("subgroup",)),
    incident("mismatch_object_list", MM, "object", kind="mismatch", ranks=(2,), op="broadcast_object_list",
             line="obj_call", also=("obj_extra_item",), absent=NOT_OOM, tags=("object",)),
    incident("mismatch_async_shape", MM, "async", kind="mismatch", ranks=(0,), op="all_reduce", line="async_call",
             also=("async_size",), absent=NOT_OOM, tags=("async",)),
    incident("mismatch_pair_undecided", MM, "pair", kind="mismatch", ranks=(2, 3), op="all_reduce", line="pair_call",
             present=("is not known",), tags=("subgroup",),
             note="one rank on each side of a 2-member group, nothing to tell which deviates: both are named"),
    incident("mismatch_pair_history", MM, "pair_was", kind="mismatch", ranks=(3,), op="all_reduce",
             line="pairwas_call", also=("pairwas_choice",), tags=("subgroup",),
             note="one rank on each side, but both called the line with float32 before: rank 3 deviates"),
    # -- alive but wedged -----------------------------------------------------------------------------
    incident("wedged_sigstop", UR, "sigstop", kind="unresponsive", ranks=(1,), op=None, line="stop",
             also=("stop_call",), tags=("python",)),
    incident("wedged_regex_ddp", UR, "regex_ddp", kind="unresponsive", ranks=(2,), op=None, line="regex",
             also=("regex_call",), tags=("cpp",)),
    incident("wedged_pydll_subgroup", UR, "pydll_sub", kind="unresponsive", ranks=(3,), op=None,
             line="pydll_call", tags=("subgroup",)),
    incident("wedged_sigstop_p2p", UR, "sigstop_p2p", kind="unresponsive", ranks=(0,), op=None, line="stop",
             also=("stop_p2p_call",), tags=("p2p",)),
    incident("wedged_regex_object", UR, "regex_obj", kind="unresponsive", ranks=(3,), op=None, line="regex",
             also=("regex_obj_call",), tags=("object",)),
    incident("wedged_sigstop_async", UR, "sigstop_async", kind="unresponsive", ranks=(2,), op=None, line="stop",
             also=("stop_async_call",), tags=("async",)),
    # -- every observed rank inside the same collective ---------------------------------------------
    incident("stalled_unobserved_peer", "stalled.py", "unobserved_peer", kind="stalled_collective", ranks=(),
             op="all_reduce", line="stalled_all_reduce", present=("rank 4",), tags=("python",),
             note="world size 5; rank 4 runs without dtwatch and stops taking part: ranks 0-3 all wait in the "
                  "same all_reduce, so the finding should say rank 4 is not observed"),
    # -- desynchronised program order -----------------------------------------------------------------
    incident("desync_order_swap", DS, "swap", kind="desync", ranks=(3,), op="broadcast", line="swap_order",
             also=("swap_broadcast",), absent=NEVER, tags=("python",),
             note="rank 3 broadcasts first and all_reduces second; the others the other way round"),
    incident("desync_data_dependent_extra", DS, "extra", kind="desync", ranks=(2,), op="all_reduce",
             line="extra_call", also=("extra_branch",), tags=("python",),
             note="the branch depends on a local loss, not on the rank"),
    incident("crash_after_desync_ddp", DS, "crash_ddp", kind="rank_conditional", ranks=(0,), op="all_reduce",
             line="crash_reduce", also=("crash_branch",), absent=NOT_OOM, tags=("cpp", "crash"),
             note="gloo aborts when rank 0's metric all_reduce meets the others' gradient all_reduce"),
    # -- patterns of real training code and libraries ------------------------------------------------
    incident("nanogpt_master_eval", PT, "master_eval", kind="rank_conditional", ranks=(0,), op="all_reduce",
             line="eval_call", also=("eval_branch", "eval_reduce"), absent=NOT_OOM, tags=("cpp",)),
    incident("ddp_validation_on_rank0", PT, "ddp_val", kind="rank_conditional", ranks=(0,), op="broadcast",
             line="val_forward", also=("val_branch",), absent=NOT_OOM, tags=("cpp",),
             note="without no_grad, DDP's forward broadcasts BatchNorm buffers (from C++) on rank 0 only"),
    incident("lib_fabric_save_rank0", LB, "fabric_save", kind="rank_conditional", ranks=(0,), op="barrier",
             line="fabric_save", also=("fabric_branch",), absent=NOT_OOM, tags=("library", "cpp")),
    incident("lib_accel_main_gather", LB, "accel_gather", kind="rank_conditional", ranks=(0,), op="all_gather",
             line="accel_gather", also=("accel_branch",), tags=("library",)),
    incident("lib_wait_for_everyone_in_main", LB, "wait_main", kind="rank_conditional", ranks=(0,), op="barrier",
             line="wait_call", also=("wait_branch",), tags=("library",)),
    # -- program order: an extra or missing call that pairs silently -------------------------------------
    incident("metric_extra", PO, "metric_extra", kind="rank_conditional", ranks=(0,), op="all_reduce",
             line="metric_extra", also=("metric_branch",), absent=NOT_OOM, tags=("python",),
             note="rank 0's metric all_reduce pairs with the others' next gradient all_reduce (same shape); every "
                  "later all_reduce pairs one call off, and rank 0's last one meets the others' final barrier"),
    incident("metric_extra_async", PO, "metric_extra", kind="rank_conditional", ranks=(0,), op="all_reduce",
             line="metric_extra", also=("metric_branch",), absent=NOT_OOM, tags=("python", "async"),
             env=ASYNC_BACKEND,
             note="gloo_async: every rank ends in the final barrier; rank 0's last all_reduce is still in flight"),
    incident("metric_extra_long", PO, "metric_extra_long", kind="rank_conditional", ranks=(0,), op="all_reduce",
             line="long_extra", also=("long_branch",), absent=NOT_OOM, tags=("python",),
             note="88 calls per rank: the rings keep the newest 64 of a group, so the extra call at seq 6 is gone "
                  "by the stall; the watchdog's live warning (kept in the fixture) names it"),
    incident("save_barrier", PO, "save_barrier", kind="rank_conditional", ranks=(0,), op="barrier",
             line="save_barrier", also=("save_call", "save_branch"), absent=NOT_OOM, tags=("python",),
             note="rank 0's barrier inside save() pairs with the others' end-of-epoch barrier; its own epoch barrier "
                  "then meets their first all_reduce of the next epoch, and gloo waits"),
    incident("save_barrier_async", PO, "save_barrier", kind="rank_conditional", ranks=(0,), op="barrier",
             line="save_barrier", also=("save_call", "save_branch"), absent=NOT_OOM, tags=("python", "async"),
             env=ASYNC_BACKEND,
             note="gloo_async: every rank waits in the same end-of-epoch barrier line, rank 0 one epoch behind "
                  "the others, whose all_reduces of the next epoch are in flight"),
    incident("async_extra", PO, "async_extra", kind="rank_conditional", ranks=(1,), op="all_reduce",
             line="async_extra", also=("async_branch", "async_wait"), absent=NOT_OOM, tags=("async", "crash"),
             note="the others leave after as many all_reduces as they issued and exit cleanly; rank 1 is left one "
                  "all_reduce over, and gloo fails it when their connections close"),
    incident("accum_window", PO, "accum_window", kind="rank_conditional", kinds_ok=("desync",), ranks=(3,),
             op="all_reduce", line="accum_window", also=("accum_no_sync",), absent=NOT_OOM, tags=("cpp",),
             note="rank 3 syncs 3 times an epoch, the others 4 (DDP's all-reduce, from C++): rank 3 waits in the "
                  "epoch barrier while the others wait in their 4th gradient all-reduce; op is the collective rank 3 "
                  "issued fewer of (its skipped gradient all-reduce)"),
    incident("accum_window_mirror", PO, "accum_window_mirror", kind="rank_conditional", kinds_ok=("desync",),
             ranks=(3,), op="all_reduce", line="accum_window", also=("accum_no_sync",), absent=NOT_OOM,
             tags=("cpp",),
             note="rank 3 syncs 4 times an epoch, the others 3: rank 3 waits in its 4th gradient all-reduce, the "
                  "others in the epoch barrier"),
    incident("pp_recv_recv", PO, "pp_recv_recv", kind="desync", kinds_ok=("rank_conditional",), ranks=(0, 1),
             op="recv", line="pp_warmup", also=("pp_recv_act", "pp_recv_grad"), present=("recv",),
             absent=("network", "transport"), tags=("p2p",),
             note="both ranks of the first pipeline run the other's warm-up count (symmetric): with 2 micro-batches "
                  "rank 1 (stage 0) waits in recv of a gradient from rank 0, rank 0 (stage 1) in recv of the next "
                  "activation from rank 1; ranks 2-3 wait in the loss all_reduce"),
    incident("skip_backward", PO, "skip_backward", kind="desync", kinds_ok=("rank_conditional",), ranks=(1,),
             op="all_reduce", line="skip_continue", also=("skip_guard",), absent=NOT_OOM, tags=("cpp",),
             note="the guard depends on rank 1's loss, not on the rank; rank 1 skips one gradient all-reduce (op), "
                  "the later ones pair one step off, and rank 1 ends in the final barrier while the others wait "
                  "in their last gradient all-reduce"),
    incident("accum_window_async", PO, "accum_window", kind="rank_conditional", kinds_ok=("desync",), ranks=(3,),
             op="all_reduce", line="accum_window", also=("accum_no_sync",), absent=NOT_OOM, tags=("cpp", "async"),
             env=ASYNC_BACKEND, note="accum_window on gloo_async (NCCL's model: DDP's all-reduces return early)"),
    incident("skip_backward_async", PO, "skip_backward", kind="desync", kinds_ok=("rank_conditional",), ranks=(1,),
             op="all_reduce", line="skip_continue", also=("skip_guard",), absent=NOT_OOM, tags=("cpp", "async"),
             env=ASYNC_BACKEND, note="skip_backward on gloo_async"),
    healthy("healthy_bcast_both_arms", PO, "bcast_both_arms", tags=("python",),
            note="the broadcast is issued from two lines, one per arm of `if rank == 0`; every rank calls it"),
    healthy("healthy_bcast_both_arms_async", PO, "bcast_both_arms", tags=("python", "async"), env=ASYNC_BACKEND),
    healthy("healthy_agreed_accum", PO, "agreed_accum", tags=("cpp",),
            note="DDP no_sync accumulation with the same window on every rank"),
    healthy("healthy_pp_1f1b_ok", PO, "pp_1f1b_ok", tags=("p2p",),
            note="the 1F1B schedule of pp_recv_recv with the warm-up count from the stage index"),
    healthy("healthy_metric_all_ranks", PO, "metric_all_ranks", tags=("python",),
            note="every rank all_reduces the metric; only rank 0 prints it"),
    incident("lib_log_rank0_sync", LB, "log_rank0", kind="rank_conditional", kinds_ok=("desync",), ranks=(0,),
             op="all_reduce", line="log_rank0", also=("log_branch", "log_fit"), present=("log_rank0", "likely cause"),
             tags=("library",),
             note="the metric's all_reduce is issued by the trainer at the end of the epoch (user line: the fit call); "
                  "the line that logged it only on rank 0 is on no stack, so the lint's finding is the lead"),
    # -- healthy controls -----------------------------------------------------------------------------
    healthy("healthy_join_uneven", HC, "join", tags=("cpp",)),
    healthy("healthy_eval_all_ranks", HC, "eval_all", tags=("python",)),
    healthy("healthy_short_rank0_checkpoint", HC, "short_ckpt", tags=("python",)),
    healthy("healthy_quiet_gap", HC, "quiet", tags=("cpp",)),
    healthy("healthy_turns_slow", HC, "turns_slow", tags=("python",)),
    healthy("healthy_async_long_compute", HC, "async_long", tags=("async",)),
    healthy("healthy_ddp_no_grad_validation_rank0", PT, "ddp_val_no_grad", tags=("cpp",),
            note="under no_grad the DDP wrapper's forward issues no collective, so validating on rank 0 only is fine"),
    # -- DataLoaders told apart, and only where their loop issues collectives ---------------------------
    healthy("healthy_trainer_two_loaders", "loaders.py", "trainer", tags=("cpp", "object"),
            note="one _run_epoch iterates a training loader (12 batches) and an evaluation loader (3 batches, no "
                 "collective), made at one line of a helper; rank 0 still evaluates while the others train"),
    healthy("healthy_eval_local_uneven", "loaders.py", "eval_local", tags=("object",),
            note="per-rank evaluation shards of 3 + rank batches under no_grad, no collective in the loop; every "
                 "rank then meets the same all_gather_object"),
    incident("uneven_eval_reduce", "loaders.py", "eval_reduce", kind="uneven_iterations", ranks=(1,),
             op="all_gather_object", line="reduce_count", also=("reduce_loader", "reduce_loop"), absent=NEVER,
             tags=("python", "object"),
             note="an all_reduce per evaluation batch; rank 1 has 4 batches, the others 6"),
)


def by_name() -> dict[str, Scenario]:
    return {s.name: s for s in SCENARIOS}
