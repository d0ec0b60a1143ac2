"""Step nvml's worker (1 rank): keeps the GPU busy with matmuls for argv[1] seconds while holding 2 GB, one
all_reduce a second, so the watchdog's NVML readings have something to show. GPU_CHECK_CPU=1: gloo, small
matmuls on the CPU."""
import os
import sys
import time

import torch
import torch.distributed as dist

CPU = os.environ.get("GPU_CHECK_CPU") == "1"
SECONDS = float(sys.argv[1]) if len(sys.argv) > 1 else 15


def main() -> None:
    if CPU:
        dev, backend = torch.device("cpu"), "gloo"
    else:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dev, backend = torch.device("cuda", int(os.environ["LOCAL_RANK"])), "nccl"
    dist.init_process_group(backend)
    n = 256 if CPU else 8192
    a = torch.randn(n, n, device=dev)
    held = None if CPU else torch.empty(int(2e9) // 4, device=dev)  # memory_used visibly above 2 GB
    t = torch.ones(16, device=dev)
    end, last = time.time() + SECONDS, 0.0
    while time.time() < end:
        a @ a
        if CPU:
            time.sleep(0.05)
        else:
            torch.cuda.synchronize()
        if time.time() - last > 1.0:
            dist.all_reduce(t)
            last = time.time()
    del held
    dist.barrier()
    dist.destroy_process_group()
    print(f"busy: done after {SECONDS:.0f} s", flush=True)


if __name__ == "__main__":
    main()
