"""How one chunk of an all-reduce part travels on a stream, and the memory it lands in.

Holds the protocol name, the reading helpers (a small msgpack header, then the payload received
straight into its destination when the stream allows it), the checks a chunk passes before
anything is allocated or decoded (``tensor_header``, ``payload_bound``, ``decode_chunk``), and
``RoundBuffers`` (what a peer keeps from round to round). It does not hold the round's logic
(``kit.averaging.allreduce``) or the codecs (``kit.averaging.compression``).

A chunk is one message: a 2-byte length, the msgpack header ``{chunk, codec, dtype, shape,
nbytes}`` (plus ``peers`` and ``delta`` on the way back), then ``nbytes`` of payload laid out as
the codec says. One message, not a header message and a payload message (protocol 2 did that):
half the messages, and the payload arrives in the buffer the frame was read into, so values that
need no decoding (``arrived_values``: raw values of the tensor's own dtype, or FLOAT16 values)
are summed, staged or subtracted straight from there (no copy at all) and other codecs decode
from there.
"""

from __future__ import annotations

import struct
import sys
from typing import Any, Protocol, cast

import torch

from kit.averaging.compression import DTYPE_NAMES, Codec, SerializedTensor, extract
from kit.averaging.partition import ChunkSpec
from kit.errors import InvalidTensor, RemoteProtocolError
from kit.p2p import wire
from kit.p2p.api import StreamAPI

PROTOCOL = "kit/averaging/allreduce/3"  # 2: differences for lossy codecs; 3: one message a chunk
MAX_HEADER = 4096  # bytes of one stream or chunk header
_HEAD_LENGTH = struct.Struct("!H")


class PartsStream(Protocol):
    """A stream that sends a message given in parts without joining them, and hands a received
    one out as the frames it arrived in (``kit.p2p.stream.Stream``)."""

    async def send_message(self, data: Any, *, timeout: float | None = None) -> None: ...

    async def receive_message_parts(
        self, *, max_size: int, timeout: float | None = None
    ) -> list[memoryview] | None: ...


class RoundBuffers:
    """Memory reused from round to round: the accumulator of this peer's part (received chunks
    and averages are used in the frames they arrived in)."""

    def __init__(self) -> None:
        self.accumulator = torch.empty(0, dtype=torch.float32)

    def accumulator_for(self, size: int) -> torch.Tensor:
        """A float32 buffer of at least ``size`` elements. With room to spare: this peer's part
        changes a little from round to round (load balancing by measured bandwidth), and a new
        buffer each time it grows would fault all its pages in again (``benchmarks/allreduce.py``,
        ``minor_faults``: ~7,000 a round and peer for a 72 MB vector of 4 peers)."""
        if len(self.accumulator) < size:
            self.accumulator = torch.empty(size + size // 4, dtype=torch.float32)
        return self.accumulator


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


def plain_float16(header: dict[str, Any], spec: ChunkSpec, dtype: torch.dtype) -> bool:
    """FLOAT16 values of a float tensor's chunk, nothing else in the payload: usable as they
    are (a float16 view of the frame), converted only where they are written."""
    return (
        header.get("codec") == Codec.FLOAT16
        and dtype.is_floating_point
        and sys.byteorder == "little"  # the wire's byte order
        and header.get("dtype") == DTYPE_NAMES.get(dtype)
        and header.get("shape") == [spec.size]
        and header.get("nbytes") == spec.size * 2
    )


def arrived_values(
    header: dict[str, Any], payload: memoryview, spec: ChunkSpec, dtype: torch.dtype
) -> torch.Tensor | None:
    """The chunk's values as they arrived, a view of ``payload`` (no copy), when they need no
    decoding: raw values of the tensor's dtype, or float16 values of a float tensor (whoever
    writes, adds or subtracts them widens them in the same pass). None: ``decode_chunk`` them."""
    if is_raw(header, spec, dtype):
        return torch.frombuffer(payload, dtype=dtype, count=spec.size)
    if plain_float16(header, spec, dtype):
        return torch.frombuffer(payload, dtype=torch.float16, count=spec.size)
    return None


def chunk_head(header: dict[str, Any]) -> bytes:
    """The bytes before a chunk's payload: the header's length, then the header."""
    packed = wire.packb(header)
    return _HEAD_LENGTH.pack(len(packed)) + packed


async def send_chunk(
    stream: StreamAPI, head: bytes, payload: memoryview | None, timeout: float | None
) -> None:
    """Send one chunk message (``head`` from :func:`chunk_head`) without copying the payload."""
    if payload is None:
        await stream.send_message(head, timeout=timeout)
    elif hasattr(stream, "receive_message_parts"):  # (a Protocol isinstance costs ~20 us)
        await cast(PartsStream, stream).send_message((head, payload), timeout=timeout)
    else:  # a stream that takes one buffer (in-memory test networks)
        await stream.send_message(b"".join((head, payload)), timeout=timeout)


async def receive_chunk(
    stream: StreamAPI, max_payload: int, timeout: float | None
) -> tuple[dict[str, Any], memoryview] | None:
    """The next chunk: its header (``chunk`` checked to be an int) and its payload, a writable
    view of the frame it arrived in when it fits one (else one joined copy); None if the other
    side closed the stream.

    Raises:
        FrameTooLarge: the message is larger than ``max_payload`` plus a header.
        RemoteProtocolError: no valid header.
    """
    limit = _HEAD_LENGTH.size + MAX_HEADER + max_payload
    parts: list[memoryview] | None
    if hasattr(stream, "receive_message_parts"):
        parts = await cast(PartsStream, stream).receive_message_parts(
            max_size=limit, timeout=timeout
        )
    else:
        message = await stream.receive_message(max_size=limit, timeout=timeout)
        parts = None if message is None else [memoryview(bytearray(message))]
    return None if parts is None else parse_chunk(parts)


def parse_chunk(parts: list[memoryview]) -> tuple[dict[str, Any], memoryview]:
    """A chunk message, given as the frames it arrived in: its header and its payload (see
    :func:`receive_chunk`)."""
    first = parts[0]
    if len(parts) > 1 and len(first) < _HEAD_LENGTH.size + MAX_HEADER:  # a header cut in two
        first, parts = memoryview(bytearray().join(parts)), []
    else:
        parts = parts[1:]
    if len(first) < _HEAD_LENGTH.size:
        raise RemoteProtocolError(f"a chunk message of {len(first)} bytes has no header")
    (length,) = _HEAD_LENGTH.unpack_from(first)
    end = _HEAD_LENGTH.size + length
    if length > MAX_HEADER or end > len(first):
        raise RemoteProtocolError(f"a chunk header of {length} bytes (at most {MAX_HEADER})")
    header = wire.decode_map(first[_HEAD_LENGTH.size : end], "all-reduce chunk", {"chunk": int})
    payload = first[end:]
    if parts:  # the payload spans frames: one copy joins them
        payload = memoryview(bytearray().join([payload, *parts]))
    elif payload.readonly:
        payload = memoryview(bytearray(payload))
    return header, payload


def payload_of(header: dict[str, Any], payload: memoryview) -> memoryview:
    """The payload, checked to be exactly the ``nbytes`` its (already bounded) header says."""
    if len(payload) != header["nbytes"]:
        raise RemoteProtocolError(
            f"expected a payload of {header['nbytes']} bytes, got {len(payload)}"
        )
    return payload


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


def tensor_header(header: dict[str, Any], spec: ChunkSpec, bound: int) -> dict[str, Any]:
    """The codec header of a chunk, its size checked against the chunk before any allocation."""
    tensor = {key: header.get(key) for key in ("codec", "dtype", "shape", "nbytes")}
    nbytes = tensor["nbytes"]
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or not 0 <= nbytes <= bound:
        raise RemoteProtocolError(f"chunk payload of {nbytes!r:.20} bytes (at most {bound})")
    return tensor


def decode_chunk(
    header: dict[str, Any],
    payload: memoryview,
    spec: ChunkSpec,
    dtype: torch.dtype,
    *,
    check_finite: bool = True,
) -> torch.Tensor:
    """Decode a chunk whose codec header is ``header`` (untrusted) into a flat tensor.

    ``check_finite=False``: the caller checks the values itself, once (a contribution by the
    reducer that sums it, a difference once it is added to our values).

    Raises:
        InvalidTensor: another shape or dtype than the chunk's, a payload that does not match
            the codec's layout, or (``check_finite``) NaN/inf values.
    """
    if header.get("shape") != [spec.size] or header.get("dtype") != DTYPE_NAMES.get(dtype):
        raise InvalidTensor(
            f"chunk {spec.chunk_index} is {header.get('dtype')!r:.20}{header.get('shape')!r:.40},"
            f" expected {DTYPE_NAMES.get(dtype)}[{spec.size}]"
        )
    serialized = SerializedTensor.from_header(header, payload, max_numel=spec.size)
    return extract(serialized, allow_non_finite=not check_finite).view(-1)
