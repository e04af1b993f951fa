"""How one chunk of an all-reduce part travels on a stream, and the memory it lands in.

Holds the protocol name, the reading helpers (a small msgpack header, then the payload received
straight into its destination when the stream allows it), the checks a chunk passes before
anything is allocated or decoded (``tensor_header``, ``payload_bound``, ``decode_chunk``), and
``RoundBuffers`` (what a peer keeps from round to round). It does not hold the round's logic
(``kit.averaging.allreduce``) or the codecs (``kit.averaging.compression``).

A chunk is two messages: ``{chunk, codec, dtype, shape, nbytes}`` (plus ``peers`` on the way
back), then ``nbytes`` of payload laid out as the codec says. Raw values of the tensor's own
dtype (``is_raw``) are used in place: no decode, no copy beyond the stream's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kit.averaging.compression import DTYPE_NAMES, Codec, SerializedTensor, extract
from kit.averaging.partition import ChunkSpec
from kit.errors import InvalidTensor, RemoteProtocolError
from kit.p2p import wire
from kit.p2p.api import StreamAPI

PROTOCOL = "kit/averaging/allreduce/2"  # 2: differences for lossy codecs
MAX_HEADER = 4096  # bytes of one stream or chunk header


class RoundBuffers:
    """Memory reused from round to round: averages in transit, the accumulator, receive buffers."""

    def __init__(self) -> None:
        self.staging: list[torch.Tensor] = []  # flat copies of the tensors: averages land here
        self.accumulator = torch.empty(0, dtype=torch.float32)
        self._free: list[bytearray] = []

    def staging_for(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        shapes = [(t.numel(), t.dtype) for t in tensors]
        if [(s.numel(), s.dtype) for s in self.staging] != shapes:
            self.staging = [torch.empty(n, dtype=dtype) for n, dtype in shapes]
        return self.staging

    def accumulator_for(self, size: int) -> torch.Tensor:
        if len(self.accumulator) < size:
            self.accumulator = torch.empty(size, dtype=torch.float32)
        return self.accumulator

    def take(self, size: int) -> bytearray:
        for i, buffer in enumerate(self._free):
            if len(buffer) >= size:
                return self._free.pop(i)
        return bytearray(size)

    def give_back(self, buffer: bytearray) -> None:
        if len(self._free) < 16:  # a few per stream of a large group; more is garbage
            self._free.append(buffer)


def payload_bound(spec: ChunkSpec, itemsize: int) -> int:
    """The largest payload any codec's layout gives for this chunk (see compression's layouts)."""
    return spec.size * max(itemsize, 4) + 4 * (spec.size // 4096 + 1) + 2048


def is_raw(header: dict[str, Any], spec: ChunkSpec, dtype: torch.dtype) -> bool:
    """Raw values of exactly the tensor's dtype: use the received bytes as they are."""
    return (
        header.get("codec") == Codec.NONE
        and header.get("dtype") == DTYPE_NAMES.get(dtype)
        and dtype not in (torch.bool, torch.bfloat16)
        and header.get("shape") == [spec.size]
        and header.get("nbytes") == spec.size * dtype.itemsize
    )


async def receive_into(stream: StreamAPI, view: memoryview, timeout: float | None) -> None:
    """Receive one message of exactly ``len(view)`` bytes into ``view``."""
    receive_into = getattr(stream, "receive_message_into", None)  # kit.p2p streams: no copy
    if receive_into is not None:
        size = await receive_into(view, timeout=timeout)
    else:
        message = await stream.receive_message(max_size=len(view), timeout=timeout)
        size = None if message is None else len(message)
        if message is not None:
            view[: len(message)] = message
    if size != len(view):
        raise RemoteProtocolError(f"expected a payload of {len(view)} bytes, got {size}")


def encode_peer_set(mask: int) -> int | bytes:
    """The set of senders averaged into a chunk (bit i: member i), as it travels: msgpack
    integers stop at 64 bits, so larger groups send the bits as big-endian bytes."""
    return mask if mask < 2**63 else mask.to_bytes((mask.bit_length() + 7) // 8, "big")


def decode_peer_set(value: Any) -> int | None:
    """The bit mask sent by :func:`encode_peer_set`, or None if it is not one."""
    if isinstance(value, bytes) and len(value) <= 64:
        return int.from_bytes(value, "big")
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


async def receive_header(stream: StreamAPI, timeout: float | None) -> dict[str, Any] | None:
    """The next chunk header, or None if the other side closed the stream."""
    raw = await stream.receive_message(max_size=MAX_HEADER, timeout=timeout)
    if raw is None:
        return None
    return wire.decode_map(raw, "all-reduce chunk header", {"chunk": int})


def tensor_header(header: dict[str, Any], spec: ChunkSpec, bound: int) -> dict[str, Any]:
    """The codec header of a chunk, its size checked against the chunk before any allocation."""
    tensor = {key: header.get(key) for key in ("codec", "dtype", "shape", "nbytes")}
    nbytes = tensor["nbytes"]
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or not 0 <= nbytes <= bound:
        raise RemoteProtocolError(f"chunk payload of {nbytes!r:.20} bytes (at most {bound})")
    return tensor


def decode_chunk(
    header: dict[str, Any], payload: memoryview, spec: ChunkSpec, dtype: torch.dtype
) -> torch.Tensor:
    """Decode a chunk whose codec header is ``header`` (untrusted) into a flat tensor.

    Raises:
        InvalidTensor: another shape or dtype than the chunk's, a payload that does not match
            the codec's layout, or NaN/inf values.
    """
    if header.get("shape") != [spec.size] or header.get("dtype") != DTYPE_NAMES.get(dtype):
        raise InvalidTensor(
            f"chunk {spec.chunk_index} is {header.get('dtype')!r:.20}{header.get('shape')!r:.40},"
            f" expected {DTYPE_NAMES.get(dtype)}[{spec.size}]"
        )
    serialized = SerializedTensor.from_header(header, payload, max_numel=spec.size)
    return extract(serialized).view(-1)
