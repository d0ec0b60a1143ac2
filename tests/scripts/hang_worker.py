"""A training worker that hangs (or not) in a chosen way. Used by tests/test_watchdog.py and benchmarks.

    python hang_worker.py SCENARIO    (under torchrun, or with RANK/WORLD_SIZE/MASTER_* set)

``HANG_BACKEND`` picks the backend: ``gloo`` (default) or ``gloo_async`` (dtwatch.testing: NCCL's
execution model, where collectives return before they complete). ``sync_device()`` stands where a GPU
job synchronises (``loss.item()``, ``torch.cuda.synchronize()``); on gloo it does nothing.

Before the hang it writes ``<DTWATCH_DIR>/<job>/onset-rank<R>.txt`` with the time it starts hanging.
Lines that tests assert on carry a ``# site:<name>`` marker.
"""
import atexit
import datetime
import os
import signal
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, TensorDataset

import dtwatch
import dtwatch.auto

SCENARIO = sys.argv[1]
HANG_STEP = 4
used_fsdp = False
BACKEND = os.environ.get("HANG_BACKEND", "gloo")
if BACKEND == "gloo_async":
    import dtwatch.testing

    sync_device = dtwatch.testing.synchronize
else:
    def sync_device() -> None:
        pass


def mark_onset(rank: int | None = None) -> None:
    rank = dist.get_rank() if rank is None else rank
    path = os.path.join(os.environ["DTWATCH_DIR"], os.environ["DTWATCH_JOB_ID"], f"onset-rank{rank}.txt")
    with open(path, "w") as f:
        f.write(repr(time.time()))


class SamplesThatHang(Dataset):
    """Sample ``hang_at`` never arrives (a worker blocked on storage); -1: every sample arrives."""

    def __init__(self, rank: int, hang_at: int) -> None:
        self.rank, self.hang_at = rank, hang_at

    def __len__(self) -> int:
        return 20 * 8

    def __getitem__(self, i: int):
        if i == self.hang_at:
            mark_onset(self.rank)
            time.sleep(3600)  # site:worker_sleep
        return torch.randn(16) + self.rank  # each rank reads its own samples


def wrapper_library():
    """A third-party logging library (a module under a site-packages directory) that all-reduces a metric."""
    import importlib.util

    path = os.path.join(os.environ["DTWATCH_DIR"], "site-packages", "metricslib", "__init__.py")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    # Every rank writes it: each to its own file, renamed into place, so no rank ever reads a half-written one.
    partial = f"{path}.{os.getpid()}"
    with open(partial, "w") as f:
        f.write("import torch.distributed as dist\n\n\ndef log_metric(x):\n    dist.all_reduce(x)\n")
    os.replace(partial, path)
    spec = importlib.util.spec_from_file_location("metricslib", path)
    lib = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lib)
    return lib


def model_and_opt():
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def fsdp_model_and_opt():
    from torch.distributed.fsdp import fully_shard

    global used_fsdp
    used_fsdp = True

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def train_step(model, opt, batch):
    loss = model(batch).pow(2).mean()
    opt.zero_grad()
    loss.backward()  # site:backward
    opt.step()


def validate(model) -> float:
    loss = model.module(torch.randn(8, 16)).pow(2).mean().detach()
    dist.all_reduce(loss)  # site:validate_all_reduce
    loss /= dist.get_world_size()
    loss = loss.clamp(min=0.0)
    sync_device()  # site:validate_sync
    return loss.item()


def load_batch(step: int, rank: int):
    if rank == 1 and step == HANG_STEP:
        mark_onset()
        time.sleep(3600)  # site:stuck_sleep
    return torch.randn(8, 16)


def init_process_group() -> None:
    if SCENARIO != "crash_once":
        dist.init_process_group(BACKEND)
        return
    # torchrun --max-restarts keeps its store across attempts, and the restarted ranks' gloo set-up can
    # read the previous attempt's keys (a dead rank's address) and retry connecting to it for minutes
    # (plain torch 2.13, no dtwatch involved). Each attempt gets keys of its own, as restartable jobs do.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=120))
    dist.init_process_group(BACKEND, store=dist.PrefixStore(f"attempt-{attempt}", store),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))


def main() -> None:
    init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.ones(4)

    if SCENARIO == "rank_conditional":
        model, opt = model_and_opt()
        for step in range(1, 20):
            train_step(model, opt, torch.randn(8, 16))
            if step == HANG_STEP:
                if rank == 0:  # site:rank_branch
                    mark_onset()
                    validate(model)  # site:conditional_call
                dist.barrier()  # site:barrier_after

    elif SCENARIO == "subgroup_skip":
        pair = dist.new_group([0, 1])
        for step in range(1, 20):
            dist.all_reduce(t)  # site:world_all_reduce
            if step == HANG_STEP:
                mark_onset()
                if rank == 0:
                    dist.all_reduce(t, group=pair)  # site:subgroup_all_reduce
                dist.barrier()  # site:subgroup_barrier
            sync_device()

    elif SCENARIO == "uneven_ddp":
        # A per-rank data filter leaves rank 1 with fewer batches: it leaves the loop first and waits at
        # the post-loop barrier while the others wait in DDP's gradient all_reduce (issued from C++).
        model, opt = model_and_opt()
        n = 8 * 8 if rank != 1 else 6 * 8
        loader = DataLoader(TensorDataset(torch.randn(n, 16) + rank), batch_size=8)  # site:loader
        for (batch,) in loader:  # site:loader_loop
            time.sleep(0.3)
            train_step(model, opt, batch)
        mark_onset()
        dist.barrier()  # site:post_loop_barrier

    elif SCENARIO == "stuck_outside":
        model, opt = model_and_opt()
        for step in range(1, 20):
            train_step(model, opt, load_batch(step, rank))
            if rank != 1 and step == HANG_STEP:
                mark_onset()

    elif SCENARIO in ("exception", "killed", "returned"):
        for step in range(1, 20):
            dist.all_reduce(t)  # site:exit_all_reduce
            sync_device()
            if step == HANG_STEP and rank == 1:  # site:exit_branch
                mark_onset()
                if SCENARIO == "exception":
                    raise ValueError("loss is NaN on rank 1")  # site:raise
                if SCENARIO == "killed":
                    os.kill(os.getpid(), signal.SIGKILL)
                return  # site:return_early

    elif SCENARIO == "stuck_in_loader":
        # Rank 1 waits for a batch its DataLoader worker never delivers; rank 0 waits in the next
        # all_reduce. Rank 1 has started worker processes and a helper process in a session of its own
        # (like a tokenizer service): --fail-fast must end all of them.
        if rank == 1:
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
        loader = DataLoader(SamplesThatHang(rank, (HANG_STEP - 1) * 8 if rank == 1 else -1), batch_size=8,
                            num_workers=2)
        for step, batch in enumerate(loader, 1):  # site:loader_next
            dist.all_reduce(batch.sum())  # site:loader_all_reduce
            sync_device()
            if step == HANG_STEP - 1 and rank == 0:
                mark_onset()

    elif SCENARIO == "mismatch":
        # The ranks read different configs: rank 1 believes this is a barrier-only sync step.
        barrier_only = rank == 1
        for step in range(1, 20):
            if step == HANG_STEP:
                mark_onset()
            dist.barrier() if barrier_only and step >= HANG_STEP else dist.all_reduce(t)  # site:mismatch_line
            sync_device()

    elif SCENARIO == "sigstop":
        for step in range(1, 20):
            dist.all_reduce(t)  # site:stop_all_reduce
            sync_device()
            if step == HANG_STEP and rank == 1:
                mark_onset()
                os.kill(os.getpid(), signal.SIGSTOP)

    elif SCENARIO == "healthy_quiet":
        # Eval/checkpoint on every rank with no collectives for longer than the stall window.
        model, opt = model_and_opt()
        for _epoch in range(2):
            for _ in range(5):
                train_step(model, opt, torch.randn(8, 16))
            time.sleep(float(os.environ.get("QUIET_SECONDS", "6")))  # site:quiet_gap
        dist.barrier()

    elif SCENARIO == "healthy_fsdp":
        # FSDP2 (all-gathers and reduce-scatters issued from its hooks), a logged metric per step, and a
        # quiet gap on every rank longer than the stall window.
        model, opt = fsdp_model_and_opt()
        for step in range(1, 31):
            loss = model(torch.randn(8, 16)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            metric = loss.detach().clone()
            dist.all_reduce(metric)
            sync_device()
            time.sleep(0.1)
            if step == 15:
                time.sleep(float(os.environ.get("QUIET_SECONDS", "6")))
        dist.barrier()

    elif SCENARIO in ("extra_call", "extra_call_helper", "extra_call_library"):
        # Partway through, rank 1 issues one all_reduce the others do not (a metric it alone logs). It
        # pairs with the others' next all_reduce of the same shape: nothing hangs, results are mixed from
        # then on. At the end rank 1 is one call ahead and waits alone.
        def log_metric(x):
            dist.all_reduce(x)  # site:helper_all_reduce

        if SCENARIO == "extra_call_library":
            lib = wrapper_library()

        for step in range(1, 25):
            dist.all_reduce(t)  # site:loop_all_reduce
            sync_device()
            if rank == 1 and step == 6:
                mark_onset()
                if SCENARIO == "extra_call":
                    dist.all_reduce(t)  # site:extra_all_reduce
                elif SCENARIO == "extra_call_library":
                    lib.log_metric(t)  # site:extra_library_call
                else:
                    log_metric(t)  # site:extra_helper_call
                sync_device()
            dtwatch.step()
            time.sleep(0.2)
        dist.barrier()

    elif SCENARIO == "extra_call_ddp":
        # DDP training; at step 6 rank 1 alone all-reduces a tensor the size of DDP's gradient bucket. It
        # pairs with the others' next gradient all-reduce (issued from C++): gradients mix silently.
        model, opt = model_and_opt()
        bucket = sum(p.numel() for p in model.parameters())
        for step in range(1, 25):
            train_step(model, opt, torch.randn(8, 16))
            if rank == 1 and step == 6:
                mark_onset()
                dist.all_reduce(torch.zeros(bucket))  # site:extra_bucket_all_reduce
            sync_device()
            time.sleep(0.2)
        dist.barrier()

    elif SCENARIO == "join_uneven":
        # Legitimately asymmetric: uneven inputs under torch's Join. Rank 1 runs out of batches first; its
        # join hook shadows the others' collectives with its own until they finish too. Healthy.
        from torch.distributed.algorithms.join import Join

        model, opt = model_and_opt()
        batches = 12 if rank != 1 else 7
        with Join([model]):
            for _ in range(batches):
                train_step(model, opt, torch.randn(8, 16))
                sync_device()
                time.sleep(0.1)
        dist.barrier()

    elif SCENARIO == "slow_input":
        # Every step, the last rank's input pipeline takes STRAGGLER_LAG seconds longer (TURNS=1: the slow
        # rank changes every step). Training is DDP (gradient all-reduces issued from C++) or FSDP2
        # (MODEL=fsdp: all-gathers and reduce-scatters issued from Python, inside FSDP).
        lag = float(os.environ.get("STRAGGLER_LAG", "0.2"))
        turns = os.environ.get("TURNS") == "1"
        model, opt = fsdp_model_and_opt() if os.environ.get("MODEL") == "fsdp" else model_and_opt()
        for step in range(int(os.environ.get("STEPS", "60"))):
            time.sleep(0.2)  # everyone's input pipeline
            slow = (step % world) if turns else world - 1
            if rank == slow:
                time.sleep(lag)  # site:slow_input
            train_step(model, opt, torch.randn(8, 16))
            sync_device()

    elif SCENARIO == "crash_once":
        # First attempt: rank 1 crashes at step HANG_STEP. torchrun --max-restarts restarts the job, which
        # then finishes.
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        for step in range(1, 12):
            dist.all_reduce(t)
            sync_device()
            dtwatch.step()
            time.sleep(0.05)
            if attempt == 0 and rank == 1 and step == HANG_STEP:
                mark_onset()
                raise RuntimeError("simulated crash on the first attempt")  # site:crash_once

    elif SCENARIO == "shape_mismatch":
        # gloo aborts on a size mismatch instead of hanging; dtwatch explains the crash.
        for step in range(1, 12):
            n = 8 if not (rank == 1 and step >= HANG_STEP) else 4
            if step == HANG_STEP:
                mark_onset()
            dist.all_reduce(torch.ones(n))  # site:shape_mismatch
            sync_device()
            time.sleep(0.05)

    elif SCENARIO == "straggler":
        for _step in range(60):
            if rank == world - 1:
                time.sleep(0.12)  # site:slow_rank
            dist.all_reduce(t)
            sync_device()
            dtwatch.step()

    elif SCENARIO == "dashboard_tour":
        # Every kind of series the dashboards show on CPU (tests/test_dashboards_live.py): DDP training
        # steps (C++-issued all_reduce), a Python-issued metric all_reduce per step that the last rank
        # enters late (straggler), DataLoader lengths that differ across ranks (rank 1 has fewer batches:
        # a warning as the epoch starts), then the uneven-iterations stall: rank 1 leaves the loop and
        # waits at the post-loop barrier while the others wait in DDP's gradient all_reduce.
        model, opt = model_and_opt()
        batches = 36 if rank != 1 else 31
        loader = DataLoader(TensorDataset(torch.randn(batches * 8, 16) + rank), batch_size=8)  # site:tour_loader
        metric = torch.zeros(1)
        for (batch,) in loader:
            time.sleep(0.15)
            train_step(model, opt, batch)
            if rank == world - 1:
                time.sleep(0.1)  # site:tour_slow_rank
            dist.all_reduce(metric)  # site:tour_metric
            sync_device()
        mark_onset()
        dist.barrier()  # site:tour_post_loop_barrier

    else:
        raise SystemExit(f"unknown scenario {SCENARIO}")
    dist.destroy_process_group()
    if used_fsdp:
        # FSDP2 keeps the group alive past destroy_process_group; a gloo worker thread that drops a work
        # item while the interpreter finalizes aborts the process (torch's teardown race, seen without
        # dtwatch too). Leave without finalizing, as tests/scripts/gloo_async_semantics.py does.
        atexit._run_exitfuncs()  # what a normal exit runs first (dtwatch records the rank's end)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
