"""A tiny stand-in for a training library (the runner installs it under a ``site-packages`` directory,
so its frames are library frames): the patterns of Lightning Fabric, Accelerate and trainer callbacks
that issue collectives on the user's behalf, written from scratch."""
from .fabric import Fabric
from .accel import Accelerator
from .callbacks import EarlyStopping

__all__ = ["Fabric", "Accelerator", "EarlyStopping"]
