"""The 8-bit quantization kernels behind the codecs: which bucket each value goes to, fast.

Holds the tensor work of ``Uniform8BitQuantization``, ``Quantile8BitQuantization`` and
``BlockwiseQuantization`` (``kit.averaging.compression``): the buckets of the uniform and the
quantile codes (``uniform_buckets``, ``quantile_buckets``) and each bucket's mean
(``bucket_means``), the blockwise absmax code (``blockwise_linear``, or bitsandbytes' CUDA kernel),
and the decoding table lookup (``lookup``, ``scale_blocks``). Work runs in cache-sized chunks
(``work_chunks``): one 72 MB part per round makes no page faults for temporaries, and outputs are
written in place into the caller's buffer.

Separate from ``compression`` (the codec classes: hivemind's wire ids, byte layouts, the checks
on receipt) because this is how the numbers are computed, not how they travel: nothing here
knows a header, an offset or a wire id, and the codecs' layouts do not depend on these kernels
(any peer's codebook decodes alike).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator

import numpy as np
import torch

from kit.averaging.serialized import BLOCK_SIZE, N_BINS

logger = logging.getLogger(__name__)

RANGE_IN_SIGMAS = 6  # Uniform8BitQuantization's bucket range (hivemind's RANGE_IN_SIGMAS)
QUANTILE_SAMPLE = 2**14  # values sampled to place the quantile borders: 64 per bucket
QUANTILE_GRID = 2**16  # fine bins of the border lookup table (see quantile_buckets)
WORK_CHUNK = 2**20  # values per step on CPU: temporaries stay in cache, no page faults
SAMPLE_SEED = 0x5EED  # quantile sampling is seeded: the same tensor gives the same bytes
LINEAR_CODE = (torch.arange(N_BINS, dtype=torch.float32) - 127) / 127  # blockwise: code[k]

#: (start, stop, float32 values, uint8 bucket of each value) per work chunk.
Assignment = Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]


def work_chunks(n: int, device: torch.device) -> list[tuple[int, int]]:
    """Ranges of at most WORK_CHUNK values (multiples of BLOCK_SIZE); one range on GPUs."""
    step = WORK_CHUNK if device.type == "cpu" else max(n, 1)  # GPU allocations are cached
    return [(start, min(start + step, n)) for start in range(0, n, step)]


def uniform_buckets(flat: torch.Tensor) -> tuple[torch.Tensor, Assignment]:
    """256 equal buckets over mean ± 3 sigma; outliers go to the end buckets.

    Returns the bucket centers (the codebook entries of empty buckets) and the assignment.
    """
    n, chunks = flat.numel(), work_chunks(flat.numel(), flat.device)
    mean = sum(float(flat[a:b].sum(dtype=torch.float64)) for a, b in chunks) / n
    squares = 0.0
    for a, b in chunks:  # two passes: sum((x - mean)^2) does not cancel like sum(x^2) would
        centered = flat[a:b].float() - mean
        squares += float(torch.dot(centered, centered))
    scale = RANGE_IN_SIGMAS * math.sqrt(squares / max(n - 1, 1)) / N_BINS
    scale = scale if 0 < scale < math.inf else 1.0  # a constant tensor: all in bucket 128
    centers = mean + (torch.arange(N_BINS, dtype=torch.float64) - N_BINS // 2) * scale

    def assignment() -> Assignment:
        for a, b in chunks:
            values = flat[a:b].float()
            buckets = torch.mul(values, 1 / scale).add_(N_BINS // 2 - mean / scale).round_()
            yield a, b, values, buckets.clamp_(0, N_BINS - 1).to(torch.uint8)

    return centers, assignment()


def quantile_buckets(flat: torch.Tensor) -> tuple[torch.Tensor, Assignment]:
    """256 buckets holding (nearly) equally many values, without sorting them all.

    The borders come from a seeded sample of QUANTILE_SAMPLE values, and values find their
    bucket through a table over QUANTILE_GRID fine bins instead of a binary search. Returns the
    borders (the codebook entries of empty buckets, kept monotone) and the assignment.
    """
    n, device, grid = flat.numel(), flat.device, QUANTILE_GRID
    sample = flat
    if n > QUANTILE_SAMPLE:
        generator = torch.Generator(device=device).manual_seed(SAMPLE_SEED)
        picks = torch.randint(0, n, (QUANTILE_SAMPLE,), generator=generator, device=device)
        sample = flat[picks]
    ordered = _sorted(sample.float())
    ranks = torch.arange(1, N_BINS, dtype=torch.float64, device=device) / N_BINS
    borders = ordered[(ranks * (ordered.numel() - 1)).round().long()].contiguous()
    low, width = float(borders[0]), float(borders[-1] - borders[0])
    exact = not (0 < width < math.inf and math.isfinite(grid / width))
    # In fine units u(x) = (x - low) * grid / width, x goes to table[floor(u) + 1] (0 below
    # `low`, grid + 1 above the top border), and table[j] = #{borders with u < j - 1}: the
    # exact bucket of the fine bin's left edge, counted without any search.
    fine_borders = ((borders.double() - low) * (grid / width if not exact else 0)).floor_()
    below = torch.bincount(fine_borders.long().clamp_(0, grid), minlength=grid + 1).cumsum(0)
    table = torch.cat([below.new_zeros(2), below[: grid - 1], below.new_full((1,), N_BINS - 1)])
    table = table.to(torch.uint8)

    def assignment() -> Assignment:
        for a, b in work_chunks(n, device):
            values = flat[a:b].float()
            if exact:  # (nearly) constant values: a slower binary search, exact
                yield a, b, values, torch.bucketize(values, borders).to(torch.uint8)
                continue
            fine = torch.sub(values, low).mul_(grid / width).floor_().add_(1)
            fine = fine.clamp_(0, grid + 1).to(torch.int32)
            yield a, b, values, torch.index_select(table, 0, fine)

    return torch.cat([borders[:1], borders]).double(), assignment()


def _sorted(values: torch.Tensor) -> torch.Tensor:
    if values.device.type == "cpu":  # numpy's vectorised sort is ~30x faster than torch's here
        return torch.from_numpy(np.sort(values.numpy()))
    return values.sort().values


def bucket_means(
    empty_buckets: torch.Tensor, assignment: Assignment, indices: torch.Tensor, device: torch.device
) -> torch.Tensor:
    """Write each value's bucket into ``indices``; return the codebook (float64): the mean of
    each bucket's values, or ``empty_buckets``' entry for a bucket no value went to."""
    sums = torch.zeros(N_BINS, dtype=torch.float64, device=device)
    counts = torch.zeros(N_BINS, dtype=torch.int64, device=device)
    for start, stop, values, buckets in assignment:
        sums += torch.bincount(buckets, weights=values, minlength=N_BINS)
        counts += torch.bincount(buckets, minlength=N_BINS)
        indices[start:stop].copy_(buckets)
    return torch.where(counts > 0, sums / counts.clamp_min(1), empty_buckets.to(sums))


def blockwise_linear(flat: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Write each value's index under LINEAR_CODE (``round(127 * x / absmax) + 127``, absmax of
    its block of BLOCK_SIZE values) into ``indices``; return each block's absmax."""
    n = flat.numel()
    absmax = torch.empty(-(-n // BLOCK_SIZE), device=flat.device)
    for start, stop in work_chunks(n, flat.device):  # chunks hold whole blocks
        values = flat[start:stop].float()
        whole = values.numel() // BLOCK_SIZE * BLOCK_SIZE
        for begin, rows in (
            (0, values[:whole].view(-1, BLOCK_SIZE)),
            (whole, values[whole:].view(1, -1)),
        ):
            if rows.numel() == 0:
                continue
            low, high = torch.aminmax(rows, dim=1)
            block_max = torch.maximum(high, low.neg())
            first = (start + begin) // BLOCK_SIZE
            absmax[first : first + rows.shape[0]] = block_max
            inverse = torch.where(block_max > 0, 127 / block_max, torch.zeros_like(block_max))
            codes = torch.mul(rows, inverse[:, None]).round_().add_(127)
            indices[start + begin : start + begin + codes.numel()].copy_(codes.view(-1))
    return absmax


def bitsandbytes_blockwise(flat: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """(indices, absmax, code) from bitsandbytes' CUDA kernel, or None without it."""
    try:
        from bitsandbytes.functional import quantize_blockwise  # optional, only used on CUDA
    except ImportError:
        return None
    indices, state = quantize_blockwise(flat.float().contiguous())
    absmax, code = state if isinstance(state, tuple) else (state.absmax, state.code)
    if absmax.numel() != -(-flat.numel() // BLOCK_SIZE) or code.numel() != N_BINS:
        logger.warning("bitsandbytes used another block size; BlockwiseQuantization uses torch")
        return None
    return indices, absmax.float(), code.float()


def lookup(code: np.ndarray, indices: np.ndarray) -> torch.Tensor:
    """``code[indices]`` as a new float32 tensor: decoding is one table lookup."""
    out = torch.empty(indices.size)
    np.take(code, indices, out=out.numpy(), mode="wrap")  # u8 < 256: no bounds checks
    return out


def scale_blocks(values: torch.Tensor, absmax: torch.Tensor) -> None:
    """Multiply each block of BLOCK_SIZE ``values`` (the last one may be short) by its absmax."""
    n = values.numel()
    n_blocks, whole = -(-n // BLOCK_SIZE), n // BLOCK_SIZE * BLOCK_SIZE
    values[:whole].view(-1, BLOCK_SIZE).mul_(absmax[: whole // BLOCK_SIZE, None])
    values[whole:].mul_(absmax[n_blocks - 1 :])
