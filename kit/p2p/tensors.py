"""Tensors on the wire: a small msgpack header, then the raw bytes, validated before use (torch-free).

A tensor travels on a stream as one header message ``{"dtype", "shape", "nbytes"}`` followed by
its bytes in messages of at most ``chunk_size``. The receiver checks the header against an
allow-list of dtypes and its own limits (and, when it knows what to expect, the exact dtype and
shape) *before* allocating anything, then receives the bytes straight into one buffer. Nothing
a peer sends is ever unpickled or ``torch.load``-ed: the bytes are only ever viewed as numbers.

Torch-free on purpose: kit.averaging turns the buffer into a tensor with ``torch.frombuffer``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from kit.errors import InvalidTensor, RemoteProtocolError
from kit.p2p import wire
from kit.p2p.api import StreamAPI

#: dtype name → bytes per element. Names are torch's (and numpy's, but for bfloat16).
DTYPE_SIZES = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "bool": 1,
}
DEFAULT_CHUNK = 1024**2 - 64  # one chunk per frame, relay margin included


@dataclass(frozen=True)
class TensorLimits:
    """What a receiver accepts from a peer; raise ``max_bytes`` for models over 2 GiB per tensor."""

    max_bytes: int = 2 * 1024**3  # largest tensor accepted
    max_ndim: int = 8  # most dimensions accepted


@dataclass(frozen=True)
class TensorHeader:
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_SIZES[self.dtype]

    def to_dict(self) -> dict[str, object]:
        return {"dtype": self.dtype, "shape": list(self.shape), "nbytes": self.nbytes}

    @classmethod
    def from_dict(cls, body: object, limits: TensorLimits) -> TensorHeader:
        """Validate a header a peer sent. Raises InvalidTensor on anything off."""
        if not isinstance(body, dict):
            raise InvalidTensor("tensor header is not a map")
        dtype, shape, nbytes = body.get("dtype"), body.get("shape"), body.get("nbytes")
        if dtype not in DTYPE_SIZES:
            raise InvalidTensor(
                f"dtype {dtype!r} is not allowed (allowed: {', '.join(DTYPE_SIZES)})"
            )
        if not isinstance(shape, list) or len(shape) > limits.max_ndim:
            raise InvalidTensor(f"shape must be a list of at most {limits.max_ndim} dimensions")
        if not all(
            isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**48 for d in shape
        ):
            raise InvalidTensor(f"shape {shape!r:.100} has invalid dimensions")
        header = cls(str(dtype), tuple(shape))
        if header.nbytes > limits.max_bytes:
            raise InvalidTensor(
                f"tensor of {header.nbytes} bytes exceeds the limit of {limits.max_bytes}"
            )
        if nbytes != header.nbytes:
            raise InvalidTensor(
                f"header says {nbytes!r} bytes, dtype and shape give {header.nbytes}"
            )
        return header

    def check_expected(self, expected: TensorHeader | None) -> None:
        if expected is not None and self != expected:
            raise InvalidTensor(
                f"expected {expected.dtype}{list(expected.shape)}, got {self.dtype}{list(self.shape)}"
            )


async def send_tensor(
    stream: StreamAPI,
    header: TensorHeader,
    data: memoryview | bytes,
    *,
    chunk_size: int = DEFAULT_CHUNK,
    timeout: float | None = None,
) -> None:
    """Send one tensor: its header, then its bytes (``data`` must hold exactly ``header.nbytes``)."""
    view = memoryview(data).cast("B")
    if len(view) != header.nbytes:
        raise ValueError(f"{len(view)} bytes given for a tensor of {header.nbytes}")
    await stream.send_message(wire.packb(header.to_dict()), timeout=timeout)
    for start in range(0, len(view), chunk_size):
        await stream.send_message(view[start : start + chunk_size], timeout=timeout)


async def receive_tensor(
    stream: StreamAPI,
    *,
    limits: TensorLimits | None = None,
    expected: TensorHeader | None = None,
    timeout: float | None = None,
    allocate: Callable[[TensorHeader], memoryview] | None = None,
) -> tuple[TensorHeader, bytearray | memoryview] | None:
    """Receive one tensor sent by :func:`send_tensor`; ``None`` if the stream ended instead.

    ``allocate(header)`` gives the writable buffer of ``header.nbytes`` bytes the payload is read
    into, once the header is validated (e.g. a tensor's own memory: no copy afterwards, and no
    zero-filling before, which costs as much as the copy); default: a new ``bytearray``.

    Raises:
        InvalidTensor: forbidden dtype, bad shape, too large, or not the ``expected`` one.
        RemoteProtocolError: the bytes do not match the header.
    """
    raw = await stream.receive_message(max_size=4096, timeout=timeout)
    if raw is None:
        return None
    header = TensorHeader.from_dict(wire.unpackb(raw, "tensor header"), limits or TensorLimits())
    header.check_expected(expected)
    buffer = bytearray(header.nbytes) if allocate is None else allocate(header)
    view = memoryview(buffer).cast("B")
    if len(view) != header.nbytes or view.readonly:
        raise ValueError(f"allocate() gave {len(view)} bytes for a tensor of {header.nbytes}")
    received = 0
    receive_into = getattr(stream, "receive_message_into", None)  # kit.p2p streams: no extra copy
    while received < header.nbytes:
        size: int | None
        if receive_into is not None:
            size = await receive_into(view[received:], timeout=timeout)
        else:
            chunk = await stream.receive_message(max_size=header.nbytes - received, timeout=timeout)
            size = None if chunk is None else len(chunk)
            if chunk is not None:
                view[received : received + len(chunk)] = chunk
        if size is None:
            raise RemoteProtocolError(f"tensor ended after {received} of {header.nbytes} bytes")
        received += size
    return header, buffer
