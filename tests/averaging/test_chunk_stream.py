"""Chunks on a stream: payload bounds hold for every codec, raw chunks are recognised, decoding
checks shape and dtype, and buffers are reused."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kit.averaging.chunk_stream import (
    RoundBuffers,
    chunk_head,
    decode_chunk,
    is_raw,
    payload_bound,
    payload_of,
    plain_float16,
    receive_chunk,
    send_chunk,
    tensor_header,
)
from kit.averaging.compression import (
    BlockwiseQuantization,
    CompressionBase,
    Float16Compression,
    NoCompression,
    Quantile8BitQuantization,
    ScaledFloat16Compression,
    Uniform8BitQuantization,
)
from kit.averaging.partition import ChunkSpec
from kit.errors import FrameTooLarge, InvalidTensor, RemoteProtocolError
from kit.p2p.api import StreamAPI
from kit.p2p.memory import MemoryNetwork

CODECS = [
    NoCompression(),
    Float16Compression(),
    ScaledFloat16Compression(),
    Uniform8BitQuantization(),
    Quantile8BitQuantization(),
    BlockwiseQuantization(),
]


def spec(size: int) -> ChunkSpec:
    return ChunkSpec(0, 0, 0, 0, 0, size)


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: type(c).__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_every_codec_fits_the_payload_bound_and_decodes(
    codec: CompressionBase, dtype: torch.dtype
) -> None:
    for size in (1, 7, 4096, 4097, 20000):
        values = torch.randn(size).to(dtype)
        serialized = codec.compress(values)
        header = serialized.header()
        payload = memoryview(serialized.buffer).cast("B")
        assert len(payload) <= payload_bound(spec(size), dtype.itemsize)
        checked = tensor_header(header, spec(size), payload_bound(spec(size), dtype.itemsize))
        decoded = decode_chunk(checked, payload, spec(size), dtype)
        assert decoded.shape == (size,) and decoded.dtype == dtype


def test_raw_chunks_are_used_as_they_are() -> None:
    header = NoCompression().compress(torch.zeros(10)).header()
    assert is_raw(header, spec(10), torch.float32)
    assert not is_raw(header, spec(11), torch.float32)
    assert not is_raw(header, spec(10), torch.float16)
    assert not is_raw({**header, "codec": 2}, spec(10), torch.float32)
    bf16 = NoCompression().compress(torch.zeros(10, dtype=torch.bfloat16)).header()
    assert not is_raw(bf16, spec(10), torch.bfloat16)  # bfloat16 travels as float32


def test_plain_float16_chunks_are_used_as_they_are() -> None:
    header = Float16Compression().compress(torch.zeros(10)).header()
    assert plain_float16(header, spec(10), torch.float32)
    assert plain_float16(
        Float16Compression().compress(torch.zeros(10, dtype=torch.float64)).header(),
        spec(10),
        torch.float64,
    )
    assert not plain_float16(header, spec(11), torch.float32)
    assert not plain_float16({**header, "nbytes": 21}, spec(10), torch.float32)
    assert not plain_float16({**header, "dtype": "float64"}, spec(10), torch.float32)
    assert not plain_float16({**header, "codec": 0}, spec(10), torch.float32)  # raw float32
    scaled = ScaledFloat16Compression().compress(torch.zeros(10)).header()
    assert not plain_float16(scaled, spec(10), torch.float32)  # statistics in the payload too


def test_sizes_are_checked_before_anything_is_allocated_or_decoded() -> None:
    header = Float16Compression().compress(torch.zeros(10)).header()
    with pytest.raises(RemoteProtocolError):
        tensor_header({**header, "nbytes": 10**12}, spec(10), 1000)
    with pytest.raises(RemoteProtocolError):
        tensor_header({**header, "nbytes": True}, spec(10), 1000)
    payload = memoryview(bytearray(20))
    with pytest.raises(InvalidTensor, match="expected float32"):
        decode_chunk({**header, "shape": [9]}, payload, spec(10), torch.float32)
    with pytest.raises(InvalidTensor, match="expected float32"):
        decode_chunk({**header, "dtype": "float64"}, payload, spec(10), torch.float32)
    with pytest.raises(InvalidTensor):
        decode_chunk(header, payload[:18], spec(10), torch.float32)  # layout: 2 bytes each
    nan = Float16Compression().compress(torch.zeros(10)).buffer
    raw = bytearray(nan)
    raw[0:2] = b"\xff\x7f"  # a float16 NaN
    with pytest.raises(InvalidTensor):
        decode_chunk(header, memoryview(raw), spec(10), torch.float32)
    # The caller that checks the values itself (the reducer) gets them as they are.
    values = decode_chunk(header, memoryview(raw), spec(10), torch.float32, check_finite=False)
    assert values.dtype == torch.float32 and values[0].isnan() and values[1:].eq(0).all()


def test_round_buffers_are_reused_and_grow_with_room_to_spare() -> None:
    buffers = RoundBuffers()
    accumulator = buffers.accumulator_for(100)
    assert buffers.accumulator_for(50) is accumulator
    assert buffers.accumulator_for(120) is accumulator  # a part a little larger: the same one
    larger = buffers.accumulator_for(200)
    assert len(larger) >= 200 and buffers.accumulator_for(240) is larger


class PartsStream:
    """A stream whose messages arrive as given frames (as kit.p2p's streams hand them out)."""

    def __init__(self, *messages: list[bytes]) -> None:
        self.messages = [[memoryview(bytearray(frame)) for frame in m] for m in messages]
        self.sent: list[tuple[bytes | memoryview, ...]] = []

    async def send_message(self, data: object, *, timeout: float | None = None) -> None:
        self.sent.append(tuple(data) if isinstance(data, tuple) else (data,))  # type: ignore[arg-type]

    async def receive_message_parts(
        self, *, max_size: int, timeout: float | None = None
    ) -> list[memoryview] | None:
        if not self.messages:
            return None
        parts = self.messages.pop(0)
        if sum(len(part) for part in parts) > max_size:
            raise FrameTooLarge(f"more than {max_size}")
        return parts

    async def receive_message(self, **kwargs: object) -> bytes | None:
        raise AssertionError("chunks are read as parts")

    async def close(self) -> None: ...

    def reset(self, code: str = "cancelled", message: str = "") -> None: ...


async def test_a_chunk_is_one_message_read_from_its_frame_without_a_copy() -> None:
    payload = torch.arange(6, dtype=torch.float32)
    head = chunk_head({"chunk": 3, "nbytes": 24})
    stream = PartsStream()
    await send_chunk(stream, head, memoryview(payload.numpy()).cast("B"), timeout=1.0)
    (sent,) = stream.sent
    assert sent[0] == head and len(sent) == 2  # header and payload go out as one message, uncopied
    frame = head + payload.numpy().tobytes()
    for frames in (
        [frame],
        [frame[:5], frame[5:]],
        [frame[: len(head) + 7], frame[len(head) + 7 :]],
    ):
        received = await receive_chunk(PartsStream(frames), 24, timeout=1.0)
        assert received is not None
        header, view = received
        assert header == {"chunk": 3, "nbytes": 24} and not view.readonly
        assert torch.equal(torch.frombuffer(view, dtype=torch.float32), payload)
    whole = memoryview(bytearray(frame))
    one = PartsStream()
    one.messages = [[whole]]
    header, view = await receive_chunk(one, 24, timeout=1.0)  # type: ignore[misc]
    assert view.obj is whole.obj  # the payload is a view of the frame: no copy
    assert await receive_chunk(PartsStream(), 24, timeout=1.0) is None


@pytest.mark.parametrize(
    ("frame", "problem"),
    [
        (b"\x00", "no header"),
        (b"\x20\x00" + b"x" * 10, "chunk header of 8192 bytes"),
        (b"\x00\x05abc", "chunk header of 5 bytes"),
        (b"\x00\x01\xc1", "not valid msgpack"),
        (chunk_head({"chunk": "3"}), "field 'chunk'"),
    ],
)
async def test_malformed_chunk_messages_are_typed_errors(frame: bytes, problem: str) -> None:
    with pytest.raises(RemoteProtocolError, match=problem):
        await receive_chunk(PartsStream([frame]), 100, timeout=1.0)
    with pytest.raises(FrameTooLarge):
        await receive_chunk(PartsStream([chunk_head({"chunk": 0}) + bytes(5000)]), 100, timeout=1.0)
    header = {"chunk": 0, "nbytes": 8}
    with pytest.raises(RemoteProtocolError, match="expected a payload of 8 bytes, got 4"):
        payload_of(header, memoryview(bytes(4)))


async def test_streams_that_take_one_buffer_get_the_chunk_joined() -> None:
    network = MemoryNetwork()
    a, b = await network.create_peer(), await network.create_peer()
    received: list[tuple[dict, bytes]] = []

    async def serve(stream: StreamAPI) -> None:
        result = await receive_chunk(stream, 16, timeout=2.0)
        assert result is not None
        received.append((result[0], bytes(result[1])))

    b.add_stream_handler("test/chunk", serve)
    a.add_address(b.peer_id, f"memory://{b.peer_id.to_base58()}")
    stream = await a.open_stream(b.peer_id, "test/chunk", timeout=2.0)
    await send_chunk(stream, chunk_head({"chunk": 1}), memoryview(b"0123456789abcdef"), 2.0)
    for _ in range(200):
        if received:
            break
        await asyncio.sleep(0.01)
    assert received == [({"chunk": 1}, b"0123456789abcdef")]
    await a.shutdown()
    await b.shutdown()
