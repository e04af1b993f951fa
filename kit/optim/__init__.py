"""kit.optim: DeDLOC's collaborative optimizer (hivemind.Optimizer's interface).

Read in this order: ``epochs`` (the epoch life of a peer: a pure state machine) →
``progress`` (who has how many samples; when the next global step is) →
``state`` (snapshots of the training state, served to and downloaded by late joiners) →
``state_averaging`` (when parameters need averaging; delayed rounds applied as deltas) →
``stepping`` (where the inner optimizer steps: in place, on CPU copies, in a thread) →
``grad_scaling`` (fp16 loss scales: any torch GradScaler, hivemind's ``GradScaler``) →
``rounds`` (the gradient rounds, tagged with their epoch) →
``sharing`` (publishing the state, downloading it, refreshing it in the background) →
``landing`` (where a state lands: ours served, a donor's loaded, a refresh, a download) →
``driver`` (feeds the epoch machine, carries out its actions) →
``arguments`` (hivemind's arguments: accepted, refused) →
``optimizer`` (``kit.Optimizer``: the public API, its parts composed).
"""

from kit.optim.grad_scaling import GradScaler
from kit.optim.optimizer import Optimizer
from kit.optim.progress import GlobalProgress, LocalProgress, ProgressTracker

__all__ = ["GlobalProgress", "GradScaler", "LocalProgress", "Optimizer", "ProgressTracker"]
