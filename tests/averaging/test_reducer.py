"""The aggregator's reducer: exact weighted means, exclusions, rejections, NaN/inf left out."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from kit.averaging.compression import TensorDescriptor
from kit.averaging.partition import PartitionPlan, PartReport, RoundReport, apply_averaged
from kit.averaging.reducer import PartReducer
from kit.errors import ConfigError, InvalidChunk, KitUsageError
from tests.averaging.test_partition import (
    ROUND,
    averaged,
    describe,
    tensors_like,
    weighted_mean,
)


def run_part(
    plan: PartitionPlan,
    part_index: int,
    peers: dict[str, list[torch.Tensor]],
    weights: dict[str, float],
) -> PartReducer:
    reducer = PartReducer(plan, part_index, weights, ROUND)
    for name, tensors in peers.items():
        for spec, view in plan.iter_part(tensors, part_index):
            reducer.accept(name, ROUND, part_index, spec.chunk_index, view.clone())
    return reducer


@pytest.mark.parametrize("n_senders", [2, 3, 5, 8])
def test_exact_weighted_mean(n_senders: int) -> None:
    peers = {f"peer{i}": tensors_like(10 + i) for i in range(n_senders)}
    weights = {name: float(3 * i + 1) for i, name in enumerate(peers)}
    plan = PartitionPlan.build(describe(peers["peer0"]), [20, 70], chunk_elements=9)
    reducer = run_part(plan, 1, peers, weights)
    chunks = plan.parts[1]
    assert all(reducer.is_complete(spec.chunk_index) for spec in chunks)
    result = [t.clone() for t in peers["peer0"]]
    for spec in chunks:
        apply_averaged(plan.chunk_view(result, spec), averaged(reducer, spec.chunk_index))
    for index in (3, 4):  # the tensors part 1 covers entirely
        assert torch.allclose(
            result[index], weighted_mean(peers, weights, index), rtol=1e-6, atol=1e-6
        )
    report = reducer.report()
    assert report.complete and report.peers == frozenset(peers)
    assert RoundReport((report, run_part(plan, 0, peers, weights).report())).is_full


def test_excluding_a_sender_midway_renormalises() -> None:
    peers = {name: tensors_like(seed) for seed, name in enumerate("abc")}
    weights = {"a": 1.0, "b": 2.0, "c": 5.0}
    plan = PartitionPlan.build(describe(peers["a"]), [0, 90], chunk_elements=10)
    reducer = PartReducer(plan, 1, weights, ROUND)
    chunks = plan.parts[1]
    for name in "ab":
        for spec, view in plan.iter_part(peers[name], 1):
            reducer.accept(name, ROUND, 1, spec.chunk_index, view)
    for spec in chunks[:2]:
        done = reducer.accept("c", ROUND, 1, spec.chunk_index, plan.chunk_view(peers["c"], spec))
        assert done == (spec.chunk_index,)
    assert not reducer.is_complete(2)
    assert reducer.exclude("c") == tuple(range(2, len(chunks)))
    with pytest.raises(InvalidChunk) as rejected:
        reducer.accept("c", ROUND, 1, 2, plan.chunk_view(peers["c"], chunks[2]))
    assert rejected.value.reason == "sender"
    for spec in chunks:
        senders = "abc" if spec.chunk_index < 2 else "ab"
        stacked = torch.stack(
            [weights[s] * plan.chunk_view(peers[s], spec).double() for s in senders]
        )
        expected = (stacked.sum(0) / sum(weights[s] for s in senders)).float()
        assert torch.allclose(averaged(reducer, spec.chunk_index), expected, rtol=1e-6, atol=1e-7)
    report = reducer.report()
    assert report.chunk_peers[1] == {"a", "b", "c"} and report.chunk_peers[2] == {"a", "b"}
    assert not report.complete and report.peers == {"a", "b"}
    assert not RoundReport((report,)).is_full


@pytest.mark.parametrize(
    "change, reason",
    [
        (lambda v: v[:-1], "size"),
        (lambda v: v.view(1, -1), "size"),
        (lambda v: v.double(), "dtype"),
        (lambda v: v.numpy(), "dtype"),
    ],
)
def test_bad_chunk_content_is_dropped_and_the_round_goes_on(
    change: Callable[[torch.Tensor], Any], reason: str
) -> None:
    peers = {name: tensors_like(seed) for seed, name in enumerate("ab")}
    plan = PartitionPlan.build(describe(peers["a"]), [90], chunk_elements=30)
    reducer = PartReducer(plan, 0, {"a": 1.0, "b": 1.0}, ROUND)
    first = plan.parts[0][0]
    reducer.accept("a", ROUND, 0, 0, plan.chunk_view(peers["a"], first))
    with pytest.raises(InvalidChunk) as rejected:
        reducer.accept("b", ROUND, 0, 0, change(plan.chunk_view(peers["b"], first)))
    assert rejected.value.reason == reason and rejected.value.completed == (0,)
    assert torch.equal(averaged(reducer, 0), plan.chunk_view(peers["a"], first))
    second = plan.parts[0][1]  # the next chunk from "b" is still welcome
    for name in "ab":
        reducer.accept(name, ROUND, 0, 1, plan.chunk_view(peers[name], second))
    assert reducer.report().chunk_peers[:2] == (frozenset("a"), frozenset("ab"))


def poisoned(values: torch.Tensor, bad: float) -> torch.Tensor:
    values = values.clone()
    values[len(values) // 2] = bad
    return values


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("position", [0, 1, 3])  # first (kept unwritten), second, last to arrive
@pytest.mark.parametrize("max_kept_bytes", [None, 0, 200])  # found late, on arrival, both
def test_non_finite_values_are_left_out_of_their_chunk_only(
    bad: float, position: int, max_kept_bytes: int | None
) -> None:
    """A sender's NaN/inf chunk is averaged without it, whenever it is found (the chunk's
    average is checked once; past the memory budget each contribution on arrival), and the
    sender's other chunks still count."""
    names = "abcd"
    peers = {name: tensors_like(seed) for seed, name in enumerate(names)}
    weights = {"a": 1.0, "b": 2.0, "c": 0.5, "d": 3.0}
    plan = PartitionPlan.build(describe(peers["a"]), [90], chunk_elements=15)
    left_out: list[tuple[str, int]] = []
    reducer = PartReducer(
        plan,
        0,
        weights,
        ROUND,
        on_non_finite=lambda *e: left_out.append(e),
        local_sender="a",
        max_kept_bytes=max_kept_bytes,
    )
    culprit = names[position]
    chunks = plan.parts[0]
    for spec in chunks:
        for name in names:
            values = plan.chunk_view(peers[name], spec).clone()
            if name == culprit and spec.chunk_index == 2:
                values = poisoned(values, bad)
            done = reducer.accept(name, ROUND, 0, spec.chunk_index, values)
            assert done == ((spec.chunk_index,) if name == names[-1] else ())
    assert left_out == [(culprit, 2)]
    report = reducer.report()
    others = frozenset(names) - {culprit}
    assert report.chunk_peers == tuple(
        others if spec.chunk_index == 2 else frozenset(names) for spec in chunks
    )
    for spec in chunks:
        senders = others if spec.chunk_index == 2 else names
        stacked = torch.stack(
            [weights[s] * plan.chunk_view(peers[s], spec).double() for s in senders]
        )
        expected = (stacked.sum(0) / sum(weights[s] for s in senders)).float()
        result = averaged(reducer, spec.chunk_index)
        assert torch.isfinite(result).all()
        assert torch.allclose(result, expected, rtol=1e-6, atol=1e-7)


def test_a_chunk_whose_every_contribution_is_non_finite_is_averaged_over_nobody() -> None:
    peers = {name: tensors_like(seed) for seed, name in enumerate("ab")}
    plan = PartitionPlan.build(describe(peers["a"]), [90], chunk_elements=45)
    left_out: list[tuple[str, int]] = []
    reducer = PartReducer(
        plan, 0, {"a": 1.0, "b": 1.0}, ROUND, on_non_finite=lambda *e: left_out.append(e)
    )
    first = plan.parts[0][0]
    for name, bad in (("a", float("nan")), ("b", float("inf"))):
        reducer.accept(name, ROUND, 0, 0, poisoned(plan.chunk_view(peers[name], first), bad))
    assert sorted(left_out) == [("a", 0), ("b", 0)]
    assert reducer.averaged(0) is None and reducer.report().chunk_peers[0] == frozenset()


def test_a_weighted_sum_that_overflows_goes_to_nobody(caplog: pytest.LogCaptureFixture) -> None:
    """Finite contributions whose sum is not finite: nobody gets the chunk (the aggregator too),
    and nobody is blamed for it."""
    plan = PartitionPlan.build(
        [TensorDescriptor.from_tensor(torch.zeros(4))], [4], chunk_elements=2
    )
    left_out: list[tuple[str, int]] = []
    reducer = PartReducer(
        plan, 0, {"a": 1.0, "b": 1.0}, ROUND, on_non_finite=lambda *e: left_out.append(e)
    )
    huge = torch.full((2,), 3e38)
    with caplog.at_level("WARNING", logger="kit.averaging.reducer"):
        for name in "ab":
            reducer.accept(name, ROUND, 0, 0, huge)
            reducer.accept(name, ROUND, 0, 1, torch.ones(2))
    assert "overflowed" in caplog.text and left_out == []
    assert reducer.averaged(0) is None and torch.equal(averaged(reducer, 1), torch.ones(2))
    assert reducer.report().chunk_peers == (frozenset(), frozenset("ab"))


def test_kept_contributions_stay_within_the_memory_budget() -> None:
    """Unchecked contributions are kept (not copied) until their chunk completes, at most
    max_kept_bytes of them (the local sender's views cost nothing); past that, contributions
    are checked on arrival and let go, and the averages are the same."""
    import gc
    import weakref

    names = "abc"
    peers = {name: tensors_like(seed) for seed, name in enumerate(names)}
    weights = {"a": 2.0, "b": 1.0, "c": 1.0}
    plan = PartitionPlan.build(describe(peers["a"]), [90], chunk_elements=10)  # 40-byte chunks
    reducer = PartReducer(plan, 0, weights, ROUND, local_sender="a", max_kept_bytes=120)
    alive: list[weakref.ref[torch.Tensor]] = []
    most_alive = 0
    for name in "ab":  # "c" lags: every chunk waits for it
        for spec, view in plan.iter_part(peers[name], 0):
            values = view if name == "a" else view.clone()  # the local sender's are views
            if name != "a":
                alive.append(weakref.ref(values))
            reducer.accept(name, ROUND, 0, spec.chunk_index, values)
            del values
            gc.collect()
            most_alive = max(most_alive, sum(ref() is not None for ref in alive))
    assert most_alive == 3  # 120 bytes of b's 40-byte chunks; a's views are not counted
    for spec, view in plan.iter_part(peers["c"], 0):
        reducer.accept("c", ROUND, 0, spec.chunk_index, view.clone())
    gc.collect()
    assert all(ref() is None for ref in alive)  # every chunk complete: nothing kept
    expected = run_part(plan, 0, peers, weights)
    for spec in plan.parts[0]:
        result, reference = (
            averaged(reducer, spec.chunk_index),
            averaged(expected, spec.chunk_index),
        )
        assert torch.allclose(result, reference, rtol=1e-6, atol=1e-7)
    assert reducer.report().complete


@pytest.mark.parametrize(
    "sender, round_id, part, chunk, reason",
    [
        ("b", b"group-0", 0, 0, "round"),
        ("b", ROUND, 1, 0, "part"),
        ("b", ROUND, 0, 1, "order"),  # a gap
        ("mallory", ROUND, 0, 0, "sender"),
    ],
)
def test_misaddressed_chunks_change_nothing(
    sender: str, round_id: bytes, part: int, chunk: int, reason: str
) -> None:
    tensors = tensors_like(0)
    plan = PartitionPlan.build(describe(tensors), [90, 0], chunk_elements=30)
    reducer = PartReducer(plan, 0, {"a": 1.0, "b": 3.0}, ROUND)
    with pytest.raises(InvalidChunk) as rejected:
        reducer.accept(
            sender, round_id, part, chunk, plan.chunk_view(tensors, plan.parts[0][chunk])
        )
    assert rejected.value.reason == reason and rejected.value.completed == ()
    reducer.accept("b", ROUND, 0, 0, plan.chunk_view(tensors, plan.parts[0][0]))  # still expected
    with pytest.raises(InvalidChunk, match="order"):  # a duplicate
        reducer.accept("b", ROUND, 0, 0, plan.chunk_view(tensors, plan.parts[0][0]))
    for spec in plan.parts[0][1:]:
        reducer.accept("b", ROUND, 0, spec.chunk_index, plan.chunk_view(tensors, spec))
    with pytest.raises(InvalidChunk, match="order"):  # one past the last chunk
        reducer.accept("b", ROUND, 0, len(plan.parts[0]), plan.chunk_view(tensors, spec))


def test_deadline_and_a_chunk_nobody_sent() -> None:
    tensors = tensors_like(0)
    plan = PartitionPlan.build(describe(tensors), [90], chunk_elements=45)
    reducer = PartReducer(plan, 0, {"a": 1.0, "b": 1.0}, ROUND)
    reducer.accept("a", ROUND, 0, 0, plan.chunk_view(tensors, plan.parts[0][0]))
    with pytest.raises(KitUsageError, match="help:"):
        reducer.averaged(0)
    report = reducer.finish()
    assert report.chunk_peers == (frozenset("a"),) + (frozenset(),) * 3  # chunks end at tensors
    assert not report.complete and reducer.averaged(1) is None and reducer.averaged(0) is not None
    missing = PartReport.missing(1, frozenset("ab"), 3)
    assert missing.peers == frozenset() and not missing.complete


def test_bad_weights_are_refused() -> None:
    plan = PartitionPlan.build(describe(tensors_like(0)), [90], chunk_elements=45)
    for weight in (0.0, -1.0, float("nan"), float("inf"), True):
        with pytest.raises(ConfigError, match="help:"):
            PartReducer(plan, 0, {"a": 1.0, "b": weight}, ROUND)  # type: ignore[dict-item]


def test_float16_tensors_accumulate_in_float32() -> None:
    peers = {name: tensors_like(seed, torch.float16) for seed, name in enumerate("abc")}
    weights = {"a": 1000.0, "b": 1.0, "c": 1.0}
    plan = PartitionPlan.build(describe(peers["a"]), [90], chunk_elements=64)
    reducer = run_part(plan, 0, peers, weights)
    result = averaged(reducer, 0)
    expected = weighted_mean(peers, weights, 0).reshape(-1)
    assert result.dtype == torch.float32
    assert torch.allclose(result[:35], expected, rtol=1e-5, atol=1e-6)


def test_float16_values_of_a_float32_tensor_are_summed_as_they_arrived() -> None:
    """The FLOAT16 codec's chunks are added without a float32 copy first: the same sums as of
    the widened values, and a NaN among them is still left out."""
    peers = {name: tensors_like(seed) for seed, name in enumerate("abc")}
    weights = {"a": 3.0, "b": 1.0, "c": 2.0}
    plan = PartitionPlan.build(describe(peers["a"]), [90], chunk_elements=30)
    widened = {name: [t.half().float() for t in tensors] for name, tensors in peers.items()}
    reducer = PartReducer(plan, 0, weights, ROUND)
    for name in "abc":
        for spec, view in plan.iter_part(peers[name], 0):
            reducer.accept(name, ROUND, 0, spec.chunk_index, view.half())
    expected = run_part(plan, 0, widened, weights)
    for chunk in range(len(plan.parts[0])):  # float32 sums (float16 ones are ~1e-3 off)
        assert torch.allclose(
            averaged(reducer, chunk), averaged(expected, chunk), rtol=1e-6, atol=1e-7
        )
    nan = plan.chunk_view(peers["b"], plan.parts[0][0]).half()
    nan[2] = float("nan")
    left_out: list[tuple[str, int]] = []
    reducer = PartReducer(plan, 0, weights, ROUND, on_non_finite=lambda *e: left_out.append(e))
    reducer.accept("b", ROUND, 0, 0, nan)
    for name in "ac":
        reducer.accept(name, ROUND, 0, 0, plan.chunk_view(widened[name], plan.parts[0][0]).half())
    assert left_out == [("b", 0)] and reducer.report().chunk_peers[0] == {"a", "c"}
    integers = PartitionPlan.build(
        [TensorDescriptor.from_tensor(torch.zeros(10, dtype=torch.int32))], [10], chunk_elements=10
    )
    with pytest.raises(InvalidChunk) as refused:  # float16 stands in for float tensors only
        PartReducer(integers, 0, {"a": 1.0}, ROUND).accept("a", ROUND, 0, 0, torch.zeros(10).half())
    assert refused.value.reason == "dtype"
