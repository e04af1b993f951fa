"""What one ``kit.Optimizer`` peer accumulated toward the current epoch: samples and gradients.

Holds :class:`GradientAccumulator`. It does not decide when the collaboration steps
(``kit.optim.progress``) nor averages anything (``kit.optim.rounds``).

DeDLOC's rule (Diskin et al., 2021, §3): every peer contributes its *mean* gradient over its
samples of the epoch, weighted by its sample count in the all-reduce, so the average is exactly
the mean gradient over the global batch. Here a micro-batch of ``batch_size`` samples adds its
gradient times ``batch_size`` (its loss is a mean over the micro-batch), and the mean is the sum
over the samples. With ``reuse_grad_buffers`` the gradients add up in ``.grad`` itself (no copy
of the model); each micro-batch then weighs the same, so their sizes should be equal.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)


def all_finite(tensors: Sequence[torch.Tensor | None]) -> bool:
    """Whether no element of ``tensors`` (None entries skipped) is inf or NaN, in one device sync.

    A sum is finite if every element is, and any inf or NaN makes it inf or NaN: so one read pass
    (the sums) answers for finite gradients, and only a non-finite sum (a bad element, or finite
    elements overflowing it) is checked element by element. On CPU ``torch.isfinite(g).all()``
    costs ~20x a sum (four passes and two temporaries): 10 ms a step for a 5M-parameter model,
    as much as its forward/backward (issue 21).
    """
    present = [t for t in tensors if t is not None and t.numel() > 0]
    if not present:
        return True
    device = present[0].device
    with torch.no_grad():
        sums = [t.sum(dtype=_sum_dtype(t)).to(device=device, dtype=torch.float64) for t in present]
        if bool(torch.isfinite(torch.stack(sums).sum())):
            return True
        flags = [torch.isfinite(t).all().to(device) for t in present]
        return bool(torch.stack(flags).all())


def _sum_dtype(tensor: torch.Tensor) -> torch.dtype:
    """float64 sums of float64 tensors, float32 of the rest (fp16's range overflows at 65504)."""
    return torch.float64 if tensor.dtype == torch.float64 else torch.float32


class GradientAccumulator:
    """Samples and gradients of this peer's current epoch.

    Args:
        params: the model's parameters (their ``.grad`` is read).
        reuse_grad_buffers: the gradients accumulate in ``.grad`` (kit clears it itself).
        buffered: keep float32 sums of the gradients (False: use local updates, auxiliary peers,
            or ``reuse_grad_buffers``, which need none).
    """

    def __init__(
        self, params: Sequence[torch.Tensor], *, reuse_grad_buffers: bool, buffered: bool
    ) -> None:
        self.params = list(params)
        self.reuse_grad_buffers = reuse_grad_buffers
        self.samples = 0  # samples accumulated toward the current epoch
        self.steps = 0  # micro-batches accumulated in .grad (reuse_grad_buffers)
        self._grad_scale = 1.0  # the loss scale of what .grad holds (reuse_grad_buffers with AMP)
        self._sums = (
            [torch.zeros_like(p, dtype=torch.float32) for p in self.params]
            if buffered and not reuse_grad_buffers
            else []
        )

    def add(self, batch_size: int, grad_scaler: Any = None) -> bool:
        """Count this micro-batch's gradient (in ``.grad``) toward the epoch.

        Returns:
            False if the gradient is not finite: it is skipped (never sent to peers), and the
            ``grad_scaler``'s scale is halved, as ``GradScaler.step`` would.
        """
        scale = 1.0 if grad_scaler is None else float(grad_scaler.get_scale())
        grads = [p.grad for p in self.params]
        if not all_finite(grads):
            logger.warning("skipping a step with non-finite gradients (it is not sent to peers)")
            if grad_scaler is not None:
                grad_scaler.update(scale / 2)
            if self.reuse_grad_buffers:  # the bad gradient is mixed into .grad: start over
                logger.warning(
                    "reuse_grad_buffers: the %d samples accumulated so far are dropped",
                    self.samples,
                )
                self.reset()
            return False
        if self.reuse_grad_buffers:
            self.steps += 1
            self._grad_scale = scale
        for total, grad in zip(self._sums, grads, strict=False):
            if grad is not None:
                total.add_(grad.detach().float(), alpha=batch_size / scale)
        self.samples += batch_size
        return True

    def mean_gradient(self, out: Sequence[torch.Tensor]) -> None:
        """This peer's mean gradient over its samples of the epoch, into ``out`` (float32 CPU)."""
        if self.reuse_grad_buffers:
            scale = 1.0 / (max(1, self.steps) * self._grad_scale)
            for buffer, param in zip(out, self.params, strict=True):
                if param.grad is None:
                    buffer.zero_()
                else:
                    buffer.copy_(param.grad.detach().float().cpu() * scale)
        else:
            for buffer, total in zip(out, self._sums, strict=True):
                buffer.copy_(total.cpu() / max(1, self.samples))

    def reset(self, *, clear_grads: bool = True) -> None:
        """Start the next epoch from nothing (``clear_grads``: also what ``.grad`` holds, with
        ``reuse_grad_buffers``; False when the optimizer step consumes it)."""
        self.samples = self.steps = 0
        for total in self._sums:
            total.zero_()
        if clear_grads and self.reuse_grad_buffers:
            self.clear_grads()

    def clear_grads(self) -> None:
        """Zero ``.grad`` (kept as a buffer with ``reuse_grad_buffers``: that is the point of
        reusing it; else dropped)."""
        self.zero_grad(set_to_none=not self.reuse_grad_buffers)

    def zero_grad(self, *, set_to_none: bool) -> None:
        """Clear ``.grad`` (``Optimizer.zero_grad``: between micro-batches the accumulator has
        taken them)."""
        for param in self.params:
            if param.grad is not None:
                if set_to_none:
                    param.grad = None
                else:
                    param.grad.detach_().zero_()
