"""A rank that is alive but wedged: stopped (SIGSTOP) or stuck in native code that holds the GIL.

    python unresponsive.py VARIANT     (under torchrun, 4 ranks)

sigstop    rank 1 is stopped (as a debugger or a job control mistake would) between two all_reduces
regex_ddp  rank 2 parses a log line with a catastrophically backtracking regex (the GIL is held in C)
            while the others wait in DDP's gradient all_reduce
pydll_sub  rank 3 calls a C function through ctypes.PyDLL (GIL held) before its pair all_reduce with rank 2
sigstop_p2p rank 0, a pipeline sender, is stopped; rank 1 waits in recv
regex_obj  rank 3 runs the regex while the others wait in all_gather_object
sigstop_async rank 2 is stopped after starting an async all_reduce, before waiting on it
"""
import ctypes
import os
import re
import signal
import sys

import torch
import torch.distributed as dist

from common import HANG_STEP, batch, ddp_model, finish, mark_onset, setup

VARIANT = sys.argv[1]
LOG_LINE = "a" * 40 + "!"


def stop_self() -> None:
    mark_onset()
    os.kill(os.getpid(), signal.SIGSTOP)  # site:stop


def parse(line: str) -> bool:
    return re.match(r"(a+)+$", line) is not None  # site:regex


def sigstop(rank: int) -> None:
    t = torch.ones(4)
    for step in range(1, 10):
        dist.all_reduce(t)  # site:stop_step
        if step == HANG_STEP and rank == 1:
            stop_self()  # site:stop_call


def regex_ddp(rank: int) -> None:
    model, opt = ddp_model()
    for step in range(1, 10):
        loss = model(batch()).pow(2).mean()
        opt.zero_grad()
        loss.backward()  # site:regex_backward
        opt.step()
        if step == HANG_STEP and rank == 2:
            mark_onset()
            parse(LOG_LINE)  # site:regex_call


def pydll_sub(rank: int) -> None:
    pair = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    libc = ctypes.PyDLL(None)
    t = torch.ones(4)
    for step in range(1, 10):
        if step == HANG_STEP and rank == 3:
            mark_onset()
            libc.sleep(3600)  # site:pydll_call
        dist.all_reduce(t, group=pair)  # site:pydll_step
        dist.barrier()


def sigstop_p2p(rank: int) -> None:
    act = torch.ones(4)
    for step in range(1, 10):
        if rank == 0:
            if step == HANG_STEP:
                stop_self()  # site:stop_p2p_call
            dist.send(act, dst=1)  # site:stop_p2p_send
        elif rank == 1:
            dist.recv(act, src=0)  # site:stop_p2p_recv
        dist.barrier()


def regex_obj(rank: int) -> None:
    for step in range(1, 10):
        if step == HANG_STEP and rank == 3:
            mark_onset()
            parse(LOG_LINE)  # site:regex_obj_call
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, {"step": step})  # site:regex_obj_step


def sigstop_async(rank: int) -> None:
    t = torch.ones(8)
    for step in range(1, 10):
        work = dist.all_reduce(t, async_op=True)  # site:stop_async_start
        if step == HANG_STEP and rank == 2:
            stop_self()  # site:stop_async_call
        work.wait()  # site:stop_async_wait


def main() -> None:
    rank, _ = setup()
    {
        "sigstop": sigstop, "regex_ddp": regex_ddp, "pydll_sub": pydll_sub, "sigstop_p2p": sigstop_p2p,
        "regex_obj": regex_obj, "sigstop_async": sigstop_async,
    }[VARIANT](rank)
    finish()


if __name__ == "__main__":
    main()
