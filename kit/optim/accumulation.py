"""What one ``kit.Optimizer`` peer accumulated toward the current epoch: samples and gradients.

Holds :class:`GradientAccumulator` and :func:`all_finite`. It does not decide when the
collaboration steps (``kit.optim.progress``) nor averages anything (``kit.optim.rounds``).

DeDLOC's rule (Diskin et al., 2021, §3): every peer contributes its *mean* gradient over its
samples of the epoch, weighted by its sample count in the all-reduce, so the average is exactly
the mean gradient over the global batch. Here a micro-batch of ``batch_size`` samples adds its
gradient times ``batch_size`` (its loss is a mean over the micro-batch), and the mean is the sum
over the samples. With ``reuse_grad_buffers`` the gradients add up in ``.grad`` itself (no copy
of the model); each micro-batch then weighs the same, so their sizes should be equal.

Loss scaling (fp16): each micro-batch's gradient is unscaled once, by the scale of its backward
(``kit.optim.grad_scaling``), and its inf/NaN check is recorded in the scaler for its
``update()``. A micro-batch with inf/NaN gradients is skipped: it never reaches the others (with
``reuse_grad_buffers`` it spoiled ``.grad``, so the epoch's gradients so far are dropped).

Deferred checks (``deferred=True``, the default for gradients on a GPU): reading whether a
gradient is finite is a host synchronisation, and one per micro-batch stalls a GPU's queue (the
next forward is only issued once the GPU has drained it: 14% of sahajBERT's time on an H200).
Then the check stays on the device: the micro-batch is added masked by it (nothing of a bad one
reaches the sums), its samples are counted at once, and the flag is read one micro-batch later,
when the GPU is busy with the next one (:meth:`GradientAccumulator.settle`), or at the global step
(:meth:`GradientAccumulator.mean_gradient`), correcting the count if it was bad.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from kit.errors import KitUsageError
from kit.optim.grad_scaling import current_scale, found_inf_tensor, record_check

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


def global_norm(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all of ``tensors`` together, a 0-dim float32 tensor on the first one's
    device, read nowhere (one fused pass per device on CUDA). It is finite exactly when every
    element is, but for finite elements so large that the norm overflows float32 (garbage)."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_device.setdefault(tensor.device, []).append(
            tensor.float() if tensor.dtype == torch.float64 else tensor
        )
    first = tensors[0].device
    norms = [
        n.to(first, torch.float32) for same in by_device.values() for n in torch._foreach_norm(same)
    ]
    return torch.linalg.vector_norm(torch.stack(norms))


def finite_on_device(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """A 0-dim bool tensor, True if no element of ``tensors`` is inf or NaN (see
    :func:`global_norm`), without a host synchronisation."""
    return torch.isfinite(global_norm(tensors))


def clip_coefficient(
    norm: torch.Tensor, max_norm: float, scale: torch.Tensor | None
) -> torch.Tensor:
    """``min(1, max_norm / norm)`` for gradients of norm ``norm`` that carry the loss scale
    ``scale`` (torch.nn.utils.clip_grad_norm_'s rule, its 1e-6 included), on the device."""
    limit = torch.full((), float(max_norm), device=norm.device)
    if scale is not None:
        limit = limit * scale.to(norm.device, torch.float32)
    return torch.clamp(limit / (norm + 1e-6), max=1.0)


def _sum_dtype(tensor: torch.Tensor) -> torch.dtype:
    """float64 sums of float64 tensors, float32 of the rest (fp16's range overflows at 65504)."""
    return torch.float64 if tensor.dtype == torch.float64 else torch.float32


@dataclasses.dataclass
class _DeferredCheck:
    """A micro-batch counted before its inf/NaN check was read (see the module)."""

    ok: torch.Tensor  # 0-dim bool on the device: its gradient was finite
    samples: int  # its samples
    through: int  # with reuse_grad_buffers: the epoch's samples up to and including it


class GradientAccumulator:
    """Samples and gradients of this peer's current epoch.

    Args:
        params: the model's parameters (their ``.grad`` is read).
        reuse_grad_buffers: the gradients accumulate in ``.grad`` (kit clears it itself).
        buffered: keep float32 sums of the gradients (False: use local updates, auxiliary peers,
            or ``reuse_grad_buffers``, which need none).
        deferred: read inf/NaN checks one micro-batch late (see the module); default: when the
            parameters live on an accelerator, where a read stalls the device's queue.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        *,
        reuse_grad_buffers: bool,
        buffered: bool,
        deferred: bool | None = None,
    ) -> None:
        self.params = list(params)
        self.reuse_grad_buffers = reuse_grad_buffers
        self.buffered = buffered and not reuse_grad_buffers
        if deferred is None:
            deferred = any(p.device.type != "cpu" for p in self.params)
        self.deferred = deferred
        self.samples = 0  # samples accumulated toward the current epoch (see settle())
        self.steps = 0  # micro-batches accumulated in .grad (reuse_grad_buffers)
        # The loss scale of what .grad holds (reuse_grad_buffers with AMP): a float, or the
        # scaler's tensor when the check is deferred (read at the global step only).
        self._grad_scale: float | torch.Tensor = 1.0
        self._sums = [torch.zeros_like(p, dtype=torch.float32) for p in self.params]
        if not self.buffered:
            self._sums = []
        self._pending: deque[_DeferredCheck] = deque()

    def add(
        self,
        batch_size: int,
        grad_scaler: Any = None,
        *,
        decide: bool = False,
        clip_norm: float | None = None,
    ) -> bool:
        """Count this micro-batch's gradient (in ``.grad``) toward the epoch.

        Args:
            batch_size: its samples.
            grad_scaler: the ``torch.amp.GradScaler`` whose scale is in ``.grad`` (or None).
            decide: the caller needs the answer now (local updates step on ``.grad`` at once,
                unscaled in place here): no deferred check.
            clip_norm: clip this gradient to this global L2 norm (unscaled) as it is added:
                the norm that clips it is the inf/NaN check too, and its factor goes into the
                weight of the one pass that adds it (sahajBERT's local clipping, by
                ``torch.nn.utils.clip_grad_norm_``'s rule). Not with ``reuse_grad_buffers``
                (``.grad`` then holds the whole epoch).

        Returns:
            False if the gradient is not finite: it is skipped (never sent to peers), and the
            check is recorded in ``grad_scaler`` (its ``update()`` backs the scale off). With
            a deferred check, True at once; :meth:`settle` corrects the count later.

        Raises:
            KitUsageError: ``clip_norm`` with ``reuse_grad_buffers``.
        """
        if clip_norm is not None and self.reuse_grad_buffers:
            raise KitUsageError(
                "clipping each step's gradient needs it apart from the others, and with "
                "reuse_grad_buffers .grad holds the whole epoch - help: clip the averaged "
                "gradient inside the optimizer instead (optimizer.max_grad_norm)"
            )
        if self.deferred and not decide:
            self._add_deferred(batch_size, grad_scaler, clip_norm)
            return True
        scale_tensor = current_scale(grad_scaler)
        scale = 1.0 if scale_tensor is None else float(scale_tensor)
        grads = [p.grad for p in self.params]
        present = [g for g in grads if g is not None]
        coefficient = 1.0
        if clip_norm is not None and present:
            norm = global_norm(present)  # (an overflowing norm counts as non-finite)
            finite = bool(torch.isfinite(norm))
            if finite:
                coefficient = float(clip_coefficient(norm, clip_norm, scale_tensor))
        else:
            finite = all_finite(grads)
        if grad_scaler is not None:
            record_check(grad_scaler, self, found_inf_tensor(not finite, scale_tensor))
        if not finite:
            logger.warning("skipping a step with non-finite gradients (it is not sent to peers)")
            if self.reuse_grad_buffers:  # the bad gradient is mixed into .grad: start over
                self._drop_epoch(self.samples)
            return False
        if self.reuse_grad_buffers:
            self.steps += 1
            self._grad_scale = scale
        elif decide and (scale != 1.0 or coefficient != 1.0) and present:
            with torch.no_grad():  # local updates: the inner optimizer reads .grad itself
                torch._foreach_mul_(present, coefficient / scale)
        for total, grad in zip(self._sums, grads, strict=False):
            if grad is not None:
                total.add_(grad.detach().float(), alpha=batch_size * coefficient / scale)
        self.samples += batch_size
        return True

    @torch.no_grad()
    def _add_deferred(self, batch_size: int, grad_scaler: Any, clip_norm: float | None) -> None:
        pairs = [(i, p.grad) for i, p in enumerate(self.params) if p.grad is not None]
        grads = [grad for _, grad in pairs]
        scale = current_scale(grad_scaler)
        norm = global_norm(grads) if grads else torch.zeros(())
        ok = torch.isfinite(norm)
        if self.reuse_grad_buffers:
            # An inf/NaN spoiled .grad: clear it on the device (the epoch so far is dropped).
            for grad in grads:
                grad.masked_fill_(~ok, 0.0)
            self.steps += 1
            self._grad_scale = 1.0 if scale is None else scale
            through = self.samples + batch_size
        else:
            weight = torch.full((), float(batch_size), device=ok.device)
            if scale is not None:
                weight = weight * scale.double().reciprocal().float().to(ok.device)
            if clip_norm is not None:  # (NaN for a non-finite norm: masked below)
                weight = torch.where(ok, weight * clip_coefficient(norm, clip_norm, scale), 0.0)
            for index, grad in pairs if self._sums else ():  # where(): NaN x 0 is still NaN
                self._sums[index].addcmul_(torch.where(ok, grad, 0.0), weight)
            through = 0
        if grad_scaler is not None:
            record_check(grad_scaler, self, (~ok).float())
        self.samples += batch_size
        self._pending.append(_DeferredCheck(ok, batch_size, through))
        self.settle(keep=1)  # the previous micro-batch's check: its kernels are done by now

    def settle(self, keep: int = 0) -> None:
        """Read the deferred checks, all but the newest ``keep`` (each read waits for that
        micro-batch's kernels only), and take bad micro-batches out of the count."""
        while len(self._pending) > keep:
            check = self._pending.popleft()
            if bool(check.ok):
                continue
            logger.warning("skipping a step with non-finite gradients (it is not sent to peers)")
            if self.reuse_grad_buffers:
                self._drop_epoch(check.through, cleared=True)
            else:
                self.samples -= check.samples

    def _drop_epoch(self, samples: int, *, cleared: bool = False) -> None:
        """``reuse_grad_buffers``: the first ``samples`` of the epoch are lost with ``.grad``."""
        logger.warning("reuse_grad_buffers: the %d samples accumulated so far are dropped", samples)
        if not cleared:
            self.reset()
            return
        self.samples -= samples
        for later in self._pending:
            later.through -= samples
        self.steps = sum(1 for _ in self._pending)

    def mean_gradient(self, out: Sequence[torch.Tensor]) -> None:
        """This peer's mean gradient over its samples of the epoch, into ``out`` (float32 CPU)."""
        self.settle()
        if self.reuse_grad_buffers:
            divisor = max(1, self.steps) * self._grad_scale
            for buffer, param in zip(out, self.params, strict=True):
                if param.grad is None:
                    buffer.zero_()
                else:
                    buffer.copy_((param.grad.detach().float() / divisor).cpu())
        else:
            for buffer, total in zip(out, self._sums, strict=True):
                buffer.copy_(total.cpu() / max(1, self.samples))

    def reset(self, *, clear_grads: bool = True) -> None:
        """Start the next epoch from nothing (``clear_grads``: also what ``.grad`` holds, with
        ``reuse_grad_buffers``; False when the optimizer step consumes it)."""
        self.samples = self.steps = 0
        self._pending.clear()
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
