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
    # Narrower than qualified: the name counts only on these receivers (the receiver's last name,
    # lower-case, ends with one: fabric, self.fabric, self._trainer) or from these modules (imported
    # from one, or called on one or an alias of one: dcp.save). ``fabric.save`` is collective,
    # ``accelerator.save`` and ``torch.save`` are not.
    receivers: frozenset[str] = frozenset()
    modules: tuple[str, ...] = ()

    @property
    def restricted(self) -> bool:
        return bool(self.receivers or self.modules)


DCP = ("torch.distributed.checkpoint",)  # Distributed Checkpoint (dcp), state_dict helpers included
_DCP_PLAN = "DCP: every rank takes part in planning the checkpoint (gather and scatter of the plans)"
_DCP_STATE = "DCP state_dict helper: all-gathers (or broadcasts) sharded parameters and optimizer state"


# Library calls that run a collective inside (not torch.distributed functions: not recorded).
# Accelerate's gather/reduce/broadcast (on an accelerator, or imported from accelerate.utils) and
# Lightning's strategy/Fabric broadcast, barrier, all_gather, all_reduce and LightningModule.all_gather
# are the torch.distributed names above, found through their receivers (DISTRIBUTED_RECEIVERS).
LIBRARY_COLLECTIVES: dict[str, Op] = {
    # Accelerate.
    "wait_for_everyone": Op("Accelerate's barrier"),
    "gather_for_metrics": Op("Accelerate: an all_gather that drops duplicated samples"),
    "pad_across_processes": Op("Accelerate: all-gathers the sizes to pad to the largest"),
    "check_trigger": Op("Accelerate: all-reduces the flag that set_trigger() raised on some rank",
                        receivers=frozenset({"accelerator"})),
    # Lightning (Trainer, strategies, Fabric).
    "reduce_boolean_decision": Op("Lightning strategy: all-reduces a decision so that every rank agrees"),
    "save_checkpoint": Op("Lightning: Trainer.save_checkpoint waits in the strategy's barrier",
                          receivers=frozenset({"trainer"})),
    "save": Op("Fabric.save waits in a barrier; DCP's save plans the checkpoint with every rank",
               receivers=frozenset({"fabric"}), modules=DCP),
    "load": Op("Fabric.load waits in a barrier; DCP's load plans the read with every rank",
               receivers=frozenset({"fabric"}), modules=DCP),
    # Distributed Checkpoint (torch.distributed.checkpoint, its state_dict_saver/loader and state_dict).
    "async_save": Op(_DCP_PLAN, modules=DCP),
    "save_state_dict": Op(_DCP_PLAN, modules=DCP),
    "load_state_dict": Op(_DCP_PLAN, modules=DCP),  # never model.load_state_dict: DCP only
    "get_state_dict": Op(_DCP_STATE, modules=DCP),
    "get_model_state_dict": Op(_DCP_STATE, modules=DCP),
    "get_optimizer_state_dict": Op(_DCP_STATE, modules=DCP),
    "set_state_dict": Op(_DCP_STATE, modules=DCP),
    "set_model_state_dict": Op(_DCP_STATE, modules=DCP),
    "set_optimizer_state_dict": Op(_DCP_STATE, modules=DCP),
    # FSDP (version 1).
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

# Attributes whose reading runs a collective (properties), never counted as calls.
COLLECTIVE_PROPERTIES: dict[str, Op] = {
    "log_dir": Op("Lightning: Trainer.log_dir broadcasts rank 0's directory", receivers=frozenset({"trainer"})),
}

# Receivers whose gather/reduce/broadcast/send... are the distributed ones (compared lower-case).
DISTRIBUTED_RECEIVERS = frozenset({
    "dist", "distributed", "c10d", "distributed_c10d", "accelerator", "strategy", "fabric",
})
DISTRIBUTED_MODULES = ("torch.distributed", "deepspeed.comm", "accelerate")
# What these names stand for when the file does not import them itself (a snippet, a star import).
CONVENTIONAL_ALIASES = {"dist": "torch.distributed", "dcp": "torch.distributed.checkpoint"}

# Rank-ish names besides those whose last word is "rank" (compared lower-case).
RANK_NAMES = frozenset({
    "is_main_process", "is_local_main_process", "main_process", "is_main",
    "is_master", "is_master_process", "is_local_master", "is_master_ordinal",
    "is_rank_zero", "is_rank_0", "is_rank0", "rank0", "rank_zero", "rank_zero_only", "rank_id",
    "is_global_zero", "is_local_zero", "process_index", "local_process_index", "is_last_process",
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
    "rank_zero_only", "rank_zero_experiment", "master_only", "main_process_only",  # Lightning, mmcv
    "on_main_process", "on_local_main_process", "on_last_process", "on_process", "on_local_process",  # Accelerate
})
# Not rank tests: "with accelerator.main_process_first():" (and local_main_process_first, Fabric's
# rank_zero_first) lets rank 0 go first, but every rank runs the body and both barriers.
# Every rank test needs one of these words, so a file without any is skipped after parsing.
RANK_HINT = re.compile("|".join(sorted({"rank", *RANK_NAMES, *RANK_DECORATORS, *RANK_ENV_KEYS})), re.IGNORECASE)
EXIT_CALLS = frozenset({"sys.exit", "exit", "quit", "os._exit"})
CONVERSIONS = frozenset({"int", "str", "bool", "float"})  # int(os.environ["RANK"]) is still the rank


def is_distributed_module(dotted: str) -> bool:
    """``torch.distributed``, ``deepspeed.comm``, ``accelerate`` or one of their submodules."""
    return in_modules(dotted, DISTRIBUTED_MODULES)


def in_modules(dotted: str, modules: tuple[str, ...]) -> bool:
    """Whether ``dotted`` is one of ``modules`` or inside one."""
    return any(dotted == m or dotted.startswith(m + ".") for m in modules)
