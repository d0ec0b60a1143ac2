"""A plain torch job (no dtwatch) on gloo that goes wrong one way, and leaves torch's Flight Recorder dumps.

Run under torchrun (or any launcher that sets RANK/WORLD_SIZE/MASTER_*) with the Flight Recorder on
(``TORCH_FR_BUFFER_SIZE``; ``TORCH_NCCL_TRACE_BUFFER_SIZE`` before torch 2.14). ``FR_FAULT`` picks the fault:

* ``healthy``: every rank runs every step; the job then idles (all ranks outside collectives) until dumped.
* ``rank_conditional``: rank 0 reduces a metric under ``if rank == 0`` once; it pairs with the others' next
  gradient all-reduce, and the ranks end out of step (rank 0's last all-reduce meets the others' barrier).
* ``uneven``: rank 0 runs one more step than the others; they wait in the barrier after the loop.
* ``subgroup_skip``: rank 2 skips one all-reduce of a subgroup of ranks 0-2.
* ``p2p``: every step rank 0 sends to rank 1, which skips one receive; rank 0 blocks in its send.
* ``mismatch``: rank 1 reduces a tensor of another shape at the same line, once.
* ``crash``: rank 2 raises mid-run and leaves no dump, as a crashed process does (it raises once the others,
  waiting for it, have dumped).
* ``stuck``: rank 1 sleeps outside any collective (a stuck data loader, I/O) while the others wait.

Each rank dumps its own recorder ``FR_DUMP_AFTER`` seconds after start (the others' timeout, in effect) to
``$FR_DUMP_DIR/<FR_PREFIX><rank>``: through torch's own writer where it has one (``_dump_fr_trace_file``:
``TORCH_FR_DUMP_TEMP_FILE`` + rank), else the bytes of ``_dump_fr_trace()`` (``FR_FORMAT=json``: those of
``_dump_fr_trace_json()``; ``FR_STACKS=0``: without the entries' Python frames). A rank whose collective
fails on a lost peer dumps at once, as torch does when its watchdog sees a timeout (launch with a monitor
interval of a few seconds, so that the launcher's teardown comes after). Every rank that can exits once all
dumps are in (or a deadline passes).
"""
import os
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

FAULT = os.environ.get("FR_FAULT", "healthy")
STEPS = 4


class InjectedCrashError(RuntimeError):
    pass


def train(rank: int, world: int) -> None:
    grad = torch.ones(4)
    sub = dist.new_group([0, 1, 2]) if FAULT == "subgroup_skip" else None
    steps = STEPS + 1 if FAULT == "uneven" and rank == 0 else STEPS
    for step in range(steps):
        if FAULT == "p2p" and rank in (0, 1):
            if rank == 0:
                dist.send(torch.full((3,), float(step)), dst=1)
            elif step != 2:  # rank 1 skips one receive
                dist.recv(torch.empty(3), src=0)
        if FAULT == "crash" and rank == 2 and step == 2:
            others_dumped(world, rank)  # the others time out and dump first, as on NCCL
            raise InjectedCrashError("corrupt batch on rank 2")
        if FAULT == "stuck" and rank == 1 and step == 2:
            time.sleep(3600)  # stuck outside any collective
        if FAULT == "mismatch" and rank == 1 and step == 2:
            grad = torch.ones(5)  # the wrong tensor, reduced at the same line below
        dist.all_reduce(grad)  # gradient all-reduce
        if FAULT == "subgroup_skip" and rank in (0, 1, 2):
            if not (rank == 2 and step == 2):  # rank 2 skips one
                dist.all_reduce(torch.ones(2), group=sub)  # subgroup all-reduce
        if FAULT == "rank_conditional" and rank == 0 and step == 1:
            dist.all_reduce(torch.ones(4))  # metric reduced only on rank 0
    dist.barrier()  # end of training
    if FAULT == "healthy":
        time.sleep(3600)  # every rank idles outside collectives until the dump


def others_dumped(world: int, me: int, limit: float = 60.0) -> None:
    """Wait (bounded) until every other rank has dumped: with gloo a crash is seen by the peers at once, and
    the launcher's teardown would end them before their dumps; NCCL's peers wait for their timeout."""
    out, prefix = os.environ["FR_DUMP_DIR"], os.environ.get("FR_PREFIX", "fr_trace_rank_")
    deadline = time.time() + limit
    while time.time() < deadline and not all(os.path.exists(os.path.join(out, f"{prefix}{r}"))
                                             for r in range(world) if r != me):
        time.sleep(0.05)


def dump(rank: int, world: int, out: str, prefix: str) -> None:
    """Write this rank's Flight Recorder dump as torch would, atomically."""
    c10d = torch._C._distributed_c10d
    final = os.path.join(out, f"{prefix}{rank}")
    stacks = os.environ.get("FR_STACKS", "1") != "0"  # 0: no Python frames (no paths of this machine in them)
    if os.environ.get("FR_FORMAT") == "json":
        data = c10d._dump_fr_trace_json()
    elif hasattr(c10d, "_dump_fr_trace_file") and os.environ.get("TORCH_FR_DUMP_TEMP_FILE") == os.path.join(out,
                                                                                                        prefix):
        c10d._dump_fr_trace_file(rank, includeStackTraces=stacks)  # torch's own writer: <TORCH_FR_DUMP_TEMP_FILE><rank>
        return
    else:
        data = c10d._dump_fr_trace(includeStackTraces=stacks)
    tmp = os.path.join(out, f".{prefix}{rank}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, final)


_dumped = threading.Lock()


def dump_and_exit(rank: int, world: int) -> None:
    """Dump (once), wait for the other ranks' dumps (or a deadline), end the process."""
    if not _dumped.acquire(blocking=False):
        time.sleep(3600)  # the other thread dumps and ends the process
    out, prefix = os.environ["FR_DUMP_DIR"], os.environ.get("FR_PREFIX", "fr_trace_rank_")
    dump(rank, world, out, prefix)
    deadline = time.time() + float(os.environ.get("FR_EXIT_WAIT", "6"))
    while time.time() < deadline and not all(os.path.exists(os.path.join(out, f"{prefix}{r}")) for r in range(world)):
        time.sleep(0.05)
    time.sleep(0.3)
    sys.stdout.flush()
    os._exit(0)


def dumper(rank: int, world: int, started: float) -> None:
    if FAULT == "crash" and rank == 2:
        return  # the rank that crashes leaves no dump
    time.sleep(max(0.0, started + float(os.environ.get("FR_DUMP_AFTER", "4")) - time.time()))
    dump_and_exit(rank, world)


def main() -> None:
    started = time.time()
    dist.init_process_group("gloo", timeout=timedelta(seconds=float(os.environ.get("FR_TIMEOUT", "120"))))
    rank, world = dist.get_rank(), dist.get_world_size()
    threading.Thread(target=dumper, args=(rank, world, started), daemon=True).start()
    try:
        train(rank, world)
    except InjectedCrashError:
        raise  # the crashed rank ends now, with no dump
    except Exception as exc:  # noqa: BLE001 - a peer's loss: dump at once, as torch does on a timeout
        print(f"rank {rank}: {type(exc).__name__}: {str(exc)[:120]}", file=sys.stderr, flush=True)
        dump_and_exit(rank, world)
    time.sleep(3600)


if __name__ == "__main__":
    main()
