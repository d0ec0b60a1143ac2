"""Program order: one rank calls a collective more or less often than its peers, and the extra (or missing)
call pairs silently with the peers' next one; the job only hangs or fails later. Healthy counter-cases too.

    python program_order.py VARIANT     (under torchrun, 4 ranks)

metric_extra      rank 0 all_reduces a logged metric (same shape as the gradient) inside ``if rank == 0``:
                  every later all_reduce pairs one call off; at the end rank 0's last all_reduce meets the
                  others' final barrier (after allenai/OLMo#453: only rank 0 reduced the global loss)
metric_extra_long the same extra metric all_reduce, in a loop of two all_reduces (gradients, buffers) that runs
                  long enough for the rings to lose the extra call before the job hangs: the warning the
                  watchdog gave while the job ran is what names it at the stall
save_barrier      ``save()`` ends in a barrier meant for every rank but is called under ``if rank == 0``: it
                  pairs with the others' end-of-epoch barrier, then rank 0's epoch barrier meets the others'
                  next all_reduce (after alan-turing-institute/autocast#386: save_checkpoint under is_global_zero)
async_extra       rank 1 starts one extra async all_reduce (and waits on it) inside ``if rank == 1``; the others
                  finish the loop and exit cleanly, rank 1 is left one all_reduce over (after NVIDIA/nccl#296:
                  one rank's op sequence runs a collective ahead)
accum_window      DDP gradient accumulation whose window depends on the rank: from epoch HANG_STEP rank 3
                  accumulates 4 micro-steps (3 syncs an epoch) and the others 3 (4 syncs); rank 3 reaches the
                  epoch barrier while the others are in their last gradient all-reduce (after
                  NVIDIA-NeMo/Automodel#2468: accumulation windows desync across ranks)
accum_window_mirror  the same, mirrored: rank 3 syncs 4 times an epoch, the others 3 times
pp_recv_recv      two 2-stage pipelines (ranks 0-1, 2-3; the head holds the last stage, on the even rank) with
                  a 1F1B schedule whose warm-up count comes from the global rank, not the stage index; once the
                  batch-size ramp-up gives 2 micro-batches (HANG_STEP), ranks 0 and 1 each wait in recv from the
                  other (after pytorch/torchtitan#775: a 1F1B warm-up deadlock)
skip_backward     DDP with a loss-spike guard: rank 1's batch at HANG_STEP is bad, it ``continue``s before
                  ``loss.backward()``, so every later gradient all-reduce pairs one step off and rank 1 ends one
                  all-reduce behind (after NVIDIA-NeMo/Automodel#2468: a per-rank continue that skips backward)

Healthy controls:

bcast_both_arms   ``if rank == 0: broadcast(t, 0) else: broadcast(t, 0)``, from two lines, in a loop
agreed_accum      DDP gradient accumulation with the same no_sync window on every rank
pp_1f1b_ok        the 1F1B schedule of pp_recv_recv with the warm-up count from the stage index
metric_all_ranks  every rank all_reduces the metric every 3 steps; only rank 0 prints it
"""
import contextlib
import io
import sys
import time

import torch
import torch.distributed as dist

from common import HANG_STEP, batch, capture_point, ddp_model, mark_onset, setup, synchronize

VARIANT = sys.argv[1]
STEPS = 8


# -- an extra collective on one rank -----------------------------------------------------------------------

def metric_extra(rank: int) -> None:
    grad = torch.ones(8)
    for step in range(1, STEPS + 1):
        dist.all_reduce(grad)  # site:metric_grad
        grad.div_(4.0)
        if step == HANG_STEP:
            mark_onset()
            if rank == 0:  # site:metric_branch
                metric = torch.full((8,), float(step))  # a logged metric: 8 values, like the gradient
                dist.all_reduce(metric)  # site:metric_extra
                synchronize()
                print(f"step {step}: metric {metric.mean().item():.2f}", flush=True)
    dist.barrier()  # site:metric_end
    dist.destroy_process_group()


def metric_extra_long(rank: int) -> None:
    grads, bufs = torch.ones(8), torch.ones(8)
    for step in range(1, 45):
        dist.all_reduce(grads)  # site:long_grads
        if step == HANG_STEP:
            mark_onset()
            if rank == 0:  # site:long_branch
                metric = torch.full((8,), float(step))
                dist.all_reduce(metric)  # site:long_extra
        dist.all_reduce(bufs)  # site:long_bufs
        time.sleep(0.15)
    dist.barrier()  # site:long_end
    dist.destroy_process_group()


def save(state: dict, f) -> None:
    torch.save(state, f)
    dist.barrier()  # site:save_barrier (every rank should reach this barrier)


def save_barrier(rank: int) -> None:
    grad = torch.ones(8)
    for epoch in range(1, STEPS + 1):
        for _ in range(3):
            dist.all_reduce(grad)  # site:save_grad
            grad.div_(4.0)
        if epoch == HANG_STEP:
            mark_onset()
            if rank == 0:  # site:save_branch
                save({"grad": grad, "epoch": epoch}, io.BytesIO())  # site:save_call
        dist.barrier()  # site:save_epoch_barrier
    dist.barrier()
    dist.destroy_process_group()


def async_extra(rank: int) -> None:
    t = torch.ones(8)
    for step in range(1, STEPS + 1):
        dist.all_reduce(t)  # site:async_step
        t.div_(4.0)
        if step == HANG_STEP:
            mark_onset()
            if rank == 1:  # site:async_branch
                work = dist.all_reduce(torch.ones(8), async_op=True)  # site:async_extra
                t.mul_(0.5)  # overlap some compute
                work.wait()  # site:async_wait
    dist.destroy_process_group()  # the others exit cleanly here, after STEPS all_reduces


# -- DDP gradient accumulation -----------------------------------------------------------------------------

MICRO_STEPS = 12  # per epoch, on every rank


def accumulate(rank: int, mine: int, others: int, epochs: int = 5, pause: float = 0.0) -> None:
    model, opt = ddp_model()
    for epoch in range(1, epochs + 1):
        if epoch == HANG_STEP and mine != others:
            mark_onset()
        # rank 3 gets shorter micro-batches from epoch HANG_STEP on and accumulates a different number of them
        accum = mine if rank == 3 and epoch >= HANG_STEP else others  # site:accum_window
        for i in range(MICRO_STEPS):
            sync = (i + 1) % accum == 0
            with contextlib.nullcontext() if sync else model.no_sync():  # site:accum_no_sync
                model(batch()).pow(2).mean().backward()  # site:accum_backward
            if sync:
                opt.step()
                opt.zero_grad()
            time.sleep(pause)
        dist.barrier()  # site:accum_barrier
    dist.barrier()
    dist.destroy_process_group()


# -- a 1F1B pipeline ---------------------------------------------------------------------------------------

N_STAGES = 2


def micro_batches(step: int) -> int:
    return 1 if step < HANG_STEP else 2  # batch-size ramp-up


def one_f_one_b(stage: int, peer: int, warmup: int, m: int) -> None:
    """Non-interleaved 1F1B for two stages: stage 0 sends activations and receives gradients, stage 1 the
    other way round. Sends are asynchronous (waited on at the end), receives block."""
    sends = []
    act, grad = torch.zeros(4), torch.zeros(4)

    def forward() -> None:
        if stage == 0:
            sends.append(dist.isend(torch.randn(4), dst=peer))  # site:pp_send_act
        else:
            dist.recv(act, src=peer)  # site:pp_recv_act

    def backward() -> None:
        if stage == 0:
            dist.recv(grad, src=peer)  # site:pp_recv_grad
        else:
            sends.append(dist.isend(act * 0.1, dst=peer))  # site:pp_send_grad

    for _ in range(warmup):
        forward()
    for _ in range(m - warmup):
        forward()
        backward()
    for _ in range(warmup):
        backward()
    for w in sends:
        w.wait()


def pipeline(rank: int, buggy: bool, pause: float = 0.0) -> None:
    stage = N_STAGES - 1 - rank % N_STAGES  # the head (last stage, the loss) lives on the even rank
    peer = rank + 1 if stage == N_STAGES - 1 else rank - 1
    loss = torch.ones(1)
    for step in range(1, STEPS + 1):
        m = micro_batches(step)
        if step == HANG_STEP and buggy:
            mark_onset()
        if buggy:
            warmup = min(max(N_STAGES - 1 - rank, 0), m)  # site:pp_warmup (the global rank, not the stage)
        else:
            warmup = min(N_STAGES - 1 - stage, m)  # site:pp_ok_warmup
        one_f_one_b(stage, peer, warmup, m)  # site:pp_schedule
        dist.all_reduce(loss)  # site:pp_loss
        loss.div_(4.0)
        time.sleep(pause)
    dist.barrier()
    dist.destroy_process_group()


# -- a step skipped on one rank ----------------------------------------------------------------------------

THRESHOLD = 100.0


def skip_backward(rank: int) -> None:
    model, opt = ddp_model()
    for step in range(1, STEPS + 1):
        x = batch()
        if rank == 1 and step == HANG_STEP:
            x = torch.full_like(x, 1000.0)  # a corrupt sample on rank 1's shard
        loss = model(x).pow(2).mean()
        if step == HANG_STEP:
            mark_onset()
        if loss.item() > THRESHOLD:  # site:skip_guard
            print(f"rank {rank}: loss spike {loss.item():.0f} at step {step}, skipping the batch", flush=True)
            continue  # site:skip_continue
        opt.zero_grad()
        loss.backward()  # site:skip_backward
        opt.step()
    dist.barrier()  # site:skip_end
    dist.destroy_process_group()


# -- healthy controls --------------------------------------------------------------------------------------

def bcast_both_arms(rank: int) -> None:
    t = torch.zeros(8)
    capture_point(7.0)
    for step in range(1, 13):
        if rank == 0:  # site:bcast_branch
            t.fill_(float(step))
            dist.broadcast(t, src=0)  # site:bcast_src
        else:
            dist.broadcast(t, src=0)  # site:bcast_dst
        synchronize()
        time.sleep(1.0)  # the step's compute
    dist.barrier()
    dist.destroy_process_group()


def metric_all_ranks(rank: int) -> None:
    grad = torch.ones(8)
    capture_point(7.0)
    for step in range(1, 19):
        dist.all_reduce(grad)  # site:metric_ok_grad
        grad.div_(4.0)
        if step % 3 == 0:
            metric = torch.full((8,), float(step))
            dist.all_reduce(metric)  # site:metric_ok_reduce
            if rank == 0:
                print(f"step {step}: metric {metric.mean().item():.2f}", flush=True)
        time.sleep(0.6)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    rank, _ = setup()
    if VARIANT in ("agreed_accum", "pp_1f1b_ok"):
        capture_point(7.0)
    {
        "metric_extra": lambda: metric_extra(rank),
        "metric_extra_long": lambda: metric_extra_long(rank),
        "save_barrier": lambda: save_barrier(rank),
        "async_extra": lambda: async_extra(rank),
        "accum_window": lambda: accumulate(rank, mine=4, others=3),
        "accum_window_mirror": lambda: accumulate(rank, mine=3, others=4),
        "pp_recv_recv": lambda: pipeline(rank, buggy=True),
        "skip_backward": lambda: skip_backward(rank),
        "bcast_both_arms": lambda: bcast_both_arms(rank),
        "agreed_accum": lambda: accumulate(rank, mine=3, others=3, epochs=4, pause=0.25),
        "pp_1f1b_ok": lambda: pipeline(rank, buggy=False, pause=1.5),
        "metric_all_ranks": lambda: metric_all_ranks(rank),
    }[VARIANT]()


if __name__ == "__main__":
    main()
