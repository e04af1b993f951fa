"""GradientAccumulator: samples-weighted sums, the mean over the epoch, AMP scales, reset."""

from __future__ import annotations

import torch

from kit.optim.accumulation import GradientAccumulator, all_finite


def backward(model: torch.nn.Module, size: int, scale: float = 1.0) -> list[torch.Tensor]:
    inputs = torch.randn(size, 4)
    loss = torch.nn.functional.mse_loss(model(inputs), inputs[:, :2])
    (loss * scale).backward()
    return [p.grad.detach().clone() / scale for p in model.parameters()]  # type: ignore[union-attr]


class Scaler:
    def __init__(self, scale: float) -> None:
        self.scale = scale

    def get_scale(self) -> float:
        return self.scale

    def update(self, scale: float) -> None:
        self.scale = scale


def test_mean_gradient_weighs_micro_batches_by_their_samples() -> None:
    model = torch.nn.Linear(4, 2)
    accumulated = GradientAccumulator(
        list(model.parameters()), reuse_grad_buffers=False, buffered=True
    )
    first = backward(model, 2)
    assert accumulated.add(2)
    model.zero_grad()
    second = backward(model, 6, scale=8.0)
    assert accumulated.add(6, Scaler(8.0))
    out = [torch.empty_like(p) for p in model.parameters()]
    accumulated.mean_gradient(out)
    for mean, a, b in zip(out, first, second, strict=True):
        torch.testing.assert_close(mean, (2 * a + 6 * b) / 8)
    assert accumulated.samples == 8
    accumulated.reset()
    assert accumulated.samples == 0
    accumulated.mean_gradient(out)
    assert all(not bool(t.any()) for t in out)


def test_reuse_grad_buffers_averages_what_grad_holds_and_drops_it_on_a_bad_gradient() -> None:
    model = torch.nn.Linear(4, 2)
    accumulated = GradientAccumulator(
        list(model.parameters()), reuse_grad_buffers=True, buffered=True
    )
    backward(model, 4, scale=2.0)
    total = backward(model, 4, scale=2.0)  # .grad keeps adding up: both batches, scaled
    scaler = Scaler(2.0)
    assert accumulated.add(4, scaler) and accumulated.add(4, scaler)
    out = [torch.empty_like(p) for p in model.parameters()]
    accumulated.mean_gradient(out)
    for mean, both in zip(out, total, strict=True):
        torch.testing.assert_close(mean, both / 2)
    model.weight.grad[0, 0] = float("nan")  # type: ignore[index]
    assert not accumulated.add(4, scaler)
    assert scaler.scale == 1.0 and accumulated.samples == 0
    assert all(not bool(p.grad.any()) for p in model.parameters())  # type: ignore[union-attr]


def test_all_finite_finds_any_inf_or_nan_and_accepts_sums_that_overflow() -> None:
    grads = [torch.randn(300, 7), None, torch.randn(5), torch.empty(0)]
    assert all_finite(grads) and all_finite([]) and all_finite([None])
    for bad in (float("nan"), float("inf"), -float("inf")):
        spoiled = [g.clone() if g is not None else None for g in grads]
        spoiled[2][3] = bad  # type: ignore[index]
        assert not all_finite(spoiled)
    mixed = torch.zeros(4)
    mixed[0], mixed[1] = float("inf"), -float("inf")  # they sum to NaN, not to a number
    assert not all_finite([mixed])
    # Finite elements whose sum overflows (float32, and float16 past 65504): still finite.
    assert all_finite([torch.full((8,), 3e38), torch.full((100,), 60000.0, dtype=torch.float16)])
    assert all_finite([torch.full((4,), 1.7e308, dtype=torch.float64)])
    assert not all_finite([torch.full((4,), 3e38), torch.tensor([float("nan")])])


def test_a_non_finite_micro_batch_is_skipped_and_the_others_are_kept() -> None:
    model = torch.nn.Linear(4, 2)
    accumulated = GradientAccumulator(
        list(model.parameters()), reuse_grad_buffers=False, buffered=True
    )
    good = backward(model, 3)
    assert accumulated.add(3)
    model.zero_grad()
    backward(model, 5)
    model.bias.grad[1] = float("inf")  # type: ignore[index]
    assert not accumulated.add(5)
    out = [torch.empty_like(p) for p in model.parameters()]
    accumulated.mean_gradient(out)
    assert accumulated.samples == 3
    for mean, expected in zip(out, good, strict=True):
        torch.testing.assert_close(mean, expected)
