"""Codecs: round-trip error bounds, hivemind's byte layouts, and hostile headers and buffers."""

from __future__ import annotations

import math

import msgpack
import numpy as np
import pytest
import torch

from kit.averaging import compression as C
from kit.averaging.compression import Codec, CompressionInfo, SerializedTensor, extract
from kit.errors import ConfigError, InvalidTensor, NonFiniteLocalTensor, NonFiniteTensor

LOSSY: list[type[C.CompressionBase]] = [
    C.Float16Compression,
    C.ScaledFloat16Compression,
    C.Quantile8BitQuantization,
    C.Uniform8BitQuantization,
    C.BlockwiseQuantization,
]
ALL: list[type[C.CompressionBase]] = [C.NoCompression, *LOSSY]


def normal(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def over_the_wire(serialized: SerializedTensor) -> SerializedTensor:
    """What a receiver rebuilds: the msgpack'd header and an immutable copy of the bytes."""
    header = msgpack.unpackb(msgpack.packb(serialized.header()))
    return SerializedTensor.from_header(header, bytes(serialized.buffer))


def round_trip(codec: C.CompressionBase, tensor: torch.Tensor) -> torch.Tensor:
    return extract(over_the_wire(codec.compress(tensor)))


def relative_error(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x.double() - y.double()).norm() / x.double().norm())


def test_wire_ids_are_hivemind_ones() -> None:
    ids = {cls.__name__: int(cls().compress(torch.ones(1)).codec) for cls in ALL}
    assert ids == {
        "NoCompression": 0,
        "ScaledFloat16Compression": 1,
        "Float16Compression": 2,
        "Quantile8BitQuantization": 3,
        "Uniform8BitQuantization": 4,
        "BlockwiseQuantization": 5,
    }


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.float16, torch.int64, torch.int8, torch.bool]
)
def test_no_compression_is_exact(dtype: torch.dtype) -> None:
    x = (normal(3, 5) * 50).to(dtype)
    y = round_trip(C.NoCompression(), x)
    assert y.dtype == dtype and y.shape == x.shape and torch.equal(x, y)


def test_bfloat16_goes_as_float32_and_raw_bf16_is_accepted() -> None:
    x = normal(100).bfloat16()
    s = C.NoCompression().compress(x)
    assert s.dtype == "bfloat16" and len(bytes(s.buffer)) == 4 * 100
    assert torch.equal(extract(over_the_wire(s)), x)
    raw = x.view(torch.int16).numpy().tobytes()  # hivemind with USE_LEGACY_BFLOAT16=0
    assert torch.equal(extract(SerializedTensor(Codec.NONE, "bfloat16", (100,), raw)), x)


def test_float16_error_bound_clamp_and_dtype() -> None:
    x = normal(10_000, seed=1)
    y = round_trip(C.Float16Compression(), x)
    assert y.dtype == torch.float32 and relative_error(x, y) <= 1e-3
    assert bool(((x - y).abs() <= x.abs() * 2**-11 + 2**-24).all())  # round to nearest fp16
    big = torch.tensor([1e6, -1e6, 70_000.0, 3.0], dtype=torch.float64)
    assert round_trip(C.Float16Compression(), big).tolist() == [65504.0, -65504.0, 65504.0, 3.0]
    assert round_trip(C.Float16Compression(), big).dtype == torch.float64


def test_scaled_float16_keeps_rows_of_any_scale() -> None:
    x = normal(4, 1000, seed=2) * torch.tensor([[1e-8], [1.0], [1e3], [1e-3]]) + 5.0e-7
    y = round_trip(C.ScaledFloat16Compression(), x)
    for row_x, row_y in zip(x, y, strict=True):  # plain fp16 would flush the 1e-8 row to zero
        assert relative_error(row_x - row_x.mean(), row_y - row_x.mean()) <= 1e-3
    flat = normal(777)
    assert relative_error(flat, round_trip(C.ScaledFloat16Compression(), flat)) <= 1e-3


def test_uniform_8bit_error_within_one_bucket() -> None:
    x = normal(50_000, seed=3) * 2 + 1
    y = round_trip(C.Uniform8BitQuantization(), x)
    mean, std = float(x.mean()), float(x.std())
    inner = (x - mean).abs() < 2.9 * std  # buckets 1..254; the end ones also hold the outliers
    assert float((x - y)[inner].abs().max()) <= 6 * std / 256 * 1.0001
    assert relative_error(x, y) < 0.03


def test_quantile_8bit_equal_ordered_buckets() -> None:
    x = torch.distributions.Laplace(0.0, 1.0).sample((60_000,))  # heavy tails: the quantile case
    s = C.Quantile8BitQuantization().compress(x)
    indices = torch.from_numpy(np.frombuffer(bytes(s.buffer), np.uint8, offset=8 + 1024).copy())
    counts = torch.bincount(indices, minlength=256)
    assert counts.min() > 0.5 * len(x) / 256 and counts.max() < 2 * len(x) / 256
    lows = [float(x[indices == k].min()) for k in range(256)]
    highs = [float(x[indices == k].max()) for k in range(256)]
    slack = (lows[-1] - highs[0]) / 2**15  # a value may land one fine bin off its bucket
    assert all(highs[k] <= lows[k + 1] + slack for k in range(255))  # buckets do not overlap
    y = extract(over_the_wire(s))
    assert all(lows[k] <= float(y[indices == k][0]) <= highs[k] for k in range(256))
    assert relative_error(x, y) < 0.1
    assert bytes(C.Quantile8BitQuantization().compress(x).buffer) == bytes(s.buffer)  # seeded


def test_blockwise_error_within_half_a_step_per_block() -> None:
    scales = torch.tensor([1e-6, 1.0, 1e4]).repeat_interleave(4096)[: 3 * 4096 - 100]
    x = normal(len(scales), seed=4) * scales
    y = round_trip(C.BlockwiseQuantization(), x)
    for block in range(3):
        xs, ys = x[block * 4096 : (block + 1) * 4096], y[block * 4096 : (block + 1) * 4096]
        half_step = float(xs.abs().max()) / 254
        assert float((xs - ys).abs().max()) <= half_step * 1.0001


def test_blockwise_decodes_the_code_in_the_buffer() -> None:
    """hivemind peers send bitsandbytes' non-linear dynamic code: decoding must use it."""
    n = 5000
    code = np.sign(np.linspace(-1, 1, 256)) * np.linspace(-1, 1, 256) ** 2
    absmax = np.array([2.0, 0.5], np.float32)
    indices = np.random.default_rng(0).integers(0, 256, n).astype(np.uint8)
    buffer = b"".join(
        [np.int64(2).tobytes(), np.int64(256).tobytes(), absmax.tobytes()]
        + [code.astype(np.float32).tobytes(), indices.tobytes()]
    )
    y = extract(SerializedTensor(Codec.BLOCKWISE_8BIT, "float32", (n,), buffer))
    expected = code.astype(np.float32)[indices] * np.repeat(absmax, 4096)[:n]
    assert np.array_equal(y.numpy(), expected)


@pytest.mark.parametrize("cls", ALL)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0), (2, 3, 4), (1,)])
def test_shapes_and_empty_tensors(cls: type[C.CompressionBase], shape: tuple[int, ...]) -> None:
    x = normal(*shape, seed=5) if shape else torch.tensor(0.75)
    y = round_trip(cls(), x)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert torch.allclose(x, y, atol=0.02 * max(x.abs().reshape(-1).tolist(), default=1.0))


@pytest.mark.parametrize("cls", LOSSY)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_lossy_codecs_restore_the_dtype(cls: type[C.CompressionBase], dtype: torch.dtype) -> None:
    x = normal(3000, seed=6).to(dtype)
    y = round_trip(cls(), x)
    assert y.dtype == dtype and relative_error(x.float(), y.float()) < 0.05


def test_layouts_byte_for_byte() -> None:
    """Sizes and offsets exactly as hivemind lays them out, decoded here by hand."""
    x = normal(10, 1000, seed=7)
    n = x.numel()
    sizes = {cls().compress(x).codec: len(bytes(cls().compress(x).buffer)) for cls in ALL}
    assert sizes == {
        Codec.NONE: 4 * n,
        Codec.MEANSTD_16BIT: 2 * n + 4 * 10 + 4 * 10,
        Codec.FLOAT16: 2 * n,
        Codec.QUANTILE_8BIT: 8 + 4 * 256 + n,
        Codec.UNIFORM_8BIT: 8 + 4 * 256 + n,
        Codec.BLOCKWISE_8BIT: 16 + 4 * 3 + 4 * 256 + n,
    }
    for cls in (C.Quantile8BitQuantization, C.Uniform8BitQuantization):
        raw = bytes(cls().compress(x).buffer)
        assert np.frombuffer(raw, "<i8", 1)[0] == 256
        manual = np.frombuffer(raw, "<f4", 256, 8)[np.frombuffer(raw, np.uint8, offset=1032)]
        assert np.array_equal(manual.reshape(10, 1000), round_trip(cls(), x).numpy())
    raw = bytes(C.ScaledFloat16Compression().compress(x).buffer)
    values = np.frombuffer(raw, "<f2", n).astype(np.float32).reshape(10, 1000)
    means = torch.from_numpy(np.frombuffer(raw, "<f4", count=10, offset=2 * n).copy())
    stds = torch.from_numpy(np.frombuffer(raw, "<f4", count=10, offset=2 * n + 40).copy())
    assert torch.allclose(means, x.mean(1), atol=1e-6)
    assert torch.allclose(torch.from_numpy(values) * stds[:, None] + means[:, None], x, atol=5e-3)
    raw = bytes(C.BlockwiseQuantization().compress(x).buffer)
    assert list(np.frombuffer(raw, "<i8", 2)) == [3, 256]
    block_max = [float(block.abs().max()) for block in x.view(-1).split(4096)]
    assert np.array_equal(np.frombuffer(raw, "<f4", 3, 16), np.array(block_max, np.float32))


def test_many_work_chunks_match_bounds() -> None:
    """Over 2**21 values, so the encoders loop over several work chunks and a tail block."""
    x = normal(2**21 + 4097, seed=8)
    for cls, bound in [(C.Uniform8BitQuantization, 0.03), (C.Quantile8BitQuantization, 0.05)]:
        assert relative_error(x, round_trip(cls(), x)) < bound
    y = round_trip(C.BlockwiseQuantization(), x)
    assert float((x - y).abs().max()) <= float(x.abs().max()) / 254 * 1.0001
    assert relative_error(x, y) < 0.015


def test_extract_copies_never_aliases() -> None:
    x = normal(100)
    buffer = bytearray(C.NoCompression().compress(x).buffer)
    y = extract(SerializedTensor(Codec.NONE, "float32", (100,), buffer))
    buffer[:] = bytes(len(buffer))
    assert torch.equal(x, y)


def test_bool_bytes_other_than_one_are_true() -> None:
    y = extract(SerializedTensor(Codec.NONE, "bool", (3,), b"\x00\x02\xff"))
    assert y.tolist() == [False, True, True]


@pytest.mark.parametrize("cls", ALL)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_compress_refuses_non_finite(cls: type[C.CompressionBase], bad: float) -> None:
    x = normal(5000)
    x[1234] = bad
    with pytest.raises(NonFiniteLocalTensor, match="help:"):
        cls().compress(x)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_float16_checks_its_output_yet_refuses_what_the_input_held(dtype: torch.dtype) -> None:
    """Float16Compression checks the float16 copy (cheaper than the input): overflow is clamped,
    NaN/inf in the input is still refused, and a float16 input is never changed."""
    big = torch.tensor([1.0, 7e4, -3.0], dtype=torch.float64).to(dtype)
    if dtype != torch.float16:  # (float16 itself cannot hold 7e4)
        assert round_trip(C.Float16Compression(), big)[1] == 65504.0
    for bad in (math.nan, math.inf, -math.inf):
        x = normal(5000).to(dtype)
        x[17] = bad
        before = x.clone()
        with pytest.raises(NonFiniteLocalTensor, match="help:"):
            C.Float16Compression().compress(x)
        assert torch.equal(x.isnan(), before.isnan()) and torch.equal(
            x.nan_to_num(), before.nan_to_num()
        )


def test_float16_encodings_reuse_buffers_once_dropped_and_never_while_kept() -> None:
    """Chunks of 64 KiB and more are encoded into reused buffers (no pages to fault in each
    round); an encoding somebody keeps is never written over."""
    x, y = normal(100_000, seed=3), normal(100_000, seed=4)
    kept = C.Float16Compression().compress(x)
    expected = bytes(kept.buffer)
    dropped = C.Float16Compression().compress(y)
    where = np.frombuffer(dropped.buffer, dtype=np.uint8).ctypes.data
    del dropped
    again = C.Float16Compression().compress(y)
    assert np.frombuffer(again.buffer, dtype=np.uint8).ctypes.data == where
    assert bytes(kept.buffer) == expected and torch.equal(extract(again), y.half().float())


def test_non_finite_received_values_are_refused() -> None:
    nan16 = np.array([1.0, np.nan], np.float16).tobytes()
    serialized = SerializedTensor(Codec.FLOAT16, "float32", (2,), nan16)
    with pytest.raises(NonFiniteTensor, match="help:"):
        extract(serialized)
    assert math.isnan(extract(serialized, allow_non_finite=True)[1])
    codebook = np.full(256, np.inf, np.float32)
    quantized = np.int64(256).tobytes() + codebook.tobytes() + bytes(10)
    with pytest.raises(NonFiniteTensor):
        extract(
            SerializedTensor.from_header(
                {"codec": 4, "dtype": "float32", "shape": [10], "nbytes": len(quantized)}, quantized
            )
        )


def test_masks_with_inf_can_opt_in() -> None:
    mask = torch.tensor([0.0, -math.inf])
    s = C.NoCompression(allow_non_finite=True).compress(mask)
    assert torch.equal(extract(over_the_wire(s), allow_non_finite=True), mask)


def test_is_finite() -> None:
    assert C.is_finite(normal(100)) and C.is_finite(torch.arange(5)) and C.is_finite(torch.empty(0))
    assert not C.is_finite(torch.tensor([1.0, math.nan])) and not C.is_finite(
        torch.tensor([math.inf, -math.inf])
    )
    assert C.is_finite(torch.full((10,), 3e38))  # the sum overflows, the values are fine
    for dtype in (torch.float16, torch.bfloat16):  # summed in their own dtype first
        big = torch.full((100,), 60000.0, dtype=dtype)  # that sum overflows: a float32 one
        assert C.is_finite(big)
        for bad in (math.nan, math.inf, -math.inf):
            poisoned = big.clone()
            poisoned[41] = bad
            assert not C.is_finite(poisoned) and not C.is_finite(poisoned[40:50] * 0 + bad)
    assert not C.is_finite(torch.tensor([1.0, math.inf], dtype=torch.float16))


def good_header(**changes: object) -> tuple[dict, bytes]:
    s = C.Uniform8BitQuantization().compress(normal(100))
    header = {**s.header(), **changes}
    return header, bytes(s.buffer)


@pytest.mark.parametrize(
    "header, buffer",
    [
        good_header(nbytes=1131),  # nbytes disagrees with the buffer
        (good_header()[0], good_header()[1][:-1]),  # one byte short
        (good_header(nbytes=1133)[0], good_header()[1] + b"\x00"),  # one byte too many
        good_header(shape=[2**40]),  # more elements than allowed
        good_header(shape=[2**20, 2**20, 2**20]),  # product too large
        good_header(shape=[-100]),
        good_header(shape=[10.0, 10]),
        good_header(shape=[True] * 100),
        good_header(shape=[1] * 33),  # too many axes
        good_header(shape="100"),
        good_header(codec=9),  # unknown codec
        good_header(codec=-1),
        good_header(codec="4"),
        good_header(codec=True),
        good_header(dtype="complex64"),  # not on the allow-list
        good_header(dtype="object"),
        good_header(dtype=5),
        good_header(dtype="int64"),  # an 8-bit codec cannot carry integers
        ({"codec": 4, "dtype": "float32", "shape": [100]}, good_header()[1]),  # missing key
        (good_header(extra=1)[0], good_header()[1]),  # unknown key
        ([4, "float32", [100], 1132], good_header()[1]),  # not a mapping
        ({**good_header()[0], "codec": 3}, b"\x01" + good_header()[1][1:]),  # codebook length 257
    ],
)
def test_hostile_headers_are_refused(header: object, buffer: bytes) -> None:
    with pytest.raises(InvalidTensor, match="help:"):
        SerializedTensor.from_header(header, buffer)


def test_blockwise_counts_are_checked() -> None:
    s = C.BlockwiseQuantization().compress(normal(5000))
    raw = bytearray(bytes(s.buffer))
    raw[0:8] = np.int64(3).tobytes()  # 3 absmax entries claimed, 2 blocks
    with pytest.raises(InvalidTensor):
        SerializedTensor.from_header(s.header(), bytes(raw))
    with pytest.raises(InvalidTensor):  # extract checks a hand-built SerializedTensor too
        extract(SerializedTensor(Codec.BLOCKWISE_8BIT, "float32", (5000,), bytes(raw)))


def test_size_limit_is_configurable() -> None:
    header, buffer = good_header()
    with pytest.raises(InvalidTensor):
        SerializedTensor.from_header(header, buffer, max_numel=99)
    assert SerializedTensor.from_header(header, buffer, max_numel=100).shape == (100,)


def test_lossy_codecs_refuse_integers() -> None:
    with pytest.raises(ConfigError, match="help:"):
        C.Float16Compression().compress(torch.arange(10))


def test_compression_ratios() -> None:
    info32 = CompressionInfo.from_tensor(normal(10))
    info16 = CompressionInfo.from_tensor(normal(10).half())
    assert [cls().estimate_compression_ratio(info32) for cls in ALL] == [
        1,
        0.5,
        0.5,
        0.25,
        0.25,
        0.25,
    ]
    assert C.Uniform8BitQuantization().estimate_compression_ratio(info16) == 0.5


def test_compress_leaves_the_input_alone() -> None:
    x = normal(3, 1000)
    before = x.clone()
    for cls in ALL:
        cls().compress(x)
    assert torch.equal(x, before)


@pytest.mark.parametrize("sent_dtype", [torch.float16, torch.float32])
def test_float16_difference_is_the_compressed_difference_byte_for_byte(
    sent_dtype: torch.dtype,
) -> None:
    g = torch.Generator().manual_seed(3)
    average = torch.randn(300_001, generator=g)
    sent = (average + torch.randn(300_001, generator=g) * 0.1).to(sent_dtype)
    codec = C.Float16Compression()
    for a in (average, average * 1e5):  # within float16's range, then beyond it (clamped)
        got = codec.compress_difference(a, sent)
        want = codec.compress(a - sent.float())
        assert got.header() == want.header()
        assert bytes(memoryview(got.buffer).cast("B")) == bytes(memoryview(want.buffer).cast("B"))
    poisoned = average.clone()
    poisoned[123] = float("nan")
    with pytest.raises(NonFiniteLocalTensor):
        codec.compress_difference(poisoned, sent)
    # the scaled codec (a subclass) encodes the difference its own way
    scaled = C.ScaledFloat16Compression()
    assert (
        scaled.compress_difference(average, sent).header()
        == scaled.compress(average - sent.float()).header()
    )
