"""kit.training: what a peer trains and how (torch).

Read in this order: ``status`` (the snapshot the UI draws, torch-free) → ``lamb`` (the LAMB
optimizer) → ``components`` (model, optimizer, schedule, codecs and ``kit.Optimizer`` from a
``RunConfig``) → ``trainer`` (the local training loop) → ``checkpoints`` (saving, pushing to the
Hub, restoring).
"""

from kit.training.status import TrainingState, TrainingStatus

__all__ = ["TrainingState", "TrainingStatus"]
