"""What an aggregator sends back: one encoding of the average, or each sender's difference."""

from __future__ import annotations

import gc
import weakref

import torch

from kit.averaging.adaptive_compression import PerTensorCompression, SizeAdaptiveCompression
from kit.averaging.averages import OutgoingAverages, is_lossless
from kit.averaging.chunk_stream import decode_chunk, parse_chunk
from kit.averaging.compression import (
    CompressionInfo,
    Float16Compression,
    NoCompression,
    TensorDescriptor,
    Uniform8BitQuantization,
)
from kit.averaging.partition import PartitionPlan
from kit.averaging.reducer import PartReducer


def reducer_of(values: dict[str, torch.Tensor]) -> tuple[PartitionPlan, PartReducer]:
    """One part of one 8-element tensor (a single chunk), reduced over ``values``' senders."""
    plan = PartitionPlan.build([TensorDescriptor.from_tensor(torch.zeros(8))], [8], 8)
    reducer = PartReducer(plan, 0, dict.fromkeys(values, 1.0), "round")
    for sender, value in values.items():
        reducer.accept(sender, "round", 0, 0, value)
    return plan, reducer


def decoded(
    encoded: tuple[bytes, memoryview | None], plan: PartitionPlan
) -> tuple[dict, torch.Tensor]:
    header, _ = parse_chunk([memoryview(encoded[0])])
    assert encoded[1] is not None
    codec = {k: header[k] for k in ("codec", "dtype", "shape", "nbytes")}
    return header, decode_chunk(codec, encoded[1], plan.parts[0][0], torch.float32)


def test_lossless_chunks_are_encoded_once_for_every_sender() -> None:
    values = {"a": torch.arange(8.0), "b": torch.arange(8.0) * 3}
    plan, reducer = reducer_of(values)
    averages = OutgoingAverages(plan, reducer, NoCompression(), {"a": 1, "b": 2})
    assert averages.lossy == [False] and not averages.done(0)
    averages.complete(0)
    assert averages.done(0)
    assert averages.for_sender("a", 0) is averages.for_sender("b", 0)  # the same bytes
    header, average = decoded(averages.for_sender("a", 0), plan)
    assert header["peers"] == 3 and header["delta"] is False
    assert torch.equal(average, torch.arange(8.0) * 2)


def test_lossy_chunks_give_each_sender_its_difference() -> None:
    values = {"a": torch.linspace(10, 20, 8), "b": torch.linspace(30, 40, 8)}
    plan, reducer = reducer_of(values)
    averages = OutgoingAverages(plan, reducer, Float16Compression(), {"a": 1, "b": 2})
    averages.keep_sent("a", 0, values["a"].clone())
    averages.complete(0)
    header, delta = decoded(averages.for_sender("a", 0), plan)
    assert header["delta"] is True and header["peers"] == 3
    average = (values["a"] + values["b"]) / 2
    torch.testing.assert_close(values["a"] + delta, average, rtol=0, atol=2e-3)
    # A sender whose chunk was not kept (rejected on arrival) gets the average itself.
    header, plain = decoded(averages.for_sender("b", 0), plan)
    assert header["delta"] is False
    torch.testing.assert_close(plain, average, rtol=0, atol=2e-2)


def test_a_sender_left_out_for_nan_gets_the_average_not_a_difference() -> None:
    """Its chunk was kept for its delta before the reducer found the NaN (at the chunk's
    completion): it gets the average itself, finite, like a sender rejected on arrival."""
    values = {"a": torch.linspace(10, 20, 8), "b": torch.full((8,), float("nan"))}
    plan, reducer = reducer_of(values)
    averages = OutgoingAverages(plan, reducer, Float16Compression(), {"a": 1, "b": 2})
    for sender, value in values.items():
        averages.keep_sent(sender, 0, value.clone())
    averages.complete(0)
    assert reducer.report().chunk_peers[0] == {"a"}
    header, plain = decoded(averages.for_sender("b", 0), plan)
    assert header["delta"] is False and header["peers"] == 1
    torch.testing.assert_close(plain, values["a"], rtol=0, atol=2e-2)
    header, delta = decoded(averages.for_sender("a", 0), plan)
    assert header["delta"] is True and torch.equal(delta, torch.zeros(8))


def test_nobody_delivered_means_an_empty_answer() -> None:
    plan = PartitionPlan.build([TensorDescriptor.from_tensor(torch.zeros(8))], [8], 8)
    reducer = PartReducer(plan, 0, {"a": 1.0}, "round")
    reducer.exclude("a")
    averages = OutgoingAverages(plan, reducer, Float16Compression(), {"a": 1})
    averages.complete(0)
    header, _ = parse_chunk([memoryview(averages.for_sender("a", 0)[0])])
    assert header == {"chunk": 0, "peers": 0} and averages.for_sender("a", 0)[1] is None


def test_lossless_means_no_compression_even_through_adaptive_codecs() -> None:
    small = CompressionInfo(0, TensorDescriptor.from_tensor(torch.zeros(10)))
    large = CompressionInfo(1, TensorDescriptor.from_tensor(torch.zeros(10_000)))
    adaptive = SizeAdaptiveCompression(1000, NoCompression(), Uniform8BitQuantization())
    assert is_lossless(adaptive, small) and not is_lossless(adaptive, large)
    per_tensor = PerTensorCompression([NoCompression(), Float16Compression()])
    assert is_lossless(per_tensor, small) and not is_lossless(per_tensor, large)


def test_a_shared_float16_average_is_kept_as_encoded_until_the_round_is_released() -> None:
    """Without deltas every member writes the decoded shared encoding: this peer keeps the very
    float16 bytes it sends (the commit widens them), and lets go of them on release."""
    values = {"a": torch.linspace(10, 20, 8), "b": torch.linspace(30, 40, 8)}
    plan, reducer = reducer_of(values)
    averages = OutgoingAverages(plan, reducer, Float16Compression(), {"a": 1, "b": 2}, deltas=False)
    averages.complete(0)
    local = averages.local_average(0)
    assert local is not None and local.dtype == torch.float16
    _, sent = decoded(averages.for_sender("a", 0), plan)
    assert torch.equal(local.float(), sent)  # what the senders decode, bit for bit
    kept = weakref.ref(local.untyped_storage())
    del local, sent
    averages.release()
    gc.collect()
    assert kept() is None  # nothing of the round's encodings is left to hold their buffers
