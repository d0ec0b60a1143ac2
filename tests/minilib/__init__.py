"""A tiny stand-in for a training library (the runner installs it under a ``site-packages`` directory,
so its frames are library frames): the patterns of Lightning Fabric, Accelerate and trainer callbacks
that issue collectives on the user's behalf, written from scratch."""
from .accel import Accelerator
from .callbacks import EarlyStopping
from .fabric import Fabric
from .runner import run_job
from .trainer import Module, Trainer

__all__ = ["Fabric", "Accelerator", "EarlyStopping", "Module", "Trainer", "run_job"]
