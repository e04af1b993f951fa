"""CenteredClip and the clipped part reducer, pure: the math against a plain loop, its edge cases,
and its breakdown: one outlier of eight moves the mean by far more than the honest spread, and
CenteredClip by a fraction of it.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch

from kit.averaging.compression import TensorDescriptor
from kit.averaging.partition import PartitionPlan
from kit.averaging.reducer import PartReducer
from kit.averaging.robust import (
    Aggregation,
    ClippedPartReducer,
    centered_clip,
    choose_tau,
    weighted_coordinate_median,
)
from kit.errors import ConfigError, KitUsageError, NothingToAggregate


def reference_centered_clip(
    x: np.ndarray, w: np.ndarray, tau: float, iterations: int, v: np.ndarray
) -> np.ndarray:
    """Karimireddy et al. 2021, Alg. 2, written out in float64, one peer at a time."""
    v = v.astype(np.float64).copy()
    for _ in range(iterations):
        step = np.zeros_like(v)
        for xi, wi in zip(x.astype(np.float64), w, strict=True):
            d = xi - v
            norm = math.sqrt(float(d @ d))
            step += wi * d * (min(1.0, tau / norm) if norm > 0 else 1.0)
        v = v + step / w.sum()
    return v


def honest_and_outlier(seed: int, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Seven honest vectors around a common direction, and an eighth one scaled or random."""
    g = torch.Generator().manual_seed(seed)
    true = torch.randn(500, generator=g, dtype=torch.float64)
    honest = true + 0.3 * torch.randn(7, 500, generator=g, dtype=torch.float64)
    if kind == "scaled":
        bad = -1000.0 * honest[0]
    else:
        bad = 1000.0 * torch.randn(500, generator=g, dtype=torch.float64)
    return honest, torch.cat([honest, bad[None]])


@pytest.mark.parametrize("tau", [0.05, 0.7, 3.0])
def test_matches_the_reference_loop(tau: float) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 40, generator=g, dtype=torch.float64)
    w = torch.tensor([1.0, 2.0, 0.5, 3.0, 1.0, 4.0], dtype=torch.float64)
    start = torch.randn(40, generator=g, dtype=torch.float64)
    got = centered_clip(x, w, tau=tau, iterations=7, center=start, tolerance=0.0)
    want = reference_centered_clip(x.numpy(), w.numpy(), tau, 7, start.numpy())
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-10, atol=1e-12)


def test_converged_result_is_the_clipped_fixed_point() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 30, generator=g, dtype=torch.float64) * torch.arange(1, 9)[:, None]
    w = torch.rand(8, generator=g, dtype=torch.float64) + 0.1
    tau = 2.0
    v = centered_clip(x, w, tau=tau, iterations=500, tolerance=1e-12)
    # At the fixed point the clipped pulls cancel: sum_i w_i clip_tau(x_i - v) = 0.
    pulls = torch.stack(
        [
            wi * (xi - v) * min(1.0, tau / float((xi - v).norm()))
            for xi, wi in zip(x, w, strict=True)
        ]
    )
    assert float(pulls.sum(0).norm()) < 1e-8 * float(w.sum())
    assert float((v - (w[:, None] * x).sum(0) / w.sum()).norm()) > 0.1  # clipping mattered


def test_infinite_tau_gives_the_weighted_mean_in_one_step() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 17, generator=g)
    w = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    got = centered_clip(x, w, tau=math.inf, iterations=1)
    torch.testing.assert_close(got, (w[:, None] * x).sum(0) / w.sum())


def test_translation_and_permutation_equivariant() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 25, generator=g, dtype=torch.float64)
    w = torch.rand(7, generator=g, dtype=torch.float64) + 0.5
    shift = 10 * torch.randn(25, generator=g, dtype=torch.float64)
    base = centered_clip(x, w, tau=0.8, iterations=50)
    torch.testing.assert_close(centered_clip(x + shift, w, tau=0.8, iterations=50), base + shift)
    order = torch.randperm(7, generator=g)
    torch.testing.assert_close(centered_clip(x[order], w[order], tau=0.8, iterations=50), base)


def test_edge_cases_one_vector_identical_vectors_zero_weights() -> None:
    x = torch.randn(1, 9)
    assert torch.equal(centered_clip(x, torch.ones(1), tau=1.0), x[0])
    same = torch.full((4, 9), 2.5)
    assert torch.equal(centered_clip(same, torch.ones(4), tau=1e-3), same[0])
    g = torch.Generator().manual_seed(4)
    y = torch.randn(4, 9, generator=g, dtype=torch.float64)
    y[2] = 1e6  # weight 0: as if it were not there
    with_zero = centered_clip(y, torch.tensor([1.0, 2.0, 0.0, 1.0]), tau=0.5, iterations=30)
    without = centered_clip(y[[0, 1, 3]], torch.tensor([1.0, 2.0, 1.0]), tau=0.5, iterations=30)
    torch.testing.assert_close(with_zero, without)


def test_non_finite_rows_are_dropped_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(5, 12, generator=g)
    dirty = x.clone()
    dirty[1, 3] = float("nan")
    dirty[4, 0] = float("inf")
    with caplog.at_level(logging.WARNING, logger="kit.averaging.robust"):
        got = centered_clip(dirty, torch.ones(5), tau=0.5, iterations=20)
    assert "dropping 2 of 5" in caplog.text
    torch.testing.assert_close(got, centered_clip(x[[0, 2, 3]], torch.ones(3), tau=0.5))
    with pytest.raises(NothingToAggregate):
        centered_clip(torch.full((2, 3), float("nan")), torch.ones(2), tau=1.0)
    with pytest.raises(NothingToAggregate):
        centered_clip(x, torch.zeros(5), tau=1.0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"tau": 0.0},
        {"tau": -1.0},
        {"tau": float("nan")},
        {"tau": 1.0, "iterations": 0},
        {"tau": 1.0, "weights": torch.tensor([1.0, -1.0, 1.0])},
        {"tau": 1.0, "weights": torch.ones(2)},
        {"tau": 1.0, "center": torch.zeros(3)},
        {"tau": 1.0, "center": torch.full((4,), float("inf"))},
    ],
)
def test_bad_arguments_raise_config_error(kwargs: dict) -> None:
    weights = kwargs.pop("weights", torch.ones(3))
    with pytest.raises(ConfigError, match="help:"):
        centered_clip(torch.randn(3, 4), weights, **kwargs)


def test_weighted_coordinate_median() -> None:
    x = torch.tensor([[0.0, 5.0], [1.0, -5.0], [10.0, 0.0]])
    assert weighted_coordinate_median(x, torch.ones(3)).tolist() == [1.0, 0.0]
    assert weighted_coordinate_median(x, torch.tensor([1.0, 1.0, 3.0])).tolist() == [10.0, 0.0]
    # An exact tie of weights: the midpoint of the lower and the upper median.
    assert weighted_coordinate_median(x[:2], torch.ones(2)).tolist() == [0.5, 0.0]
    g = torch.Generator().manual_seed(6)
    y = torch.randn(9, 70_000, generator=g)  # more columns than one sort block
    np.testing.assert_allclose(
        weighted_coordinate_median(y, torch.ones(9)).numpy(), np.median(y.numpy(), axis=0)
    )


@pytest.mark.parametrize("kind", ["scaled", "random"])
def test_one_outlier_of_eight_breaks_the_mean_but_not_centered_clip(kind: str) -> None:
    honest, everyone = honest_and_outlier(7, kind)
    target = honest.mean(0)
    spread = float((honest - target).norm(dim=1).mean())  # ~0.3 * sqrt(500) ~ 6.7
    weights = torch.ones(8, dtype=torch.float64)
    mean_error = float(((everyone * weights[:, None]).sum(0) / 8 - target).norm())
    tau = choose_tau(everyone, weights)
    clipped_error = float((centered_clip(everyone, weights, tau=tau) - target).norm())
    assert mean_error > 20 * spread  # the outlier drags the mean by ~1/8 of its norm
    assert clipped_error < 0.3 * spread  # bias <= ~tau/8, tau ~ the honest spread
    assert 0.5 * spread < tau < 2 * spread  # the median distance is an honest one


def test_choose_tau_is_the_median_distance() -> None:
    x = torch.tensor([[0.0], [1.0], [3.0], [-2.0], [100.0]])
    # Centre: median 1.0; distances 1, 0, 2, 3, 99 -> median 2.
    assert choose_tau(x, torch.ones(5)) == 2.0
    assert choose_tau(torch.ones(3, 4), torch.ones(3)) > 0  # identical rows: tiny, not zero


# --- the clipped part reducer ------------------------------------------------------------------


def plan_of(size: int, chunk: int, parts: int = 2) -> PartitionPlan:
    descriptor = TensorDescriptor.from_tensor(torch.zeros(size))
    sizes = [size // parts] * (parts - 1) + [size - (parts - 1) * (size // parts)]
    return PartitionPlan.build([descriptor], sizes, chunk)


def test_clipped_reducer_holds_chunks_back_and_clips_the_whole_part() -> None:
    plan = plan_of(400, 50)  # part 0: 200 elements, 4 chunks
    g = torch.Generator().manual_seed(8)
    values = {p: torch.randn(200, generator=g) for p in "abcd"}
    values["d"] = values["d"] * 1000
    weights = {"a": 1.0, "b": 2.0, "c": 1.0, "d": 1.0}
    reducer = ClippedPartReducer(plan, 0, weights, "r", Aggregation("centered_clip", tau=None))
    plain = PartReducer(plan, 0, weights, "r")
    completed: list[int] = []
    for peer in "abcd":
        for spec in plan.parts[0]:
            chunk = values[peer][spec.part_offset : spec.part_offset + spec.size]
            completed += reducer.accept(peer, "r", 0, spec.chunk_index, chunk)
            plain.accept(peer, "r", 0, spec.chunk_index, chunk)
    assert completed == [0, 1, 2, 3]  # all at once, when the last chunk was in
    got = torch.cat([reducer.averaged(c) for c in range(4)])  # type: ignore[misc]
    stacked = torch.stack([values[p] for p in "abcd"])
    w = torch.tensor([1.0, 2.0, 1.0, 1.0])
    want = centered_clip(stacked, w, tau=choose_tau(stacked, w), iterations=20)
    torch.testing.assert_close(got, want)
    mean = torch.cat([plain.averaged(c) for c in range(4)])  # type: ignore[misc]
    honest = (stacked[:3] * w[:3, None]).sum(0) / 4
    assert float((got - honest).norm()) < 0.1 * float((mean - honest).norm())


def test_clipped_reducer_reduces_each_span_of_the_same_senders_alone() -> None:
    plan = plan_of(400, 50)
    g = torch.Generator().manual_seed(9)
    values = {p: torch.randn(200, generator=g) for p in "abc"}
    reducer = ClippedPartReducer(
        plan, 0, dict.fromkeys("abc", 1.0), "r", Aggregation("centered_clip", 0.5)
    )
    for peer in "ab":
        for spec in plan.parts[0]:
            part = values[peer][spec.part_offset : spec.part_offset + spec.size]
            reducer.accept(peer, "r", 0, spec.chunk_index, part)
    for spec in plan.parts[0][:2]:  # c delivers two chunks, then stops
        part = values["c"][spec.part_offset : spec.part_offset + spec.size]
        assert reducer.accept("c", "r", 0, spec.chunk_index, part) == ()
    with pytest.raises(KitUsageError):
        reducer.compute()  # chunks 2-3 still wait for c
    assert reducer.exclude("c") == (0, 1, 2, 3)
    got = torch.cat([reducer.averaged(c) for c in range(4)])  # type: ignore[misc]
    stacked = torch.stack([values[p] for p in "abc"])
    first = centered_clip(stacked[:, :100], torch.ones(3), tau=0.5, iterations=20)
    second = centered_clip(stacked[:2, 100:], torch.ones(2), tau=0.5, iterations=20)
    torch.testing.assert_close(got, torch.cat([first, second]))
    assert reducer.taus == [0.5, 0.5]
    assert [set(p) for p in reducer.report().chunk_peers] == [set("abc")] * 2 + [set("ab")] * 2


def test_aggregation_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="help:"):
        Aggregation("median")
    with pytest.raises(ConfigError, match="help:"):
        Aggregation("centered_clip", tau=0.0)
    with pytest.raises(ConfigError, match="help:"):
        Aggregation("centered_clip", iterations=0)
