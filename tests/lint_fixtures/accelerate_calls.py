"""Accelerate: its collectives, and which of its tests are rank tests (main_process_first is not)."""
import torch
from accelerate import Accelerator
from accelerate.utils import broadcast, broadcast_object_list, gather, reduce
from accelerate.utils import save as accelerate_save

accelerator = Accelerator()


def evaluate(model, batch, preds, objects, t):
    if accelerator.is_main_process:
        accelerator.gather(preds)  # expect: DTW001
        accelerator.gather_for_metrics(preds)  # expect: DTW001
        accelerator.reduce(t, reduction="sum")  # expect: DTW001
        accelerator.pad_across_processes(preds, dim=1)  # expect: DTW001
        accelerator.wait_for_everyone()  # expect: DTW001
        accelerator.check_trigger()  # expect: DTW001
        gather(preds)  # expect: DTW001
        broadcast(t, from_process=0)  # expect: DTW001
        reduce(t)  # expect: DTW001
        broadcast_object_list(objects)  # expect: DTW001
    if accelerator.is_local_main_process:
        accelerator.wait_for_everyone()  # expect: DTW001
    if accelerator.process_index == 0:
        accelerator.gather(preds)  # expect: DTW001
    if accelerator.is_last_process:
        accelerator.reduce(t)  # expect: DTW001


@accelerator.on_last_process
def last_only(t):
    accelerator.wait_for_everyone()  # expect: DTW001


def every_rank(model, preds, t, dataset):
    # Collectives on every rank, and only the side effects behind the rank test.
    all_preds = accelerator.gather_for_metrics(preds)
    accelerator.wait_for_everyone()
    accelerator.set_trigger()  # local: sets the flag check_trigger() reduces
    if accelerator.check_trigger():
        return all_preds
    if accelerator.is_main_process:
        print(all_preds)
        torch.save(model.state_dict(), "model.pt")
        accelerator.save(model.state_dict(), "model.pt")  # saves on the main process, no collective
        accelerate_save(model.state_dict(), "model.pt")
        accelerator.print("done")
        dataset.gather(t)  # not an accelerator: a dataset's own gather
    # Rank 0 goes first, then the others: every rank runs the body and both barriers.
    with accelerator.main_process_first():
        dataset = dataset.map(len)
    with accelerator.local_main_process_first():
        dataset = dataset.filter(len)
    return all_preds


@accelerator.on_main_process
def log_only(metrics):
    print(metrics)
