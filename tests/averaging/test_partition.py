"""Partition: chunk plans, reports, apply, and a whole round through plan, codecs and reducers."""

from __future__ import annotations

import pytest
import torch

from kit.averaging import compression as C
from kit.averaging.balancing import load_balance_peers
from kit.averaging.compression import TensorDescriptor
from kit.averaging.partition import (
    PartitionPlan,
    RoundReport,
    apply_averaged,
    chunk_scale,
    max_chunk_elements,
)
from kit.averaging.reducer import PartReducer
from kit.errors import ConfigError, KitUsageError

ROUND = b"group-1"


def tensors_like(seed: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (0,), (3,), (40,), (2, 2, 3)]
    return [torch.randn(*shape, generator=g).to(dtype) for shape in shapes]


def averaged(reducer: PartReducer, chunk_index: int) -> torch.Tensor:
    result = reducer.averaged(chunk_index)
    assert result is not None
    return result


def describe(tensors: list[torch.Tensor]) -> list[TensorDescriptor]:
    return [TensorDescriptor.from_tensor(tensor) for tensor in tensors]


def test_plan_covers_every_element_once_within_tensors() -> None:
    tensors = tensors_like(0)
    total = sum(t.numel() for t in tensors)  # 35 + 0 + 3 + 40 + 12 = 90
    plan = PartitionPlan.build(describe(tensors), [30, 0, 45, 15], chunk_elements=[8, 1, 2, 16, 5])
    covered: list[int] = []
    for part_index, chunks in enumerate(plan.parts):
        position = sum(plan.part_sizes[:part_index])
        assert [spec.chunk_index for spec in chunks] == list(range(len(chunks)))
        for spec in chunks:
            numel = tensors[spec.tensor_index].numel()
            assert spec.tensor_offset + spec.size <= numel  # never crosses a tensor boundary
            assert spec.size <= [8, 1, 2, 16, 5][spec.tensor_index]
            start = sum(t.numel() for t in tensors[: spec.tensor_index]) + spec.tensor_offset
            assert start == position + spec.part_offset
            covered.extend(range(start, start + spec.size))
    assert covered == list(range(total)) and plan.parts[1] == () and plan.total_size == total


def test_codecs_see_each_chunk_as_hivemind_describes_it() -> None:
    """``CompressionInfo`` of a chunk: its tensor's info (key and role from ``tensor_infos``),
    ``part_index`` its place among that tensor's chunks, ``part_size`` the most it may hold."""
    tensors = tensors_like(0)
    limits = [8, 1, 2, 16, 5]
    plan = PartitionPlan.build(describe(tensors), [30, 0, 45, 15], limits)
    for spec in (spec for part in plan.parts for spec in part):
        info = plan.compression_info(spec)
        same_tensor = [
            s for part in plan.parts for s in part if s.tensor_index == spec.tensor_index
        ]
        assert info.key == spec.tensor_index and info.role is C.TensorRole.UNSPECIFIED
        assert info.part_index == same_tensor.index(spec) and info.part_size == limits[info.key]
        assert info.descriptor == TensorDescriptor.from_tensor(tensors[spec.tensor_index])
    roles = [C.TensorRole.PARAMETER, C.TensorRole.OPTIMIZER] * 2 + [C.TensorRole.GRADIENT]
    infos = [
        C.CompressionInfo.from_tensor(t, key=f"t{i}", role=role)
        for i, (t, role) in enumerate(zip(tensors, roles, strict=True))
    ]
    named = PartitionPlan.build(describe(tensors), [30, 0, 45, 15], limits, infos)
    spec = named.parts[2][0]
    info = named.compression_info(spec)
    assert (info.key, info.role) == (f"t{spec.tensor_index}", roles[spec.tensor_index])
    with pytest.raises(ConfigError, match="4 tensor infos for 5 tensors"):
        PartitionPlan.build(describe(tensors), [30, 0, 45, 15], limits, infos[:4])


def test_chunk_views_are_zero_copy() -> None:
    tensors = tensors_like(1)
    plan = PartitionPlan.build(describe(tensors), [50, 40], chunk_elements=16)
    for spec, view in plan.iter_part(tensors, 1):
        view.fill_(spec.part_index + 10.0)
    assert (tensors[3][-40 + 35 :] == 11.0).all() and (tensors[4] == 11.0).all()
    info = plan.compression_info(plan.parts[1][0])
    assert info.descriptor == TensorDescriptor((40,), torch.float32) and info.key == 3


def test_plan_errors() -> None:
    descriptors = describe(tensors_like(0))
    with pytest.raises(ConfigError, match="help:"):
        PartitionPlan.build(descriptors, [50, 39], chunk_elements=16)
    with pytest.raises(ConfigError, match="help:"):
        PartitionPlan.build(descriptors, [91, -1], chunk_elements=16)
    with pytest.raises(ConfigError, match="help:"):
        PartitionPlan.build(descriptors, [90], chunk_elements=0)
    plan = PartitionPlan.build(descriptors, [90], chunk_elements=16)
    with pytest.raises(KitUsageError, match="help:"):
        list(plan.iter_part(tensors_like(0, torch.float16), 0))
    with pytest.raises(KitUsageError, match="help:"):
        plan.chunk_view([t.t() if t.dim() == 2 else t for t in tensors_like(0)], plan.parts[0][0])


def test_chunk_elements_follow_the_wire_size() -> None:
    descriptor = TensorDescriptor((10**6,), torch.float32)
    assert max_chunk_elements(descriptor) == 2**19 // 4
    assert max_chunk_elements(descriptor, C.Uniform8BitQuantization()) == 2**19
    assert max_chunk_elements(descriptor, C.Float16Compression(), part_size_bytes=100) == 50


MIB = 2**20


@pytest.mark.parametrize(
    ("bandwidths", "part_sizes", "expected"),
    [
        ([None, 8e8], [4_500_000] * 2, 1),  # a member not measured yet: hivemind's 512 KiB
        ([8e8, 8e8], [4_500_000] * 4, 8),  # loopback (~800 MB/s): as many as 4 chunks allow
        ([8e8, 8e8], [2_000_000] * 4, 2),  # a smaller vector: still 4 chunks per part
        ([8e8, 8e8], [50_000_000] * 4, 8),  # a large vector: capped at 8 x 512 KiB
        ([8e8, 6.25e6], [50_000_000] * 4, 1),  # one member on 50 Mbit/s: 512 KiB (wan.py)
        ([8e8, 1.25e7], [50_000_000] * 4, 1),  # on 100 Mbit/s: 512 KiB takes ~40 ms already
        ([8e8, 1.25e8], [50_000_000] * 4, 4),  # a 1 Gbit/s member: 2 MiB moves in ~17 ms
        ([8e8, 8e8], [100_000, 0], 1),  # a small part: the pipeline needs several chunks
    ],
)
def test_chunks_scale_with_the_slowest_measured_bandwidth(
    bandwidths: list[float | None], part_sizes: list[int], expected: int
) -> None:
    assert chunk_scale(bandwidths, part_sizes, [MIB // 8], MIB // 2) == expected


def weighted_mean(
    peers: dict[str, list[torch.Tensor]], weights: dict[str, float], index: int
) -> torch.Tensor:
    stacked = torch.stack([peers[name][index].double() * weights[name] for name in peers])
    return (stacked.sum(0) / sum(weights[name] for name in peers)).float()


def test_apply_overwrite_lerp_and_delta() -> None:
    target, averaged = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 6.0])
    apply_averaged(target, averaged)
    assert torch.equal(target, averaged)
    target = torch.tensor([1.0, 2.0])
    apply_averaged(target, averaged, alpha=0.5)
    assert target.tolist() == [2.0, 4.0]
    sent = torch.tensor([1.0, 2.0])
    target = sent + torch.tensor([0.5, 0.5])  # a local step made while the round ran
    apply_averaged(target, averaged, sent=sent)
    assert target.tolist() == [3.5, 6.5]  # the local step is kept on top of the average
    half = torch.tensor([1.0, 2.0], dtype=torch.float16)
    apply_averaged(half, averaged)
    assert half.dtype == torch.float16 and half.tolist() == [3.0, 6.0]


def test_a_whole_round_between_three_peers_through_the_codecs() -> None:
    """balancing -> plan -> compress/extract every chunk -> reduce -> apply: all agree."""
    names = ["a", "b", "c"]
    peers = {name: tensors_like(20 + i) for i, name in enumerate(names)}
    weights = {"a": 2.0, "b": 1.0, "c": 1.0}
    descriptors = describe(peers["a"])
    sizes = load_balance_peers(sum(d.numel() for d in descriptors), [50.0, 100.0, 0.0])
    plan = PartitionPlan.build(descriptors, sizes, chunk_elements=16)
    codec = C.NoCompression()
    reducers = {name: PartReducer(plan, i, weights, ROUND) for i, name in enumerate(names)}
    for sender in names:
        for part, aggregator in enumerate(names):
            for spec, view in plan.iter_part(peers[sender], part):
                wire = codec.compress(view, plan.compression_info(spec))
                received = C.SerializedTensor.from_header(wire.header(), bytes(wire.buffer))
                reducers[aggregator].accept(
                    sender, ROUND, part, spec.chunk_index, C.extract(received)
                )
    originals = {name: [t.clone() for t in tensors] for name, tensors in peers.items()}
    for name in names:
        for part, aggregator in enumerate(names):
            for spec in plan.parts[part]:
                result = averaged(reducers[aggregator], spec.chunk_index)
                apply_averaged(plan.chunk_view(peers[name], spec), result)
    assert sizes[2] == 0 and RoundReport(tuple(r.report() for r in reducers.values())).is_full
    for index in range(len(descriptors)):
        expected = weighted_mean(originals, weights, index)
        for name in names:
            assert torch.allclose(peers[name][index], expected, rtol=1e-6, atol=1e-6)
