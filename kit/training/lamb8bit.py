"""8-bit LAMB: bitsandbytes' blockwise 8-bit optimizer statistics under kit's exact LAMB update.

Training Transformers Together (TTT) trained its DALL-E with an 8-bit LAMB on CPU-offloaded
statistics (``CPULAMB8Bit``, recipes.md §4.5; Dettmers et al. 2022, "8-bit Optimizers via
Block-wise Quantization"). bitsandbytes' own ``LAMB8bit`` is not LAMB in its 8-bit path (it
skips the trust ratio: its docstring says update-norm clipping is not implemented there), so
:class:`Lamb8bit` keeps bitsandbytes' machinery (``Optimizer2State``: its state layout, its
``state_dict``/``load_state_dict``, its quantization maps and kernels, which run on CPU tensors
in bitsandbytes >= 0.45) and replaces the update with the one of :class:`kit.training.lamb.Lamb`:

* tensors of at least ``min_8bit_size`` elements (TTT: 65,536) keep both moments in uint8,
  ``m`` with the signed and ``v`` with the unsigned dynamic map, one fp32 ``absmax`` per block:
  ~2 bytes per parameter instead of 8;
* a block holds ``block_size`` elements (TTT: 4,096) but, by default (``row_blocks``), never
  spans two rows of a matrix: each token of an embedding table gets its own scale
  (:func:`statistics_block_size` has the rule; why is below). ``row_blocks=False`` is TTT's
  layout exactly;
* smaller tensors (biases, LayerNorms), and any that bitsandbytes' ``GlobalOptimManager`` gives
  ``optim_bits=32``, keep fp32 moments, as in TTT;
* each step dequantizes the moments, updates them, quantizes them back, and applies LAMB's
  update (trust ratio, ``debias`` option, clamp) with the updated fp32 moments, before their
  quantization, as bitsandbytes' blockwise kernels do (LAMB on the requantized ones was no
  closer to fp32 LAMB in the measurement below: 0.2% further).

Why rows. In TTT's layout a 4,096-element block of an ALBERT embedding table of width 128 (tied
with the MLM decoder) holds 32 tokens, whose gradients differ by orders of magnitude with their
frequency. The block's absmax is set by its frequent tokens, so the rare tokens' moments sit in the
coarse low range of the dynamic map, and requantizing them every step lets them drift. (On the CPU
it is coarser still: bitsandbytes 0.50's CPU kernel never writes the map's lowest codes, so values
below ~1.6e-5 of their block's absmax, zero included, come back as 1.6e-5 of it for ``v`` and
+-2.1e-5 for ``m``.) Training a small ALBERT on the CPU for 300 steps with TTT's hyperparameters
(``benchmarks/optimizers.py --quality-steps 300 --ttt-layout``), where the table's ``v`` was
below 1e-3 of its block's absmax (39% of the table) its 8-bit value ended at 0.56-0.67x the fp32
one (medians), the table's ``m / sqrt(v)`` at 1.47x its fp32 norm (1.27-1.54x after the first 30
steps), so LAMB's per-tensor trust ratio cut the whole table's steps to 0.68x, and the loss ended
2.8% above fp32 LAMB's (1.9% with sahajBERT's hyperparameters). No ``v`` was quantized to 0 while
its ``m`` was not, and the other matrices' updates kept within 1% of fp32 LAMB's in norm (the
sentence-order pooler, which few examples reach, 0.83-1.03x). Dettmers et al. 2022 trace the
instability of 8-bit optimizers in language models to the embedding layer and the highly
non-uniform distribution of its tokens (their "Stable Embedding Layer"; bitsandbytes' advice is
that layer, or 32-bit statistics for the embedding through ``GlobalOptimManager``, which this
class honours). Row blocks keep those statistics 8-bit with one scale per token (the point of
their "Block-wise Quantization": each block's absmax confines an outlier's range to its block),
for 8 more bytes per row: the table's update then kept within 5% of fp32 LAMB's in norm and the
loss ended 0.2% above fp32 LAMB's (0.3% with sahajBERT's), for 1.8% more state bytes (0.292x fp32
LAMB's instead of 0.287x; ALBERT-large: 2.04 bytes per parameter instead of 2.02). 32-bit
statistics for the table matched fp32 LAMB too, but at 0.68x its bytes.

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

from kit.errors import ConfigError
from kit.training.lamb import apply_lamb_update, check_lamb_arguments, clip_global_grad_norm

#: TTT's settings (recipes.md §4.5): tensors this large get 8-bit statistics, in blocks this long.
MIN_8BIT_SIZE = 65_536
BLOCK_SIZE = 4_096
#: bitsandbytes' blockwise kernels (CPU and CUDA) take blocks of 64 to 4096 elements.
MIN_BLOCK_SIZE = 64


def statistics_block_size(shape: torch.Size | tuple[int, ...], block_size: int = BLOCK_SIZE) -> int:
    """Elements per quantization block of a tensor of ``shape`` with row-aligned blocks.

    A row is one slice along the first dimension (a token of an embedding table, an output unit
    of a linear layer). The block is the largest power of two that divides the row length, up to
    ``block_size``, so that no block holds parts of two rows; rows shorter than
    :data:`MIN_BLOCK_SIZE` (bitsandbytes' smallest block) that divide it share blocks of that
    size, whole rows each. ``block_size`` itself for vectors, and for rows that cannot be
    aligned (a length of 300 = 4 x 75: blocks of 4 elements would cost more than the statistics).
    """
    if len(shape) < 2 or shape[0] == 0:
        return block_size
    row = 1
    for size in shape[1:]:
        row *= size
    aligned = min(block_size, row & -row)  # row & -row: the largest power of two dividing row
    if aligned >= MIN_BLOCK_SIZE:
        return aligned
    return MIN_BLOCK_SIZE if row and MIN_BLOCK_SIZE % row == 0 else block_size


class Lamb8bit(Optimizer2State):  # type: ignore[misc]  # bitsandbytes is untyped
    """LAMB with 8-bit blockwise statistics; the same arguments as :class:`~kit.training.lamb.Lamb`.

    Args:
        params, lr, betas, eps, weight_decay, clamp_value, debias, max_grad_norm: as ``Lamb``.
        min_8bit_size: smaller tensors keep fp32 statistics (TTT: 65536).
        block_size: the most elements per quantization block, each with its own fp32 scale
            (TTT: 4096).
        row_blocks: blocks never span two rows of a matrix (:func:`statistics_block_size`;
            kit's default, see the module docstring); False: blocks of ``block_size`` across
            rows, TTT's layout. A state loaded from another layout keeps its own.

    Raises:
        ConfigError: a bad hyperparameter, or a ``block_size`` bitsandbytes' kernels do not take.
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
        row_blocks: bool = True,
    ) -> None:
        check_lamb_arguments(lr, betas, eps, weight_decay, clamp_value, max_grad_norm)
        if block_size & (block_size - 1) or not MIN_BLOCK_SIZE <= block_size <= BLOCK_SIZE:
            raise ConfigError(
                f"Lamb8bit: block_size={block_size} - help: use a power of two from"
                f" {MIN_BLOCK_SIZE} to {BLOCK_SIZE} (bitsandbytes' blockwise kernels; TTT: 4096)"
            )
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
        self.row_blocks = row_blocks

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
        if p.numel() < config["min_8bit_size"] or config["optim_bits"] == 32:
            state["state1"] = torch.zeros_like(p, dtype=torch.float32)
            state["state2"] = torch.zeros_like(p, dtype=torch.float32)
            return
        if "dynamic" not in self.name2qmap:
            self.fill_qmap()
        block = (
            statistics_block_size(p.shape, self.block_size) if self.row_blocks else self.block_size
        )
        blocks = -(-p.numel() // block)
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
            block = saved_block_size(p.numel(), state["absmax1"].numel())
            exp_avg = self._dequantize(state, 1, block).view_as(p)
            exp_avg_sq = self._dequantize(state, 2, block).view_as(p)
        else:
            exp_avg, exp_avg_sq = state["state1"], state["state2"]
        exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        if quantized:
            self._quantize(state, 1, exp_avg, block)
            self._quantize(state, 2, exp_avg_sq, block)
        apply_lamb_update(p, exp_avg, exp_avg_sq, group, int(state["step"]))

    @staticmethod
    def _dequantize(state: dict[str, Any], index: int, block: int) -> torch.Tensor:
        return bnb_functional.dequantize_blockwise(
            state[f"state{index}"],
            absmax=state[f"absmax{index}"],
            code=state[f"qmap{index}"],
            blocksize=block,
        )

    @staticmethod
    def _quantize(state: dict[str, Any], index: int, values: torch.Tensor, block: int) -> None:
        bnb_functional.quantize_blockwise(
            values.contiguous(),
            code=state[f"qmap{index}"],
            absmax=state[f"absmax{index}"],
            out=state[f"state{index}"],
            blocksize=block,
        )


def saved_block_size(numel: int, blocks: int) -> int:
    """The block size that split ``numel`` elements into ``blocks`` absmax scales.

    Read from the state rather than recomputed from the shape, so that statistics saved in
    another layout (TTT's, ``row_blocks=False``, or kit before row blocks) load and keep
    stepping in their own. Blocks are powers of two: ``ceil(numel / blocks)`` lies in
    ``(block / 2, block]`` when there are several, so the next power of two is the block; a
    single block holds everything, and any block at least ``numel`` long (and at least
    :data:`MIN_BLOCK_SIZE`, for bitsandbytes' kernels) reads it the same.
    """
    longest = -(-numel // max(1, blocks))
    return max(MIN_BLOCK_SIZE, 1 << (longest - 1).bit_length())
