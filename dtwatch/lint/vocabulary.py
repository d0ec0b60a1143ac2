"""The names the lint recognises: collectives, distributed receivers and modules, rank-ish names.

The torch.distributed collectives come from the one table of ops (:data:`dtwatch.ops.TABLE`); this
module adds the library calls that run a collective inside and the words that make a test a rank test.
"""
from __future__ import annotations

import re
from typing import NamedTuple

from dtwatch.ops import LINT_COLLECTIVES


class Op(NamedTuple):
    """Why a call blocks, and how sure we can be from its name alone."""

    reason: str
    qualified: bool = False  # a common name: needs a distributed receiver or import to count
    p2p: bool = False  # point-to-point: reported as DTW003 and never as a skipped collective


# Library calls that run a collective inside (not torch.distributed functions: not recorded).
LIBRARY_COLLECTIVES: dict[str, Op] = {
    "wait_for_everyone": Op("Accelerate's barrier"),
    "gather_for_metrics": Op("Accelerate: an all_gather that drops duplicated samples"),
    "pad_across_processes": Op("Accelerate: all-gathers the sizes to pad to the largest"),
    "summon_full_params": Op("FSDP: all-gathers the full parameters on every rank"),
    "full_optim_state_dict": Op("FSDP: gathers the optimizer state from every rank"),
}

# Every call the lint counts: torch.distributed's (from dtwatch.ops; names other libraries use too,
# such as gather or reduce, are qualified) and the library calls above.
COLLECTIVES: dict[str, Op] = {
    **{op.name: Op(op.blocks, qualified=op.common_name, p2p=op.p2p) for op in LINT_COLLECTIVES},
    **LIBRARY_COLLECTIVES,
}

# Keyword arguments that make an ordinary-looking call collective.
COLLECTIVE_KEYWORDS: dict[str, Op] = {
    "sync_dist": Op("Lightning's log(..., sync_dist=True) all-reduces the logged value"),
}

# Receivers whose gather/reduce/broadcast/send... are the distributed ones (compared lower-case).
DISTRIBUTED_RECEIVERS = frozenset({
    "dist", "distributed", "c10d", "distributed_c10d", "accelerator", "strategy", "fabric",
})
DISTRIBUTED_MODULES = ("torch.distributed", "deepspeed.comm", "accelerate")

# Rank-ish names besides those whose last word is "rank" (compared lower-case).
RANK_NAMES = frozenset({
    "is_main_process", "is_local_main_process", "main_process", "is_main",
    "is_master", "is_master_process", "is_local_master", "is_master_ordinal",
    "is_rank_zero", "is_rank_0", "is_rank0", "rank0", "rank_zero", "rank_zero_only", "rank_id",
    "is_global_zero", "is_local_zero", "process_index", "local_process_index",
    "get_ordinal", "get_local_ordinal",
})
RANK_ENV_KEYS = frozenset({"SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID"})  # plus *RANK
# "src_rank", "peer_rank"...: another rank, the same number on every rank.
OTHER_RANK_WORDS = frozenset({
    "src", "dst", "source", "dest", "destination", "root", "peer", "target", "master", "main",
    "leader", "failed", "next", "prev", "max", "min", "num", "per", "each", "every", "by",
})
RANK_TRANSLATIONS = frozenset({"get_global_rank", "get_group_rank"})  # (group, some rank) -> rank
RANK_DECORATORS = frozenset({
    "rank_zero_only", "master_only", "main_process_only",  # Lightning, mmcv
    "on_main_process", "on_local_main_process", "on_process", "on_local_process",  # Accelerate
})
# Every rank test needs one of these words, so a file without any is skipped after parsing.
RANK_HINT = re.compile("|".join(sorted({"rank", *RANK_NAMES, *RANK_DECORATORS, *RANK_ENV_KEYS})), re.IGNORECASE)
EXIT_CALLS = frozenset({"sys.exit", "exit", "quit", "os._exit"})
CONVERSIONS = frozenset({"int", "str", "bool", "float"})  # int(os.environ["RANK"]) is still the rank


def is_distributed_module(dotted: str) -> bool:
    """``torch.distributed``, ``deepspeed.comm``, ``accelerate`` or one of their submodules."""
    return any(dotted == m or dotted.startswith(m + ".") for m in DISTRIBUTED_MODULES)
