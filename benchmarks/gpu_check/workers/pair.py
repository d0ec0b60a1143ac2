"""Step pair's worker: a real 2-rank NCCL job on the one GPU, under ``dtwatch run -- torchrun --nproc-per-node 2``.

NCCL refuses two ranks on one GPU; each rank claims a host of its own (``NCCL_HOSTID``), so NCCL connects
them through sockets on loopback, with NCCL's own execution model (a collective returns once enqueued; the
rank blocks where it synchronises). ``GPU_CHECK_NCCL_SHARE=multi_rank`` uses NCCL_MULTI_RANK_GPU_ENABLE=1
instead (NCCL >= 2.30).

Modes (argv[1]), a DDP loop of 12 steps, each ending with a logged all_reduce read with ``.item()``:
  healthy  nothing goes wrong: no diagnosis
  hang     at step 5 rank 0 all_reduces a metric under ``if rank == 0`` (on a metrics group of both ranks,
           so no other call of rank 1 can match it) and reads it: rank 0 blocks there, rank 1 in its
           logged all_reduce
  stuck    at step 5 rank 1 sleeps outside any collective; rank 0 waits in its logged all_reduce
GPU_CHECK_CPU=1: gloo on the CPU (the same hangs, inside the calls).
"""
import os
import sys
import time

CPU = os.environ.get("GPU_CHECK_CPU") == "1"
MODE = sys.argv[1]
RANK = int(os.environ.get("RANK", "0"))
if not CPU:  # before torch.distributed reads them
    if os.environ.get("GPU_CHECK_NCCL_SHARE") == "multi_rank":
        os.environ["NCCL_MULTI_RANK_GPU_ENABLE"] = "1"
    else:
        os.environ["NCCL_HOSTID"] = f"gpucheck-{RANK}"
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_IB_DISABLE", "1")

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def say(msg: str) -> None:
    print(f"[worker rank {RANK}] {msg}", flush=True)


def main() -> None:
    if CPU:
        dev, backend = torch.device("cpu"), "gloo"
    else:
        torch.cuda.set_device(0)
        dev, backend = torch.device("cuda", 0), "nccl"
    dist.init_process_group(backend)
    rank = dist.get_rank()
    metrics = dist.new_group([0, 1])
    t = torch.ones(4, device=dev)
    dist.all_reduce(t)
    dist.all_reduce(t, group=metrics)  # both groups' communicators made before anything goes wrong
    say(f"{backend} all_reduce works: {t.tolist()}")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).to(dev)
    model = DDP(model, device_ids=None if CPU else [0])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, 13):
        loss = model(torch.randn(16, 32, device=dev)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if MODE == "stuck" and step == 5 and rank == 1:
            say("stops outside any collective")
            time.sleep(600)  # site:stuck_sleep
        if MODE == "hang" and step == 5:
            if rank == 0:  # site:hang_branch
                say("all_reduces a metric only rank 0 reaches")
                metric = loss.detach().clone()
                dist.all_reduce(metric, group=metrics)  # site:hang_all_reduce
                say(f"metric {metric.item()}")  # NCCL: rank 0 blocks here, in the sync
        logged = loss.detach().clone()
        dist.all_reduce(logged)  # site:logged_all_reduce
        value = logged.item()
        if step % 4 == 0:
            say(f"step {step} loss {value:.4f}")
        time.sleep(0.1)
    if MODE != "healthy":
        say("UNEXPECTED: the hang did not happen")
    dist.barrier()
    dist.destroy_process_group()
    say("clean exit")


if __name__ == "__main__":
    main()
