"""Tensor codecs for averaging: hivemind's six wire formats, fast, and checked on receipt.

Holds the codec classes (same names, wire ids and byte layouts as ``hivemind.compression``, so
hivemind scripts port), ``extract`` and ``is_finite``; the names of
``kit.averaging.serialized`` (``SerializedTensor``, a msgpack-able header plus raw bytes, with
its validating parser; ``CompressionInfo``; ``Codec``) are importable from here too. It does not
hold the codecs that delegate to these (``kit.averaging.adaptive_compression``), the wire framing
or chunk streaming (``kit.averaging.partition`` and the all-reduce), and never pickles.

Byte layouts (little-endian; ``n`` elements; ``r`` rows of the last axis)::

    NONE           raw values; bfloat16 goes as float32 (hivemind's default), raw bf16 accepted
    MEANSTD_16BIT  f16[n] of (x - mean) / std over the last axis | f32 means[r] | f32 stds[r]
    FLOAT16        f16[n] clamped to +-65504; the header keeps the original dtype
    QUANTILE_8BIT  i64 codebook length (256) | f32 codebook[256] | u8 indices[n]
    UNIFORM_8BIT   same layout; 256 buckets over mean +- 3 sigma
    BLOCKWISE_8BIT i64 n_absmax | i64 n_code (256) | f32 absmax[ceil(n / 4096)] | f32 code[256]
                   | u8 indices[n]

Non-finite values: ``compress`` refuses NaN/inf (``NonFiniteLocalTensor``) and ``extract`` refuses
decoded NaN/inf (``NonFiniteTensor``), so neither a diverged nor a hostile peer can poison an
average. Each check costs one sum, not an extra pass per element (see ``is_finite``).

Speed (one 72 MB part per round): work runs in cache-sized chunks so temporaries cost no page
faults, outputs are written in place into the final buffer, and decoding is one table lookup
(the 8-bit codecs' kernels are in ``kit.averaging.quantization``).
"""

from __future__ import annotations

import math
import sys
from abc import ABC, abstractmethod
from typing import ClassVar

import numpy as np
import torch

from kit.averaging.quantization import (
    LINEAR_CODE,
    Assignment,
    bitsandbytes_blockwise,
    blockwise_linear,
    bucket_means,
    lookup,
    quantile_buckets,
    scale_blocks,
    uniform_buckets,
)
from kit.averaging.serialized import (
    BLOCK_SIZE,
    DEFAULT_MAX_NUMEL,
    DTYPE_NAMES,
    DTYPES,
    FLOAT_DTYPES,
    MAX_NDIM,
    N_BINS,
    Buffer,
    Codec,
    CompressionInfo,
    SerializedTensor,
    TensorDescriptor,
    TensorRole,
    check_layout,
    stats_rows,
)
from kit.averaging.widening import subtract_narrowed
from kit.errors import ConfigError, NonFiniteLocalTensor, NonFiniteTensor
from kit.p2p.payload_pool import MIN_POOLED, PAYLOADS

FP16_MAX = float(torch.finfo(torch.float16).max)


def is_finite(tensor: torch.Tensor) -> bool:
    """True when ``tensor`` holds no NaN and no ±inf (non-float tensors always do).

    Costs one sum in the usual case: a sum is finite exactly when no element is NaN/inf, unless
    it overflows; only then are the elements checked one by one. A float16/bfloat16 tensor is
    summed in its own dtype first (torch accumulates in float32 and rounds the result: 6x faster
    here than asking for a float32 result), then, if that overflowed, with a float32 result.
    """
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return True
    if math.isfinite(float(tensor.sum())):  # no torch op on the 0-d sum
        return True
    if tensor.element_size() < 4 and math.isfinite(float(tensor.sum(dtype=torch.float32))):
        return True
    return bool(torch.isfinite(tensor).all())


def _read(buffer: Buffer, dtype: str, count: int, offset: int) -> torch.Tensor:
    """Copy values out of ``buffer`` into an owned, aligned, writable tensor.

    The copy is deliberate: a tensor never aliases a received (often read-only) buffer.
    """
    array = np.frombuffer(buffer, dtype=dtype, count=count, offset=offset)
    out = torch.empty(count, dtype=DTYPES[array.dtype.name])
    out.numpy()[...] = array
    return out


def _pack(*pieces: torch.Tensor, payload: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A CPU byte buffer: ``pieces`` copied in, then ``payload`` bytes the caller fills in place."""
    raw = [piece.detach().reshape(-1).contiguous().view(torch.uint8) for piece in pieces]
    head = sum(piece.numel() for piece in raw)
    buffer = torch.empty(head + payload, dtype=torch.uint8)
    offset = 0
    for piece in raw:
        buffer[offset : offset + piece.numel()].copy_(piece)
        offset += piece.numel()
    return buffer, buffer[head:]


def _as_buffer(tensor: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor (the view keeps it alive)."""
    return tensor.reshape(-1).view(torch.uint8).numpy().data


def _non_finite_local(tensor: torch.Tensor) -> NonFiniteLocalTensor:
    return NonFiniteLocalTensor(
        f"refusing to send a {list(tensor.shape)} tensor holding NaN or inf - help: "
        "training diverged; lower the learning rate or clip gradients, then load state "
        "from peers"
    )


class CompressionBase(ABC):
    """A codec: ``compress`` a tensor to a SerializedTensor, ``extract`` it back."""

    @abstractmethod
    def compress(
        self, tensor: torch.Tensor, info: CompressionInfo | None = None, allow_inplace: bool = False
    ) -> SerializedTensor:
        """Compress ``tensor`` (on any device); it stays unchanged unless ``allow_inplace``.

        Raises:
            NonFiniteLocalTensor: ``tensor`` holds NaN or ±inf.
            ConfigError: this codec cannot compress ``tensor``'s dtype.
        """

    def extract(self, serialized: SerializedTensor) -> torch.Tensor:
        """Decode the output of any codec (the header names it), as hivemind's do."""
        return extract(serialized)

    @abstractmethod
    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        """Compressed size / original size, estimated without compressing."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class _LeafCodec(CompressionBase):
    """A codec with a wire id; subclasses implement ``_encode`` and ``_decode``."""

    codec: ClassVar[Codec]
    value_bits: ClassVar[int]  # bits per value on the wire, for the compression ratio
    accepted_dtypes: ClassVar[frozenset[str]] = FLOAT_DTYPES
    allow_non_finite = False
    checks_its_output: ClassVar[bool] = False  # _encode refuses NaN/inf itself, more cheaply

    def compress(
        self, tensor: torch.Tensor, info: CompressionInfo | None = None, allow_inplace: bool = False
    ) -> SerializedTensor:
        tensor = tensor.detach()
        if tensor.device.type not in ("cpu", "cuda"):  # e.g. MPS: no float64 for the statistics
            tensor = tensor.cpu()
        name = DTYPE_NAMES.get(tensor.dtype, str(tensor.dtype))
        if name not in self.accepted_dtypes:
            help_ = (
                "send a complex tensor as torch.view_as_real(tensor): its real and imaginary parts"
                if tensor.is_complex()
                else "use NoCompression (e.g. through PerTensorCompression) for non-float tensors"
            )
            raise ConfigError(
                f"{type(self).__name__} cannot compress {tensor.dtype} tensors - help: {help_}"
            )
        if not self.allow_non_finite and not self.checks_its_output and not is_finite(tensor):
            raise _non_finite_local(tensor)
        return SerializedTensor(
            self.codec, name, tuple(tensor.shape), self._encode(tensor, allow_inplace)
        )

    @abstractmethod
    def _encode(self, tensor: torch.Tensor, allow_inplace: bool) -> Buffer: ...

    @classmethod
    @abstractmethod
    def _decode(cls, s: SerializedTensor) -> torch.Tensor:
        """Decode a layout-checked ``s`` into a flat CPU tensor (any dtype ``extract`` casts)."""

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        dtype = info.descriptor.dtype
        bits = torch.finfo(dtype).bits if dtype.is_floating_point else dtype.itemsize * 8
        return min(1.0, self.value_bits / bits)


class NoCompression(_LeafCodec):
    """Raw values (id NONE). bfloat16 goes as float32, like hivemind's default."""

    codec, value_bits, accepted_dtypes = Codec.NONE, 0, frozenset(DTYPES)

    def __init__(self, allow_non_finite: bool = False) -> None:
        self.allow_non_finite = allow_non_finite  # True for state that may hold inf (masks)

    def _encode(self, tensor: torch.Tensor, allow_inplace: bool) -> Buffer:
        flat = tensor.reshape(-1)
        return _as_buffer(
            (flat.float() if flat.dtype == torch.bfloat16 else flat).cpu().contiguous()
        )

    @classmethod
    def _decode(cls, s: SerializedTensor) -> torch.Tensor:
        n = math.prod(s.shape)
        if s.dtype == "bfloat16" and memoryview(s.buffer).nbytes == 4 * n:
            return _read(s.buffer, "<f4", n, 0)
        if s.dtype == "bfloat16":
            return _read(s.buffer, "<i2", n, 0).view(torch.bfloat16)
        if s.dtype == "bool":  # bytes other than 0 and 1 must not become torch bools
            return _read(s.buffer, "u1", n, 0) != 0
        return _read(s.buffer, np.dtype(s.dtype).newbyteorder("<").str, n, 0)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return 1.0


def reused_empty(count: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised flat CPU tensor, in a reused buffer when it is chunk-sized
    (``kit.p2p.payload_pool``): a round makes dozens of such temporaries (encodings, differences)
    and drops them, and a fresh allocation of each faults its pages in again (~7,000 faults a
    peer and round for float16 encodings alone, here). Safe whatever the caller does with it: a
    buffer is reused only once no view of it is left."""
    nbytes = count * dtype.itemsize
    if nbytes < MIN_POOLED:
        return torch.empty(count, dtype=dtype)
    return torch.frombuffer(PAYLOADS.take(nbytes), dtype=dtype, count=count)


class Float16Compression(_LeafCodec):
    """float16 values clamped to ±65504 (id FLOAT16); ``extract`` restores the original dtype."""

    codec, value_bits = Codec.FLOAT16, 16
    checks_its_output = True

    def _encode(self, tensor: torch.Tensor, allow_inplace: bool) -> Buffer:
        # Cast, then clamp the float16 copy: overflow gives ±inf, which the clamp maps to ±65504,
        # the same bytes as hivemind's clamp-then-cast without a float32 temporary. The copy is
        # checked, not the input: a float16 sum reads half the bytes and costs a fifth of a
        # clamp pass, and the copy is finite exactly when the input is finite and in range. Only
        # when it is not is the input checked (NaN/inf: refused) and the copy clamped.
        flat = tensor.reshape(-1)
        half = flat
        if flat.dtype != torch.float16:
            half = (
                reused_empty(flat.numel(), torch.float16)
                if flat.device.type == "cpu"
                else torch.empty_like(flat, dtype=torch.float16)
            ).copy_(flat)
        if not is_finite(half):
            if not self.allow_non_finite and not is_finite(flat):
                raise _non_finite_local(tensor)
            if half is flat:  # a float16 input: never clamp it in place
                half = half.clone()
            half.clamp_(-FP16_MAX, FP16_MAX)
        return _as_buffer(half.cpu().contiguous())

    def compress_difference(
        self, a: torch.Tensor, b: torch.Tensor, info: CompressionInfo | None = None
    ) -> SerializedTensor:
        """``compress(a - b)`` (``a`` flat float32 on the CPU, ``b`` float32 or float16 of its
        length): the same bytes, the difference rounded once, without a float32 copy of it
        (``widening.subtract_narrowed``). An exact Float16Compression only (the scaled one is a
        subclass with its own encoding): anything else, or a difference that is not finite in
        float16 (clamped, or refused), goes through ``compress``.

        Raises:
            NonFiniteLocalTensor: the difference holds NaN or ±inf.
        """
        if type(self) is not Float16Compression or a.dtype != torch.float32 or a.is_cuda:
            return self.compress(a - b.to(a.dtype), info)
        half = reused_empty(a.numel(), torch.float16)
        subtract_narrowed(half, a, b)
        if not is_finite(half):  # beyond float16's range (clamped), or NaN/inf (refused)
            return self.compress(a - b.to(a.dtype), info)
        return SerializedTensor(self.codec, "float32", tuple(a.shape), _as_buffer(half))

    @classmethod
    def _decode(cls, s: SerializedTensor) -> torch.Tensor:
        n = math.prod(s.shape)
        if s.dtype != "float16" and n and sys.byteorder == "little":
            view = memoryview(s.buffer)
            if not view.readonly:  # (a received frame): ``extract``'s cast to the original
                # dtype makes the owned tensor, so no copy of the float16 values before it
                return torch.frombuffer(view, dtype=torch.float16, count=n)
        return _read(s.buffer, "<f2", n, 0)


class ScaledFloat16Compression(Float16Compression):
    """float16 of (x - mean) / std per row of the last axis, plus float32 means and stds."""

    codec = Codec.MEANSTD_16BIT
    checks_its_output = False  # its own _encode: compress checks the input

    def _encode(self, tensor: torch.Tensor, allow_inplace: bool) -> Buffer:
        n_rows = stats_rows(tensor.shape)
        if tensor.numel() == 0:
            return _as_buffer(_pack(torch.zeros(n_rows), torch.ones(n_rows))[0])
        copy = not (allow_inplace and tensor.dtype == torch.float32 and tensor.is_contiguous())
        rows = tensor.reshape(n_rows, -1).to(torch.float32, copy=copy)
        means = rows.mean(dim=-1, keepdim=True)
        stds = rows.sub_(means).norm(dim=-1, keepdim=True).div_(math.sqrt(rows.shape[-1]))
        stds.clamp_min_(torch.finfo(torch.float32).eps)
        buffer, _ = _pack(rows.div_(stds).clamp_(-FP16_MAX, FP16_MAX).half(), means, stds)
        return _as_buffer(buffer)

    @classmethod
    def _decode(cls, s: SerializedTensor) -> torch.Tensor:
        n, n_rows = math.prod(s.shape), stats_rows(s.shape)
        values = _read(s.buffer, "<f2", n, 0).float()
        means = _read(s.buffer, "<f4", n_rows, 2 * n)
        stds = _read(s.buffer, "<f4", n_rows, 2 * n + 4 * n_rows)
        if n:
            values.view(n_rows, -1).mul_(stds[:, None]).add_(means[:, None])
        return values


class _Quantization(_LeafCodec):
    """8-bit indices into a codebook holding the mean of each of 256 buckets (hivemind's)."""

    value_bits = 8

    @abstractmethod
    def _assign(self, flat: torch.Tensor) -> tuple[torch.Tensor, Assignment]:
        """Return codebook entries for empty buckets (kept monotone; never decoded) and an
        iterator of (start, stop, float32 values, uint8 bucket of each value) per work chunk."""

    def _encode(self, tensor: torch.Tensor, allow_inplace: bool) -> Buffer:
        flat = tensor.reshape(-1)
        count = torch.tensor([N_BINS], dtype=torch.int64)
        buffer, indices = _pack(count, torch.zeros(N_BINS), payload=flat.numel())
        if flat.numel() == 0:
            return _as_buffer(buffer)
        empty_buckets, assignment = self._assign(flat)
        codebook = bucket_means(empty_buckets, assignment, indices, flat.device)
        buffer[8 : 8 + 4 * N_BINS].copy_(codebook.float().cpu().view(torch.uint8))
        return _as_buffer(buffer)

    @classmethod
    def _decode(cls, s: SerializedTensor) -> torch.Tensor:
        n = math.prod(s.shape)
        codebook = np.frombuffer(s.buffer, dtype="<f4", count=N_BINS, offset=8)
        indices = np.frombuffer(s.buffer, dtype=np.uint8, count=n, offset=8 + 4 * N_BINS)
        return lookup(codebook, indices)


class Uniform8BitQuantization(_Quantization):
    """256 equal buckets over mean ± 3 sigma (id UNIFORM_8BIT); outliers go to the end buckets."""

    codec = Codec.UNIFORM_8BIT

    def _assign(self, flat: torch.Tensor) -> tuple[torch.Tensor, Assignment]:
        return uniform_buckets(flat)


class Quantile8BitQuantization(_Quantization):
    """256 buckets holding equally many values (id QUANTILE_8BIT).

    hivemind sorts every value (~8 s per 72 MB part). Here the borders come from a seeded
    sample of 2**14 values, and values find their bucket through a table over 65536 fine bins
    instead of a binary search (~30x faster). Only a value within 1/65536 of the range from a
    border may land on the wrong side of it; the codebook holds each bucket's true mean.
    """

    codec = Codec.QUANTILE_8BIT

    def _assign(self, flat: torch.Tensor) -> tuple[torch.Tensor, Assignment]:
        return quantile_buckets(flat)


class BlockwiseQuantization(_LeafCodec):
    """Absmax 8-bit per block of 4096 values (id BLOCKWISE_8BIT, bitsandbytes' layout).

    Plain torch with a linear code (``code[k] = (k - 127) / 127``) on any device, or
    bitsandbytes' kernels when it is importable and the tensor is on CUDA. Decoding reads the
    code from the buffer, so ours, bitsandbytes' and hivemind peers' dynamic code decode alike.
    """

    codec, value_bits = Codec.BLOCKWISE_8BIT, 8
    LINEAR_CODE = LINEAR_CODE  # code[k] = (k - 127) / 127 (kit.averaging.quantization)

    def _encode(self, tensor: torch.Tensor, allow_inplace: bool) -> Buffer:
        flat = tensor.reshape(-1)
        n, n_blocks = flat.numel(), -(-flat.numel() // BLOCK_SIZE)
        counts = torch.tensor([n_blocks, N_BINS], dtype=torch.int64)
        quantized = bitsandbytes_blockwise(flat) if flat.is_cuda else None
        if quantized is not None:
            return _as_buffer(_pack(counts, quantized[1], quantized[2], quantized[0])[0])
        buffer, indices = _pack(counts, torch.zeros(n_blocks), self.LINEAR_CODE, payload=n)
        absmax = blockwise_linear(flat, indices)
        buffer[16 : 16 + 4 * n_blocks].copy_(absmax.cpu().view(torch.uint8))
        return _as_buffer(buffer)

    @classmethod
    def _decode(cls, s: SerializedTensor) -> torch.Tensor:
        n = math.prod(s.shape)
        n_blocks = -(-n // BLOCK_SIZE)
        absmax = _read(s.buffer, "<f4", n_blocks, 16)
        code = np.frombuffer(s.buffer, dtype="<f4", count=N_BINS, offset=16 + 4 * n_blocks)
        indices = np.frombuffer(s.buffer, np.uint8, count=n, offset=16 + 4 * n_blocks + 4 * N_BINS)
        out = lookup(code, indices)
        scale_blocks(out, absmax)
        return out


CODECS: dict[Codec, type[_LeafCodec]] = {
    codec.codec: codec
    for codec in (NoCompression, ScaledFloat16Compression, Float16Compression)
    + (Quantile8BitQuantization, Uniform8BitQuantization, BlockwiseQuantization)
}


def extract(serialized: SerializedTensor, *, allow_non_finite: bool = False) -> torch.Tensor:
    """Decode a SerializedTensor into a new CPU tensor of its original dtype and shape.

    Args:
        serialized: from ``compress`` or ``SerializedTensor.from_header``; only read.
        allow_non_finite: accept NaN/inf in the result (for state holding ``-inf`` masks).

    Raises:
        InvalidTensor: the buffer does not match the codec's layout.
        NonFiniteTensor: the decoded values hold NaN or ±inf.
    """
    check_layout(serialized)
    flat = CODECS[serialized.codec]._decode(serialized)
    tensor = flat.to(DTYPES[serialized.dtype]).reshape(serialized.shape)
    if not allow_non_finite and not is_finite(tensor):
        raise NonFiniteTensor(
            f"received {serialized.codec.name} tensor {list(serialized.shape)} holds NaN or inf - "
            "help: the sending peer diverged or is hostile; its contribution is dropped"
        )
    return tensor


__all__ = [
    "CODECS",
    "DEFAULT_MAX_NUMEL",
    "DTYPES",
    "DTYPE_NAMES",
    "MAX_NDIM",
    "BlockwiseQuantization",
    "Codec",
    "CompressionBase",
    "CompressionInfo",
    "Float16Compression",
    "NoCompression",
    "Quantile8BitQuantization",
    "ScaledFloat16Compression",
    "SerializedTensor",
    "TensorDescriptor",
    "TensorRole",
    "Uniform8BitQuantization",
    "extract",
    "is_finite",
    "reused_empty",
]
