"""Chunks on a stream: payload bounds hold for every codec, raw chunks are recognised, decoding
checks shape and dtype, and buffers are reused."""

from __future__ import annotations

import pytest
import torch

from kit.averaging.chunk_stream import (
    RoundBuffers,
    decode_chunk,
    is_raw,
    payload_bound,
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
from kit.errors import InvalidTensor, RemoteProtocolError

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


def test_round_buffers_are_reused() -> None:
    buffers = RoundBuffers()
    tensors = [torch.zeros(5), torch.zeros(3, dtype=torch.float16)]
    staging = buffers.staging_for(tensors)
    assert [(s.numel(), s.dtype) for s in staging] == [(5, torch.float32), (3, torch.float16)]
    assert buffers.staging_for(tensors) is staging
    accumulator = buffers.accumulator_for(100)
    assert buffers.accumulator_for(50) is accumulator
    buffer = buffers.take(64)
    buffers.give_back(buffer)
    assert buffers.take(32) is buffer and len(buffers.take(32)) == 32
