"""LAMB: layer-wise adaptive moments for large global batches (You et al. 2020, Alg. 2).

sahajBERT trained with LAMB at a global batch of 4096 sequences (DeDLOC §4.2, via
``torch_optimizer.Lamb`` with ``clamp_value=10000`` and bias correction). LAMB is Adam whose update
of each parameter tensor is rescaled by a trust ratio ``‖w‖ / ‖update‖``, so that every layer
moves by a similar fraction of its norm whatever the batch size. This module holds only the
optimizer; which parameters decay is decided by :func:`kit.training.components.parameter_groups`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from kit.errors import ConfigError


class Lamb(torch.optim.Optimizer):
    """LAMB with decoupled weight decay and bias correction.

    Args:
        params: parameters or parameter groups.
        lr: learning rate (sahajBERT: 0.00176 at batch 4096).
        betas: decay rates of the first and second moments.
        eps: added to the denominator; raise it (1e-4) if fp16 steps turn NaN.
        weight_decay: decoupled decay added to the update before the trust ratio.
        clamp_value: the weight norm in the trust ratio is clamped to this (torch_optimizer's
            ``clamp_value``); lower it if huge embeddings take steps that are too large.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        clamp_value: float = 10.0,
    ) -> None:
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
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, clamp_value=clamp_value
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad.float()
                state = self.state[param]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(param, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(param, dtype=torch.float32)
                state["step"] += 1
                step = float(state["step"])
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                corrected_avg = exp_avg / (1 - beta1**step)
                corrected_sq = exp_avg_sq / (1 - beta2**step)
                update = corrected_avg / (corrected_sq.sqrt() + group["eps"])
                if group["weight_decay"]:
                    update.add_(param.float(), alpha=group["weight_decay"])
                weight_norm = float(param.float().norm().clamp(0, group["clamp_value"]))
                update_norm = float(update.norm())
                # Trust ratio (You et al. 2020, eq. 6); 1 where either norm is zero (fresh
                # zero-initialized biases), as in the reference implementations.
                trust = weight_norm / update_norm if weight_norm > 0 and update_norm > 0 else 1.0
                if not math.isfinite(trust):
                    trust = 1.0
                param.add_(update.to(param.dtype), alpha=-group["lr"] * trust)
        return loss
