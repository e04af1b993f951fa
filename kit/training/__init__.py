"""kit.training: what a peer trains and how (torch).

Read in this order: ``status`` (the snapshot the UI draws, torch-free) → ``lamb`` (the LAMB
optimizer) → ``components`` (model, optimizer, schedule, codecs and ``kit.Optimizer`` from a
``RunConfig``) → ``calculator`` (the organizer's memory table) → ``trainer`` (the local training loop) → ``training_state`` (optimizer state on
disk, no pickle) → ``checkpoint_folder`` (one checkpoint, written atomically), ``checkpoint_hub``
(pushes, downloads) → ``checkpoints`` (when to save, push, restore) → ``auxiliary`` (the
coordinator's peer).
"""

from kit.training.status import TrainingState, TrainingStatus

__all__ = ["TrainingState", "TrainingStatus"]
