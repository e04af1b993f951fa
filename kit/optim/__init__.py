"""kit.optim: DeDLOC's collaborative optimizer (hivemind.Optimizer's interface).

Read in this order: ``progress`` (who has how many samples; when the next global step is) →
``state`` (snapshots of the training state, served to and downloaded by late joiners) →
``optimizer`` (``kit.Optimizer``: accumulate, average, step).
"""

from kit.optim.optimizer import Optimizer
from kit.optim.progress import GlobalProgress, LocalProgress, ProgressTracker

__all__ = ["GlobalProgress", "LocalProgress", "Optimizer", "ProgressTracker"]
