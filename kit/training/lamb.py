"""LAMB: layer-wise adaptive moments for large global batches (You et al. 2020, Alg. 2).

sahajBERT trained with ``torch_optimizer.Lamb(debias=True, clamp_value=10000)`` at a global batch
of 4096 sequences (DeDLOC §4.2); Training Transformers Together with the same LAMB without bias
correction (the paper's v3) and global gradient clipping inside the step. :class:`Lamb` computes
exactly what ``torch_optimizer.Lamb`` computes (tested against it: ``tests/training/test_lamb.py``):

* ``m``, ``v``: Adam's moving averages, kept *uncorrected*;
* ``u = m / (sqrt(v) + eps) + weight_decay * w``, and the trust ratio ``‖w‖ / ‖u‖`` (the weight
  norm clamped to ``clamp_value``; 1 when either norm is 0, e.g. zero-initialized biases);
* with ``debias``, the *step size* is scaled by ``sqrt(1 - beta2^t) / (1 - beta1^t)`` after the
  trust ratio. (Bias-correcting m and v themselves would be cancelled by the trust ratio, which
  is scale-free: a different optimizer, 3-5x larger first steps.)

This module holds the update shared by the fp32 :class:`Lamb` and the 8-bit one
(``kit.training.lamb8bit``) and global clipping; which parameters decay is decided by
:func:`kit.training.components.parameter_groups`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from kit.errors import ConfigError
from kit.training.clipping import clip_grad_norm


def check_lamb_arguments(
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    clamp_value: float,
    max_grad_norm: float | None,
) -> None:
    """Raise ConfigError (with a hint) for hyperparameters LAMB cannot use."""
    if not lr > 0 or not 0 <= betas[0] < 1 or not 0 <= betas[1] < 1 or not eps > 0:
        raise ConfigError(
            f"Lamb: bad hyperparameters lr={lr}, betas={betas}, eps={eps}"
            " - help: use lr > 0, betas in [0, 1), eps > 0"
        )
    if weight_decay < 0 or clamp_value <= 0:
        raise ConfigError(
            f"Lamb: weight_decay={weight_decay} and clamp_value={clamp_value}"
            " - help: use weight_decay >= 0 and clamp_value > 0"
        )
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ConfigError(
            f"Lamb: max_grad_norm={max_grad_norm} - help: use a positive norm (TTT: 4.0) or None"
        )


def step_size(group: dict[str, Any], step: int) -> float:
    """``lr``, times ``sqrt(1 - beta2^t) / (1 - beta1^t)`` with ``debias`` (torch_optimizer's)."""
    if not group["debias"]:
        return float(group["lr"])
    beta1, beta2 = group["betas"]
    return float(group["lr"]) * math.sqrt(1 - beta2**step) / (1 - beta1**step)


def _trust_ratio(weight_norm: torch.Tensor, update_norm: torch.Tensor) -> torch.Tensor:
    """``‖w‖ / ‖u‖`` (You et al. 2020, eq. 6), 1 where either norm is zero (fresh zero biases);
    on the device (``torch.where``: no host read of the norms, unlike an ``if``)."""
    zero = (weight_norm == 0) | (update_norm == 0)
    return torch.where(zero, torch.ones_like(weight_norm), weight_norm / update_norm)


@torch.no_grad()
def apply_lamb_update(
    param: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    group: dict[str, Any],
    step: int,
) -> None:
    """Move ``param`` by LAMB's step from its (already updated) moments ``exp_avg``/``exp_avg_sq``.

    The operations and their order are torch_optimizer's, so the float32 results agree to
    rounding; the trust ratio stays a 0-dim tensor on the device (no host synchronisation).
    """
    weight = param if param.dtype == torch.float32 else param.float()
    weight_norm = torch.norm(weight).clamp(0, group["clamp_value"])
    adam_step = exp_avg / exp_avg_sq.sqrt().add(group["eps"])
    if group["weight_decay"] != 0:
        adam_step.add_(weight, alpha=group["weight_decay"])
    scale = _trust_ratio(weight_norm, torch.norm(adam_step)) * -step_size(group, step)
    if param.dtype == torch.float32:
        param.addcmul_(adam_step, scale)
    else:
        param.add_((adam_step * scale).to(param.dtype))


def clip_global_grad_norm(optimizer: torch.optim.Optimizer, max_norm: float | None) -> None:
    """Clip the gradients of all the optimizer's parameters to one global L2 norm (TTT's
    ``max_grad_norm`` inside the step: it acts on the *averaged* gradient, not a local one)."""
    if max_norm is None:
        return
    clip_grad_norm([p for group in optimizer.param_groups for p in group["params"]], max_norm)


class Lamb(torch.optim.Optimizer):
    """LAMB as ``torch_optimizer.Lamb`` computes it, with optional clipping inside the step.

    Args:
        params: parameters or parameter groups.
        lr: learning rate (sahajBERT: 0.00176 at batch 4096).
        betas: decay rates of the first and second moments.
        eps: added to the denominator; raise it (1e-4) if fp16 steps turn NaN.
        weight_decay: decoupled decay added to the update before the trust ratio.
        clamp_value: the weight norm in the trust ratio is clamped to this (torch_optimizer's
            ``clamp_value``); lower it if huge embeddings take steps that are too large.
        debias: scale the step by ``sqrt(1 - beta2^t) / (1 - beta1^t)`` (sahajBERT: True; the
            LAMB paper's v3 and TTT: False).
        max_grad_norm: clip the gradients of all parameters to this global L2 norm before the
            update (TTT: 4.0); None = no clipping here.
    """

    averaged_statistics = ("exp_avg", "exp_avg_sq")  # kit.Optimizer's parameter rounds average them

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        clamp_value: float = 10.0,
        debias: bool = True,
        max_grad_norm: float | None = None,
    ) -> None:
        check_lamb_arguments(lr, betas, eps, weight_decay, clamp_value, max_grad_norm)
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            clamp_value=clamp_value,
            debias=debias,
        )
        super().__init__(params, defaults)
        self.max_grad_norm = max_grad_norm

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        clip_global_grad_norm(self, self.max_grad_norm)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for param in params:
                state = self.state[param]
                if not state:  # the step count stays on the CPU: step_size reads it
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(param, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(param, dtype=torch.float32)
                state["step"] += 1
            fused = [p for p in params if p.dtype == torch.float32 and p.grad.dtype == p.dtype]
            by_place: dict[tuple[torch.device, int], list[torch.Tensor]] = {}
            for param in fused:
                by_place.setdefault((param.device, int(self.state[param]["step"])), []).append(
                    param
                )
            for (_, step), same in by_place.items():
                self._foreach_update(same, group, step)
            for param in params:  # other dtypes: one tensor at a time
                if param.dtype == torch.float32 and param.grad.dtype == param.dtype:
                    continue
                state = self.state[param]
                beta1, beta2 = group["betas"]
                grad = param.grad.float()
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                apply_lamb_update(param, exp_avg, exp_avg_sq, group, int(state["step"]))
        return loss

    def _foreach_update(self, params: list[torch.Tensor], group: dict[str, Any], step: int) -> None:
        """LAMB's step for float32 tensors of one device and step count, with torch's multi-tensor
        kernels (a few launches per group instead of ~15 per tensor): the same operations, in
        the same order, as :func:`apply_lamb_update`."""
        beta1, beta2 = group["betas"]
        grads = [p.grad for p in params]
        exp_avgs = [self.state[p]["exp_avg"] for p in params]
        exp_avg_sqs = [self.state[p]["exp_avg_sq"] for p in params]
        torch._foreach_mul_(exp_avgs, beta1)
        torch._foreach_add_(exp_avgs, grads, alpha=1 - beta1)  # type: ignore[arg-type]
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)  # type: ignore[arg-type]
        denominators = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_add_(denominators, group["eps"])
        updates = torch._foreach_div(exp_avgs, denominators)
        if group["weight_decay"] != 0:
            torch._foreach_add_(updates, params, alpha=group["weight_decay"])
        weight_norms = torch.stack(torch._foreach_norm(params)).clamp(0, group["clamp_value"])
        update_norms = torch.stack(torch._foreach_norm(updates))
        scales = _trust_ratio(weight_norms, update_norms) * -step_size(group, step)
        torch._foreach_mul_(updates, list(scales.unbind()))
        torch._foreach_add_(params, updates)
