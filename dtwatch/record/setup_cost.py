"""What gathering the setup facts costs, measured in this process (``dtwatch checks --measure``).

Each figure is the median of repeated runs of the rank-side work one setup event does, on inputs of a
typical size (stated next to it): the work is timed in isolation, without a process group.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from dtwatch.record.data_samplers import describe_loader, training_now
from dtwatch.record.fingerprint import dataset_signature, fingerprint
from dtwatch.ring.layout import FACTS_END
from dtwatch.ring.setup_facts import encode_facts, write_facts


def _median_us(fn: Callable[[], Any], repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e6, 1)


def measure(repeat: int = 50) -> dict[str, dict[str, Any]]:
    """{event: {"us": median microseconds, "thread": where it runs, "input": what was measured}}."""
    data = TensorDataset(torch.randn(4096, 512), torch.randint(0, 10, (4096,)))
    loader = DataLoader(data, batch_size=64, sampler=DistributedSampler(data, num_replicas=8, rank=3))
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512))
    facts = describe_loader(loader, True)
    doc = {"v": 1, "torch": torch.__version__, "world": 8, "cvd": None,
           "wraps": [{"kind": "DDP", "site": {"file": "/home/user/project/train.py", "line": 120, "function": "main"},
                      "group": "0", "calls": 1, "params": 1_050_112, "trainable": 1_050_112, "dtypes": ["float32"],
                      "policy": "", "t": 0.0}],
           "loaders": {str(i): {**facts, "iters": 3, "epochs": [[0, 0], [0, 1], [0, 2]],
                                "fp": {"1": "0" * 16, "2": "1" * 16, "3": "2" * 16}, "t": 0.0} for i in range(3)}}
    header = bytearray(FACTS_END)
    batch = next(iter(loader))

    def params_pass() -> None:
        sum(p.numel() for p in model.parameters())
        {str(p.dtype) for p in model.parameters()}

    return {
        "loader_epoch_facts": {"us": _median_us(lambda: (describe_loader(loader, training_now([model]))), repeat),
                               "thread": "training", "input": "DataLoader over a DistributedSampler"},
        "facts_write": {"us": _median_us(lambda: write_facts(header, encode_facts(doc)), repeat),
                        "thread": "training (and background)",
                        "input": f"facts document of 1 wrap and 3 loaders ({len(encode_facts(doc))} bytes)"},
        "first_batch_fingerprint": {"us": _median_us(lambda: fingerprint(batch), repeat), "thread": "background",
                                    "input": "batch of 64x512 float32 + 64 int64 labels"},
        "dataset_signature": {"us": _median_us(lambda: dataset_signature(data), repeat), "thread": "background",
                              "input": "TensorDataset of 4096x512 float32 (once per loader)"},
        "wrap_parameter_pass": {"us": _median_us(params_pass, repeat), "thread": "training",
                                "input": "1.05M-parameter MLP, once per DDP/FSDP wrap"},
    }
