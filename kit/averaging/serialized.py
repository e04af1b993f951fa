"""One tensor as averaging sends it: what codecs see before (``CompressionInfo``) and what
crosses the wire after (``SerializedTensor``: a msgpack-able header plus raw bytes), with the
checks a received one passes before anything is decoded.

The wire ids (:class:`Codec`) and byte layouts are hivemind's (``kit.averaging.compression``
documents each); :func:`check_layout` holds a buffer to its codec's layout, so a hostile or
buggy peer's header and payload are refused (``InvalidTensor``) before a value is read.

What this module does not do: encoding and decoding (``kit.averaging.compression``), framing and
chunk streaming (``kit.averaging.chunk_stream``).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from kit.errors import InvalidTensor

Buffer = bytes | bytearray | memoryview


class Codec(enum.IntEnum):
    """Wire ids of the codecs: hivemind's ``runtime.proto`` ``CompressionType``, unchanged."""

    NONE = 0
    MEANSTD_16BIT = 1
    FLOAT16 = 2
    QUANTILE_8BIT = 3
    UNIFORM_8BIT = 4
    BLOCKWISE_8BIT = 5


DTYPES: dict[str, torch.dtype] = {  # numpy's names: the strings hivemind peers send
    **{name: getattr(torch, name) for name in ("float16", "bfloat16", "float32", "float64")},
    **{name: getattr(torch, name) for name in ("uint8", "int8", "int16", "int32", "int64")},
    "bool": torch.bool,
}
FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
MAX_NDIM = 32  # more axes than any model tensor has; bounds the work of parsing a header
DEFAULT_MAX_NUMEL = 2**31 - 1  # 8 GiB of float32; the all-reduce passes a tighter limit
N_BINS = 256  # 8-bit codebooks always have 256 entries, as hivemind's
BLOCK_SIZE = 4096  # bitsandbytes' default block, the one hivemind peers use


class TensorRole(enum.Enum):
    """What a tensor is to the model (``RoleAdaptiveCompression`` picks a codec by it)."""

    ACTIVATION = enum.auto()
    PARAMETER = enum.auto()
    GRADIENT = enum.auto()
    OPTIMIZER = enum.auto()
    UNSPECIFIED = enum.auto()


@dataclasses.dataclass(frozen=True)
class TensorDescriptor:
    """Shape and dtype of a whole tensor: what codecs may look at before compressing."""

    shape: tuple[int, ...]  # the whole tensor's shape, also when a chunk of it is compressed
    dtype: torch.dtype  # its dtype

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> TensorDescriptor:
        return cls(tuple(tensor.shape), tensor.dtype)

    def numel(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class CompressionInfo:
    """Which tensor is being compressed (as hivemind's): adaptive codecs choose by it."""

    key: Any  # name or index of the tensor
    descriptor: TensorDescriptor  # the whole tensor, also when a part of it is compressed
    role: TensorRole = TensorRole.UNSPECIFIED  # what the tensor is to the model
    part_index: int = 0  # index of the part when the tensor is sliced for streaming
    part_size: int | None = None  # most values per part, if sliced

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor, key: Any = None, **kwargs: Any) -> CompressionInfo:
        return cls(key, TensorDescriptor.from_tensor(tensor), **kwargs)

    def get_part(self, part_index: int, part_size: int | None) -> CompressionInfo:
        return dataclasses.replace(self, part_index=part_index, part_size=part_size)


@dataclasses.dataclass(frozen=True)
class SerializedTensor:
    """One compressed tensor: a small header (``header()``) and the raw ``buffer``.

    ``buffer`` may share memory with the tensor that was compressed (NoCompression, or
    Float16Compression of a float16 tensor): send it before changing that tensor.
    """

    codec: Codec  # how ``buffer`` is laid out
    dtype: str  # the original dtype's name; ``extract`` returns this dtype
    shape: tuple[int, ...]  # the original shape
    buffer: Buffer  # the payload, laid out as the codec says

    def header(self) -> dict[str, Any]:
        """The msgpack-able header to send before ``buffer``."""
        nbytes = memoryview(self.buffer).nbytes
        return {
            "codec": int(self.codec),
            "dtype": self.dtype,
            "shape": list(self.shape),
            "nbytes": nbytes,
        }

    @classmethod
    def from_header(
        cls, header: Any, buffer: Buffer, *, max_numel: int = DEFAULT_MAX_NUMEL
    ) -> SerializedTensor:
        """Check a received header and buffer against each other before anything is decoded.

        Args:
            header: the decoded msgpack header (untrusted).
            buffer: the received payload (untrusted); it is read, never aliased, by ``extract``.
            max_numel: the most elements accepted.

        Raises:
            InvalidTensor: unknown codec or dtype, bad shape, too many elements, or a buffer
                whose length or prefix does not match the codec's layout.
        """
        if not isinstance(header, Mapping) or set(header) != {"codec", "dtype", "shape", "nbytes"}:
            raise _invalid(
                f"a tensor header needs exactly codec/dtype/shape/nbytes: {header!r:.200}"
            )
        codec, dtype, shape = header["codec"], header["dtype"], header["shape"]
        if not _is_int(codec) or codec not in Codec._value2member_map_:
            raise _invalid(f"unknown codec {codec!r:.50}", "the peer runs an incompatible version")
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise _invalid(f"dtype {dtype!r:.50} is not allowed")
        if not isinstance(shape, (list, tuple)) or len(shape) > MAX_NDIM:
            raise _invalid(f"shape must be a list of at most {MAX_NDIM} ints: {shape!r:.200}")
        if not all(_is_int(dim) and 0 <= dim <= max_numel for dim in shape):
            raise _invalid(f"shape {shape!r:.200} has a negative or oversized dimension")
        if math.prod(shape) > max_numel:
            raise _invalid(f"shape {shape!r:.200} has more than {max_numel} elements")
        nbytes = memoryview(buffer).nbytes
        if header["nbytes"] != nbytes:
            raise _invalid(f"header says {header['nbytes']!r:.30} bytes, buffer has {nbytes}")
        serialized = cls(Codec(codec), dtype, tuple(shape), buffer)
        check_layout(serialized)
        return serialized


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _invalid(what: str, hint: str = "the sending peer is buggy or hostile") -> InvalidTensor:
    return InvalidTensor(f"{what} - help: {hint}")


def stats_rows(shape: Sequence[int]) -> int:
    """How many (mean, std) pairs MEANSTD_16BIT sends: one per row of the last axis."""
    return math.prod(shape[:-1]) if len(shape) else 1


def _read_int64(buffer: Buffer, offset: int) -> int:
    return int(np.frombuffer(buffer, dtype="<i8", count=1, offset=offset)[0])


def check_layout(s: SerializedTensor) -> None:
    """Raise InvalidTensor unless ``s.buffer`` is exactly the codec's layout for ``s.shape``."""
    n, nbytes = math.prod(s.shape), memoryview(s.buffer).nbytes
    if s.codec != Codec.NONE and s.dtype not in FLOAT_DTYPES:
        raise _invalid(f"codec {s.codec.name} cannot carry dtype {s.dtype}")
    prefix: tuple[int, ...] = ()
    if s.codec == Codec.NONE:  # bfloat16: float32 (hivemind's default) or raw 2-byte values
        expected = {n * DTYPES[s.dtype].itemsize} | ({4 * n} if s.dtype == "bfloat16" else set())
    elif s.codec == Codec.MEANSTD_16BIT:
        expected = {2 * n + 8 * stats_rows(s.shape)}
    elif s.codec == Codec.FLOAT16:
        expected = {2 * n}
    elif s.codec in (Codec.QUANTILE_8BIT, Codec.UNIFORM_8BIT):
        expected, prefix = {8 + 4 * N_BINS + n}, (N_BINS,)
    else:
        n_blocks = -(-n // BLOCK_SIZE)
        expected, prefix = {16 + 4 * n_blocks + 4 * N_BINS + n}, (n_blocks, N_BINS)
    if nbytes not in expected:
        raise _invalid(
            f"{s.codec.name} {s.dtype}{list(s.shape)} takes {min(expected)} bytes, got {nbytes}"
        )
    if tuple(_read_int64(s.buffer, 8 * i) for i in range(len(prefix))) != prefix:
        raise _invalid(f"{s.codec.name} buffer must start with the counts {prefix}")
