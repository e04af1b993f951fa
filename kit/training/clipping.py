"""Gradient clipping to one global L2 norm, in fused kernels and without a host synchronisation.

Holds :func:`clip_grad_norm`: what ``torch.nn.utils.clip_grad_norm_`` computes (the norm of all
gradients together; every gradient multiplied by ``min(1, max_norm / (norm + 1e-6))``), with
nothing read on the host (no ``error_if_nonfinite``, and the same on every torch kit supports):
on a GPU a read waits for the queue to drain. TTT clipped the averaged gradient to 4.0 inside its
LAMB step (recipes.md §4.3): ``kit.training.lamb`` calls this. A peer's local clipping
(sahajBERT's 1.0, §3.1) is fused into the accumulation instead (``kit.optim.accumulation``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch

from kit.optim.accumulation import clip_coefficient, global_norm


@torch.no_grad()
def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor | None:
    """Clip the gradients of ``params`` in place to a global L2 norm of ``max_norm``.

    Returns:
        The total norm of the gradients before clipping, on the first gradient's device (not
        read); None without gradients.
    """
    grads = [param.grad for param in params if param.grad is not None]
    if not grads:
        return None
    total = global_norm(grads)
    coefficient = clip_coefficient(total, max_norm, None)
    by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
    for grad in grads:
        by_device[grad.device].append(grad)
    for device, same in by_device.items():
        torch._foreach_mul_(same, coefficient.to(device))
    return total
