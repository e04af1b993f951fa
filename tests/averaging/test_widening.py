"""add_widened and subtract_narrowed: float16 in float32 arithmetic, slice by slice, the same bits
as widening first (and rounding once, at the end)."""

from __future__ import annotations

import pytest
import torch

from kit.averaging.widening import SLICE, SLICE_NARROWED, add_widened, subtract_narrowed


@pytest.mark.parametrize("n", [0, 5, SLICE, 2 * SLICE + 3])
@pytest.mark.parametrize(
    "a_dtype, b_dtype",
    [
        (torch.float32, torch.float16),
        (torch.float16, torch.float32),
        (torch.float16, torch.float16),
        (torch.float32, torch.bfloat16),
        (torch.float32, torch.float32),
    ],
)
def test_the_same_bits_as_widening_first(
    n: int, a_dtype: torch.dtype, b_dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(n)
    a = torch.randn(n, generator=g).to(a_dtype)
    b = (torch.randn(n, generator=g) * 100).to(b_dtype)
    out = torch.full((n,), float("nan"))
    add_widened(out, a, b, alpha=-0.37)
    assert torch.equal(out, torch.add(a.float(), b.float(), alpha=-0.37))


def test_in_place_and_float64() -> None:
    total = torch.randn(SLICE + 7)
    half = torch.randn(SLICE + 7).half()
    expected = total + 2.5 * half.float()
    add_widened(total, total, half, alpha=2.5)  # out is a: the aggregator's running sum
    assert torch.equal(total, expected)
    wide = torch.randn(11, dtype=torch.float64)
    out = torch.empty(11, dtype=torch.float64)
    add_widened(out, wide, half[:11])
    assert torch.equal(out, wide + half[:11].double())


def test_other_mixes_are_one_torch_add() -> None:
    out = torch.empty(4)
    add_widened(out, torch.ones(4), torch.arange(4, dtype=torch.int32), alpha=0.5)
    assert out.tolist() == [1.0, 1.5, 2.0, 2.5]
    add_widened(out, torch.ones(4, dtype=torch.float64), torch.ones(4).half())
    assert out.tolist() == [2.0] * 4


@pytest.mark.parametrize("n", [0, 3, SLICE_NARROWED, 2 * SLICE_NARROWED + 5])
@pytest.mark.parametrize("b_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_a_difference_rounded_once_as_computed_in_float32(n: int, b_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(n + 1)
    a = torch.randn(n, generator=g) * 30
    b = (a + torch.randn(n, generator=g) * 1e-2).to(b_dtype)  # close: a sender's values
    out = torch.full((n,), float("nan"), dtype=torch.float16)
    subtract_narrowed(out, a, b)
    assert torch.equal(out, (a - b.float()).half())
    if n:  # far apart too, out of float16's range: inf, as the cast gives it
        far = torch.full((n,), 1e6)
        subtract_narrowed(out, far, b)
        assert torch.equal(out, (far - b.float()).half()) and torch.isinf(out).all()
