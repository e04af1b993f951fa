"""Every GPU of one machine in one peer: a model replica per device, gradients summed locally.

Kaggle's "GPU T4 x2" gives a volunteer two GPUs. Two peers on one machine would double the
swarm's connections and averaging traffic for nothing; instead one peer trains on both, as TTT's
trainer did (``batch_size_per_step = per_device x accumulation x n_gpu``, recipes.md §4.3):

* the main model lives on the first device; :class:`Replicas` keeps a copy on every other one and
  refreshes it from the main model before each local step (the optimizer changes only the main);
* each micro-step, every replica runs forward and backward on its own micro-batch, in its own
  thread (each device computes at once, as ``torch.nn.parallel`` does), with the loss divided by
  the number of micro-batches in the step, so the summed gradient is the step's mean;
* the replicas' gradients are added into the main model's ``.grad`` and cleared: the optimizer
  sees one gradient, and ``kit.Optimizer`` counts the step's samples once.

Not data-parallel training across machines (that is the swarm's job); no NCCL, no process
group: a copy between devices per step (the parameters one way, the gradients the other) costs
~2 x 72 MB for ALBERT-large, a few milliseconds on PCIe next to a step of a second or more.
It has not run on real GPUs yet (this project's CI has none): the CPU test checks that two
replicas give the gradient of one model on the doubled batch.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch

Batch = dict[str, torch.Tensor]
#: ``loss(model, batch, device)``: the model's training loss on a CPU batch, moved to ``device``.
LossFunction = Callable[[torch.nn.Module, Batch, torch.device], torch.Tensor]


def model_loss(model: torch.nn.Module, batch: Batch, device: torch.device) -> torch.Tensor:
    """Any model whose forward takes the batch's tensors and returns ``.loss`` (transformers)."""
    moved = {name: tensor.to(device, non_blocking=True) for name, tensor in batch.items()}
    return model(**moved).loss


class Replicas:
    """The main model plus one copy per further device.

    Args:
        model: the main model, already on ``devices[0]``.
        devices: one device per replica, the main model's first (e.g. ``("cuda:0", "cuda:1")``).
        loss: computes a replica's loss on its batch (default :func:`model_loss`; ALBERT
            pretraining uses ``kit.training.albert_speed``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        devices: Sequence[str | torch.device],
        *,
        loss: LossFunction = model_loss,
    ) -> None:
        if not devices:
            devices = (next(model.parameters()).device,)
        self.devices = [torch.device(device) for device in devices]
        self.loss = loss
        self.main = model
        self.models = [model] + [copy.deepcopy(model).to(device) for device in self.devices[1:]]
        self._main_params = list(model.parameters())
        self._pool = (
            concurrent.futures.ThreadPoolExecutor(len(self.models), "kit-replica")
            if len(self.models) > 1
            else None
        )

    def __len__(self) -> int:
        return len(self.models)

    def train(self) -> None:
        for model in self.models:
            model.train()

    @torch.no_grad()
    def sync_parameters(self) -> None:
        """Copy the main model's parameters into every other replica."""
        for model in self.models[1:]:
            for mine, main in zip(model.parameters(), self._main_params, strict=True):
                mine.copy_(main, non_blocking=True)

    def forward_backward(
        self,
        batches: Sequence[Batch],
        divisor: float,
        *,
        autocast: Callable[[torch.device], contextlib.AbstractContextManager[Any]] | None = None,
        scale: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """One micro-step on every replica: ``batches[i]`` on replica ``i``.

        Args:
            batches: one batch per replica (CPU tensors; fewer batches use fewer replicas).
            divisor: each loss is divided by this before backward (micro-batches per step).
            autocast: makes the mixed-precision context of a device (None: fp32).
            scale: the GradScaler's ``scale`` (fp16), applied before backward.

        Returns:
            The sum of the replicas' (undivided) losses, on the main device (not synchronized).
        """

        def run(index: int) -> torch.Tensor:
            model, device = self.models[index], self.devices[index]
            context = autocast(device) if autocast is not None else contextlib.nullcontext()
            with context:
                loss = self.loss(model, batches[index], device)
            scaled = loss / divisor
            (scale(scaled) if scale is not None else scaled).backward()
            return loss.detach().float()

        count = min(len(batches), len(self.models))
        if self._pool is None or count == 1:
            losses = [run(index) for index in range(count)]
        else:
            losses = list(self._pool.map(run, range(count)))
        total = losses[0]
        for loss in losses[1:]:
            total = total + loss.to(total.device)
        return total

    @torch.no_grad()
    def gather_gradients(self) -> None:
        """Add every replica's gradient into the main model's ``.grad``, and clear theirs."""
        for model in self.models[1:]:
            for main, mine in zip(self._main_params, model.parameters(), strict=True):
                if mine.grad is None:
                    continue
                grad = mine.grad.to(main.device, non_blocking=True)
                if main.grad is None:
                    main.grad = grad.clone()
                else:
                    main.grad.add_(grad)
                mine.grad = None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
