"""Loss scaling (fp16 mixed precision) under ``kit.Optimizer``: any ``torch.amp.GradScaler``,
and ``kit.GradScaler``, hivemind's name for one.

fp16 gradients underflow unless the loss is multiplied by a large scale before backward
(Micikevicius et al. 2018, "Mixed Precision Training", §3.2); a dynamic scaler halves the scale
after a step with inf/NaN gradients and doubles it after ``growth_interval`` clean steps. With
``kit.Optimizer`` the caller does what plain PyTorch does::

    scaler.scale(loss).backward()
    opt.step(batch_size=n, grad_scaler=scaler)  # instead of scaler.step(opt)
    scaler.update()

and ``kit.Optimizer`` does what ``scaler.step`` would, on the tensors it averages: it unscales
each micro-batch's gradient exactly once (into its float32 sums, or, with
``reuse_grad_buffers``, the summed ``.grad`` once when the epoch's mean is taken), skips a
micro-batch with inf/NaN gradients (it never reaches the others), and records its inf/NaN check
in the scaler as ``scaler.unscale_`` would, so that ``scaler.update()`` backs the scale off or
counts a clean step, all on the device (no host synchronisation: :func:`record_check`).

Two things differ from a single-process loop, and this module holds both:

* With ``reuse_grad_buffers`` the gradients of a whole epoch add up in ``.grad`` at the scale of
  their backward, so the scale must not grow in the middle of an epoch (``.grad`` would mix two
  scales). :func:`hold_growth` keeps the scaler's count of clean steps one short of
  ``growth_interval`` until a global step has consumed ``.grad``: the scale then grows right
  after a global step, as ``hivemind.GradScaler`` ("limit increasing gradient scale to only
  immediately after global optimizer steps") does. A backoff needs no such care: an inf/NaN in
  ``.grad`` drops the epoch's gradients anyway.
* An averaged gradient that is not finite (a peer's overflow on the wire, a bad aggregate) is
  the same on every member of the round, so every member skips that optimizer step alike and
  backs its scale off (:func:`record_check` with an inf).

It reads three attributes of ``torch.amp.GradScaler`` that have no public accessor but have kept
their names since loss scaling came to PyTorch (1.6): the scale tensor (``_get_scale_async``),
the count of clean steps (``_growth_tracker``) and the per-optimizer inf checks that ``update``
consumes (``_per_optimizer_states``); ``tests/optim/test_grad_scaling.py`` checks them against
torch's own ``update``. It does not accumulate gradients (``kit.optim.accumulation``).
"""

from __future__ import annotations

from typing import Any

import torch


class GradScaler(torch.amp.GradScaler):
    """hivemind's ``GradScaler``, so a hivemind script ports by its import.

    ``kit.Optimizer.step(..., grad_scaler=...)`` works with any ``torch.amp.GradScaler`` (see
    the module), so this is torch's scaler with hivemind's arguments: those of
    ``torch.cuda.amp.GradScaler``, on CUDA when there is a GPU, else on the CPU.

    Args:
        init_scale, growth_factor, backoff_factor, growth_interval, enabled: as torch's.
            Lower ``init_scale`` (e.g. 2**10) if the first steps of a run are all skipped
            with "non-finite gradients" warnings.
        device: "cuda", "cpu", ... (default: "cuda" if available, else "cpu").
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        device: str | None = None,
    ) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        super().__init__(
            device,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
        )


def current_scale(scaler: Any) -> torch.Tensor | None:
    """The scaler's scale as a tensor on its device, read without a host synchronisation.

    None without a scaler, for a disabled one, and before its first ``scale()`` call (then no
    gradient was scaled).
    """
    if scaler is None or not scaler.is_enabled():
        return None
    scale = scaler._get_scale_async()
    return scale if isinstance(scale, torch.Tensor) else None


def record_check(scaler: Any, key: object, found_inf: torch.Tensor) -> None:
    """Record an inf/NaN check (``found_inf``: a float tensor, > 0 if inf/NaN were found) for
    ``key`` in ``scaler``, as ``scaler.unscale_`` records its own: the next ``scaler.update()``
    then backs the scale off, or counts a clean step. Several checks before one update add up.
    """
    scale = current_scale(scaler)
    if scale is None:
        return
    found = found_inf.detach().to(device=scale.device, dtype=torch.float32).reshape(())
    per_device = scaler._per_optimizer_states[id(key)]["found_inf_per_device"]
    earlier = per_device.get(scale.device)
    per_device[scale.device] = found if earlier is None else earlier + found


def hold_growth(scaler: Any) -> None:
    """Keep the scale from growing at the next ``update()``: its count of clean steps stays one
    short of ``growth_interval`` (``reuse_grad_buffers``: ``.grad`` holds part of an epoch at
    this scale; see the module). One small kernel on the device, no synchronisation."""
    if current_scale(scaler) is None:
        return
    tracker = scaler._growth_tracker
    if isinstance(tracker, torch.Tensor):  # (-1 with growth_interval 1: the update makes it 0)
        tracker.clamp_(max=scaler.get_growth_interval() - 2)


def found_inf_tensor(found: bool, like: torch.Tensor | None) -> torch.Tensor:
    """A check result as the scaler takes it: 1.0 if inf/NaN were found, on ``like``'s device."""
    device = like.device if like is not None else torch.device("cpu")
    return torch.full((), 1.0 if found else 0.0, dtype=torch.float32, device=device)
