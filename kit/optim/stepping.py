"""Where ``kit.Optimizer``'s inner optimizer steps: on the model's parameters, on float32 CPU
copies of them (``offload_optimizer``), and in a background thread (``delay_optimizer_step``).

Holds :class:`InnerOptimizer`. It does not decide *when* to step or with which gradient
(``kit.optim.optimizer``), nor averages anything.

Delayed steps (hivemind's ``delay_optimizer_step``): the optimizer owns copies of the parameters
("master" parameters), so its thread never writes a tensor the training loop reads. The model's
parameters take the result at the next safe point (``finish``, called from ``Optimizer.step``
after the caller's backward and before its next forward): the batches computed meanwhile used
the previous parameters, one step stale, which DeDLOC-style training tolerates.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from kit.averaging.background_threads import limit_torch_threads


class InnerOptimizer:
    """The wrapped torch optimizer, its parameters, and at most one step in flight.

    Args:
        optimizer: a torch optimizer over the model's parameters, or a factory of one.
        params: the parameters (or groups) for a factory.
        copies: the optimizer works on float32 CPU copies (needs a factory).
        delay: steps run in a background thread (implies ``copies``).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer | Callable[[Any], torch.optim.Optimizer],
        params: Iterable[Any] | None,
        *,
        copies: bool,
        delay: bool,
    ) -> None:
        if isinstance(optimizer, torch.optim.Optimizer):
            self.opt = optimizer
            self.params = [p for group in optimizer.param_groups for p in group["params"]]
        else:
            groups = _param_groups(params)
            self.params = [p for group in groups for p in group["params"]]
            if copies or delay:
                masters = iter([_master_copy(p) for p in self.params])
                groups = [{**g, "params": [next(masters) for _ in g["params"]]} for g in groups]
            self.opt = optimizer(groups)
        self.master = [p for group in self.opt.param_groups for p in group["params"]]
        self.has_copies = any(m is not p for m, p in zip(self.master, self.params, strict=True))
        self._executor = (
            concurrent.futures.ThreadPoolExecutor(
                1, "kit-optimizer-step", initializer=limit_torch_threads
            )
            if delay
            else None
        )
        self._pending: concurrent.futures.Future[None] | None = None

    @property
    def pending(self) -> bool:
        """A delayed step runs (or ran and was not applied to the model yet)."""
        return self._pending is not None

    def set_gradients(self, gradients: Sequence[torch.Tensor], *, reuse_grad_buffers: bool) -> None:
        """Give the optimizer ``gradients`` (copied) for its next step."""
        for param, master, gradient in zip(self.params, self.master, gradients, strict=True):
            master.grad = gradient.to(device=master.device, dtype=master.dtype).clone()
            if reuse_grad_buffers and master is not param and param.grad is not None:
                param.grad.zero_()  # consumed: accumulation starts over in the same buffer

    def step(
        self,
        apply: bool,
        scheduler: Any,
        *,
        reuse_grad_buffers: bool,
        before: Callable[[], bool] | None = None,
    ) -> None:
        """The optimizer's step (if ``apply``) and the scheduler's: now, or in the thread.

        ``before`` runs first, in the same place (``delay_grad_averaging``: the gradient round,
        which then gives the optimizer its gradients); False from it skips the optimizer's step
        (the averaged gradient was not finite).
        """

        def run() -> None:
            go = apply
            if before is not None:
                go = before() and apply
            if go:
                self.opt.step()
                for master in self.master:
                    if reuse_grad_buffers and master.grad is not None:
                        master.grad.zero_()
                    else:
                        master.grad = None  # the next backward must not add to the average
            if scheduler is not None:
                scheduler.step()

        if self._executor is None:
            run()
            self.copy_to_model()
        else:
            self._pending = self._executor.submit(run)

    def finish(self, wait: float | None) -> bool:
        """Apply a delayed step to the model if it is over (waiting ``wait`` s, None: until it is).

        Returns:
            True if a step landed now (the caller shares the new state).

        Raises:
            whatever the optimizer's step raised.
        """
        pending = self._pending
        if pending is None:
            return False
        try:
            pending.result(timeout=wait)
        except concurrent.futures.TimeoutError:
            return False
        finally:
            if pending.done():
                self._pending = None
        self.copy_to_model()
        return True

    def copy_to_model(self) -> None:
        if self.has_copies:
            with torch.no_grad():
                for param, master in zip(self.params, self.master, strict=True):
                    param.copy_(master)

    def load(self, params: Sequence[torch.Tensor]) -> None:
        """Set the model's parameters (and the optimizer's copies) to ``params``."""
        with torch.no_grad():
            for mine, master, theirs in zip(self.params, self.master, params, strict=True):
                mine.copy_(theirs.to(device=mine.device, dtype=mine.dtype))
                if master is not mine:
                    master.copy_(theirs.to(device=master.device, dtype=master.dtype))

    def add(self, deltas: Sequence[torch.Tensor]) -> None:
        """Move the model's parameters (and the optimizer's copies) by ``deltas``."""
        with torch.no_grad():
            for mine, master, delta in zip(self.params, self.master, deltas, strict=True):
                mine.add_(delta.to(device=mine.device, dtype=mine.dtype))
                if master is not mine:
                    master.add_(delta.to(device=master.device, dtype=master.dtype))

    def shutdown(self) -> None:
        try:
            self.finish(wait=None)
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)


def _param_groups(params: Iterable[Any] | None) -> list[dict[str, Any]]:
    """Parameters or groups (as torch.optim takes them) as a list of group dicts."""
    items = list(params or ())
    if items and isinstance(items[0], dict):
        return [dict(group, params=list(group["params"])) for group in items]
    return [{"params": items}]


def _master_copy(param: torch.Tensor) -> torch.Tensor:
    """A float32 CPU copy of ``param`` for the optimizer to own (offload / delayed steps)."""
    return param.detach().to(device="cpu", dtype=torch.float32).clone()
