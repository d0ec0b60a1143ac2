"""A live rank stuck outside any collective (data loading, I/O, a lock, a loop) while the others wait.

    python stuck_outside.py VARIANT     (under torchrun, 4 ranks)

python    rank 1's data loading blocks (an endless read) while the others wait in all_reduce
ddp       in DDP training, rank 1 blocks fetching its batch; the others wait in the gradient all_reduce
subgroup  rank 3 waits for a file that never appears before its pair all_reduce with rank 2
p2p       rank 0 takes activations from a queue whose producer thread died; rank 1 waits in recv
object    rank 2 deadlocks on a lock it already holds; the others wait in all_gather_object
async     rank 1 iterates a solver that never converges (pure Python) while the others wait on async work
ckpt      rank 0 writes a checkpoint to storage that stopped answering; the others run the next DDP step
"""
import os
import queue
import sys
import threading
import time

import torch
import torch.distributed as dist

from common import HANG_STEP, SLEEP_FOREVER, batch, ddp_model, finish, mark_onset, setup

VARIANT = sys.argv[1]


def read_shard(rank: int, step: int) -> torch.Tensor:
    if rank == 1 and step == HANG_STEP:
        mark_onset()
        time.sleep(SLEEP_FOREVER)  # site:read_blocks
    return torch.ones(4)


def python_issued(rank: int) -> None:
    for step in range(1, 10):
        t = read_shard(rank, step)  # site:python_read
        if step == HANG_STEP:
            mark_onset()
        dist.all_reduce(t)  # site:python_step


def ddp(rank: int) -> None:
    model, opt = ddp_model()
    for step in range(1, 10):
        x = read_shard(rank, step).repeat(4, 2)  # site:ddp_read
        if step == HANG_STEP:
            mark_onset()
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()  # site:ddp_backward
        opt.step()


def subgroup(rank: int) -> None:
    pair = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    flag = os.path.join(os.environ["DTWATCH_DIR"], "ready-never-written")
    t = torch.ones(4)
    for step in range(1, 10):
        if step == HANG_STEP:
            mark_onset()
            if rank == 3:
                while not os.path.exists(flag):  # site:sub_poll
                    time.sleep(0.1)  # site:sub_poll_sleep
        dist.all_reduce(t, group=pair)  # site:sub_step
        dist.barrier()  # site:sub_barrier


def p2p(rank: int) -> None:
    feed: queue.Queue = queue.Queue()

    def producer() -> None:
        for _ in range(HANG_STEP - 1):
            feed.put(torch.ones(4))
        # the producer dies here (an unhandled error in a data thread): nothing more is put

    if rank == 0:
        threading.Thread(target=producer, daemon=True).start()
    act = torch.ones(4)
    for step in range(1, 10):
        if step == HANG_STEP:
            mark_onset()
        if rank == 0:
            act = feed.get()  # site:p2p_get
            dist.send(act, dst=1)  # site:p2p_send
        elif rank == 1:
            dist.recv(act, src=0)  # site:p2p_recv
        dist.barrier()  # site:p2p_barrier


def objects(rank: int) -> None:
    lock = threading.Lock()
    for step in range(1, 10):
        with lock:
            if step == HANG_STEP:
                mark_onset()
                if rank == 2:
                    with lock:  # site:obj_relock
                        pass
            out = [None] * dist.get_world_size()
            dist.all_gather_object(out, {"step": step})  # site:obj_step


def solve(x: float) -> float:
    while abs(x * x - 2.0) > 0.0:  # site:async_solver
        x = (x + 2.0 / x) / 2.0 + 1e-9
    return x


def async_wait(rank: int) -> None:
    t = torch.ones(8)
    for step in range(1, 10):
        if step == HANG_STEP:
            mark_onset()
            if rank == 1:
                solve(1.0)  # site:async_solve_call
        work = dist.all_reduce(t, async_op=True)  # site:async_start
        t.mul_(0.5)
        work.wait()  # site:async_wait


def save_checkpoint(model: torch.nn.Module) -> None:
    state = {k: v.clone() for k, v in model.state_dict().items()}
    time.sleep(SLEEP_FOREVER)  # site:ckpt_write (the storage does not answer)
    torch.save(state, os.devnull)


def checkpoint(rank: int) -> None:
    model, opt = ddp_model()
    for step in range(1, 10):
        loss = model(batch()).pow(2).mean()
        opt.zero_grad()
        loss.backward()  # site:ckpt_backward
        opt.step()
        if step == HANG_STEP:
            mark_onset()
            if rank == 0:  # site:ckpt_branch
                save_checkpoint(model)  # site:ckpt_call


def main() -> None:
    rank, _ = setup()
    {
        "python": lambda: python_issued(rank),
        "ddp": lambda: ddp(rank),
        "subgroup": lambda: subgroup(rank),
        "p2p": lambda: p2p(rank),
        "object": lambda: objects(rank),
        "async": lambda: async_wait(rank),
        "ckpt": lambda: checkpoint(rank),
    }[VARIANT]()
    finish()


if __name__ == "__main__":
    main()
