"""Distributed Checkpoint (torch.distributed.checkpoint) and its state_dict helpers (FSDP2)."""
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import state_dict_saver
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
)


def save(model, optim, state, rank):
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    if rank == 0:
        dcp.save(state, checkpoint_id="ckpt")  # expect: DTW001
        dcp.load(state, checkpoint_id="ckpt")  # expect: DTW001
        dcp.async_save(state, checkpoint_id="ckpt")  # expect: DTW001
        torch.distributed.checkpoint.save(state, checkpoint_id="ckpt")  # expect: DTW001
        torch.distributed.checkpoint.load(state, checkpoint_id="ckpt")  # expect: DTW001
        torch.distributed.checkpoint.state_dict_saver.save(state, checkpoint_id="ckpt")  # expect: DTW001
        state_dict_saver.save(state, checkpoint_id="ckpt")  # expect: DTW001
        dist.checkpoint.save(state, checkpoint_id="ckpt")  # expect: DTW001
        get_model_state_dict(model, options=options)  # expect: DTW001
        get_optimizer_state_dict(model, optim)  # expect: DTW001
        get_state_dict(model, optim)  # expect: DTW001
        set_model_state_dict(model, state)  # expect: DTW001


def save_full(model, optim):
    # FSDP2's pattern: every rank gathers the full state dict, rank 0 writes it.
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(model, options=options)
    if dist.get_rank() == 0:
        torch.save(full, "model.pt")
        torch.load("model.pt")
        model.load_state_dict(full)  # the module's own, not DCP's
        optim.state_dict()
        model.save("model.pt")
    dcp.save({"model": model}, checkpoint_id="ckpt")
