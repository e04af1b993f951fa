"""8-bit LAMB: bitsandbytes' blockwise 8-bit optimizer statistics under kit's exact LAMB update.

Training Transformers Together (TTT) trained its DALL-E with an 8-bit LAMB on CPU-offloaded
statistics (``CPULAMB8Bit``, recipes.md §4.5; Dettmers et al. 2022, "8-bit Optimizers via
Block-wise Quantization"). bitsandbytes' own ``LAMB8bit`` is not LAMB in its 8-bit path (it
skips the trust ratio: its docstring says update-norm clipping is not implemented there), so
:class:`Lamb8bit` keeps bitsandbytes' machinery (``Optimizer2State``: its state layout, its
``state_dict``/``load_state_dict``, its quantization maps and kernels, which run on CPU tensors
in bitsandbytes >= 0.45) and replaces the update with the one of :class:`kit.training.lamb.Lamb`:

* tensors of at least ``min_8bit_size`` elements (TTT: 65,536) keep both moments in uint8,
  ``m`` with the signed and ``v`` with the unsigned dynamic map, one fp32 ``absmax`` per block of
  ``block_size`` elements (4,096): ~2 bytes per parameter instead of 8;
* smaller tensors (biases, LayerNorms) keep fp32 moments, as in TTT;
* each step dequantizes the moments, updates them, quantizes them back, and applies LAMB's
  update (trust ratio, ``debias`` option, clamp) with the dequantized values.

With ``kit.Optimizer(offload_optimizer=True)`` the parameters it steps are float32 CPU copies, so
the statistics and the whole update stay in host memory, as TTT ran it; on a GPU tensor the same
code runs on the GPU. Import this module only where bitsandbytes is installed
(:func:`kit.training.components.build_inner_optimizer` says how to install it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import bitsandbytes.functional as bnb_functional
import torch
from bitsandbytes.optim.optimizer import Optimizer2State

from kit.training.lamb import apply_lamb_update, check_lamb_arguments, clip_global_grad_norm

#: TTT's settings (recipes.md §4.5): tensors this large get 8-bit statistics, in blocks this long.
MIN_8BIT_SIZE = 65_536
BLOCK_SIZE = 4_096


class Lamb8bit(Optimizer2State):  # type: ignore[misc]  # bitsandbytes is untyped
    """LAMB with 8-bit blockwise statistics; the same arguments as :class:`~kit.training.lamb.Lamb`.

    Args:
        params, lr, betas, eps, weight_decay, clamp_value, debias, max_grad_norm: as ``Lamb``.
        min_8bit_size: smaller tensors keep fp32 statistics (TTT: 65536).
        block_size: elements per quantization block, each with its own fp32 scale (4096).
    """

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
        min_8bit_size: int = MIN_8BIT_SIZE,
        block_size: int = BLOCK_SIZE,
    ) -> None:
        check_lamb_arguments(lr, betas, eps, weight_decay, clamp_value, max_grad_norm)
        super().__init__(
            "lamb",
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            optim_bits=8,
            min_8bit_size=min_8bit_size,
        )
        # Groups added later get these too (torch.optim fills missing keys from defaults).
        self.defaults.update(clamp_value=clamp_value, debias=debias)
        for group in self.param_groups:
            group.setdefault("clamp_value", clamp_value)
            group.setdefault("debias", debias)
        self.max_grad_norm = max_grad_norm
        self.block_size = block_size

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        clip_global_grad_norm(self, self.max_grad_norm)
        super().step()
        return loss

    @torch.no_grad()
    def init_state(self, group: dict[str, Any], p: torch.Tensor, gindex: int, pindex: int) -> None:
        config = self.get_config(gindex, pindex, group)
        state = self.state[p]
        state["step"] = 0
        if p.numel() < config["min_8bit_size"]:
            state["state1"] = torch.zeros_like(p, dtype=torch.float32)
            state["state2"] = torch.zeros_like(p, dtype=torch.float32)
            return
        if "dynamic" not in self.name2qmap:
            self.fill_qmap()
        blocks = -(-p.numel() // self.block_size)
        state["state1"] = torch.zeros_like(p, dtype=torch.uint8)
        state["state2"] = torch.zeros_like(p, dtype=torch.uint8)
        state["qmap1"] = self.name2qmap["dynamic"].to(p.device)
        state["qmap2"] = self.name2qmap["udynamic"].to(p.device)
        state["absmax1"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
        state["absmax2"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)

    @torch.no_grad()
    def update_step(self, group: dict[str, Any], p: torch.Tensor, gindex: int, pindex: int) -> None:
        state = self.state[p]
        assert p.grad is not None  # bitsandbytes calls update_step only for parameters with one
        grad = p.grad.float()
        beta1, beta2 = group["betas"]
        state["step"] += 1
        quantized = state["state1"].dtype == torch.uint8
        if quantized:
            exp_avg = self._dequantize(state, 1).view_as(p)
            exp_avg_sq = self._dequantize(state, 2).view_as(p)
        else:
            exp_avg, exp_avg_sq = state["state1"], state["state2"]
        exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        if quantized:
            self._quantize(state, 1, exp_avg)
            self._quantize(state, 2, exp_avg_sq)
        apply_lamb_update(p, exp_avg, exp_avg_sq, group, int(state["step"]))

    def _dequantize(self, state: dict[str, Any], index: int) -> torch.Tensor:
        return bnb_functional.dequantize_blockwise(
            state[f"state{index}"],
            absmax=state[f"absmax{index}"],
            code=state[f"qmap{index}"],
            blocksize=self.block_size,
        )

    def _quantize(self, state: dict[str, Any], index: int, values: torch.Tensor) -> None:
        bnb_functional.quantize_blockwise(
            values.contiguous(),
            code=state[f"qmap{index}"],
            absmax=state[f"absmax{index}"],
            out=state[f"state{index}"],
            blocksize=self.block_size,
        )
