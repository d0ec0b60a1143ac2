"""Lightning (Trainer, LightningModule, strategies) and Fabric: collectives and rank tests."""
import torch
from lightning.fabric import Fabric
from lightning.pytorch import LightningModule
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities import rank_zero_only


class Model(LightningModule):
    def validation_step(self, batch, batch_idx):
        loss = self(batch).sum()
        self.log("val_loss", loss, sync_dist=True)  # every rank: fine
        if self.global_rank == 0:
            self.log("rank0_loss", loss, sync_dist=True)  # expect: DTW001
            self.all_gather(loss)  # expect: DTW001
            self.trainer.strategy.broadcast(loss)  # expect: DTW001
            self.trainer.strategy.barrier()  # expect: DTW001
            self.trainer.strategy.reduce_boolean_decision(True)  # expect: DTW001
            path = self.trainer.log_dir  # expect: DTW001
            self.trainer.save_checkpoint(path)  # expect: DTW001
            self.log("rank0_only", loss, rank_zero_only=True)  # not synced: fine
        return loss

    def on_validation_epoch_end(self):
        log_dir = self.trainer.log_dir  # every rank: fine
        gathered = self.all_gather(torch.zeros(1))
        if self.trainer.is_global_zero:
            print(log_dir, gathered)
            print(self.logger.log_dir)  # a logger's own directory: no broadcast
            self.logger.save()  # not a Trainer or Fabric
            torch.save(gathered, "gathered.pt")

    @rank_zero_only
    def log_metrics(self, metrics):
        print(metrics)  # only logging: fine

    @rank_zero_only
    def save_and_sync(self, trainer):
        trainer.strategy.barrier()  # expect: DTW001


class Logger:
    @property
    @rank_zero_experiment
    def experiment(self):
        return self.trainer.log_dir  # expect: DTW001


def fit(trainer, model):
    trainer.fit(model)
    if trainer.is_global_zero:
        trainer.strategy.barrier("after fit")  # expect: DTW001
        print(trainer.callback_metrics)


def train(fabric: Fabric, model, state, loss):
    fabric.barrier()
    fabric.save("checkpoint.ckpt", state)  # every rank: fine
    if fabric.is_global_zero:
        fabric.barrier()  # expect: DTW001
        fabric.broadcast(loss)  # expect: DTW001
        fabric.all_gather(loss)  # expect: DTW001
        fabric.all_reduce(loss)  # expect: DTW001
        fabric.save("checkpoint.ckpt", state)  # expect: DTW001
        fabric.print("saved")
        torch.save(state, "plain.pt")
    if fabric.global_rank == 0:
        fabric.load("checkpoint.ckpt", state)  # expect: DTW001
        torch.load("plain.pt")
    if fabric.local_rank == 0:
        fabric.log("loss", loss)  # a logger call: no collective
    with fabric.rank_zero_first():  # rank 0 first, then the others: every rank runs the body
        model.prepare_data()
