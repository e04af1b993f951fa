"""GradientAccumulator: samples-weighted sums, the mean over the epoch, loss scales (a real
``torch.amp.GradScaler`` on the CPU), skipped inf/NaN micro-batches, and deferred checks (the
GPU path, run here on the CPU)."""

from __future__ import annotations

import pytest
import torch

from kit.errors import KitUsageError
from kit.optim.accumulation import GradientAccumulator, all_finite, finite_on_device

MODES = pytest.mark.parametrize("deferred", [False, True], ids=["checked", "deferred"])


def backward(
    model: torch.nn.Module, size: int, scaler: torch.amp.GradScaler | None = None
) -> list[torch.Tensor]:
    """One micro-batch's backward (scaled by ``scaler``); returns its unscaled gradients."""
    inputs = torch.randn(size, 4)
    loss = torch.nn.functional.mse_loss(model(inputs), inputs[:, :2])
    before = [
        p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()
    ]
    (scaler.scale(loss) if scaler is not None else loss).backward()
    scale = scaler.get_scale() if scaler is not None else 1.0
    return [
        (p.grad.detach() - b) / scale  # type: ignore[union-attr]
        for p, b in zip(model.parameters(), before, strict=True)
    ]


def accumulator(
    model: torch.nn.Module, *, deferred: bool, reuse: bool = False
) -> GradientAccumulator:
    return GradientAccumulator(
        list(model.parameters()), reuse_grad_buffers=reuse, buffered=True, deferred=deferred
    )


def mean_of(accumulated: GradientAccumulator, model: torch.nn.Module) -> list[torch.Tensor]:
    out = [torch.empty_like(p) for p in model.parameters()]
    accumulated.mean_gradient(out)
    return out


@MODES
def test_mean_gradient_weighs_micro_batches_by_their_samples(deferred: bool) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    accumulated = accumulator(model, deferred=deferred)
    first = backward(model, 2)
    assert accumulated.add(2)
    model.zero_grad()
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    second = backward(model, 6, scaler)
    assert accumulated.add(6, scaler)
    scaler.update()  # the accumulator recorded its check: no "No inf checks were recorded"
    for mean, a, b in zip(mean_of(accumulated, model), first, second, strict=True):
        torch.testing.assert_close(mean, (2 * a + 6 * b) / 8)
    assert accumulated.samples == 8
    accumulated.reset()
    assert accumulated.samples == 0
    assert all(not bool(t.any()) for t in mean_of(accumulated, model))


@MODES
def test_a_non_finite_micro_batch_is_skipped_the_others_kept_and_the_scale_backs_off(
    deferred: bool,
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    accumulated = accumulator(model, deferred=deferred)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    good = backward(model, 3, scaler)
    assert accumulated.add(3, scaler)
    scaler.update()
    model.zero_grad()
    backward(model, 5, scaler)
    model.bias.grad[1] = float("inf")  # type: ignore[index]
    # A deferred check answers later: the samples count at once, and leave at the next read.
    assert accumulated.add(5, scaler) is deferred
    scaler.update()
    assert scaler.get_scale() == 2.0**9
    model.zero_grad()
    assert accumulated.samples == (8 if deferred else 3)
    accumulated.settle()
    assert accumulated.samples == 3
    for mean, expected in zip(mean_of(accumulated, model), good, strict=True):
        torch.testing.assert_close(mean, expected)


def test_a_deferred_check_is_read_one_micro_batch_late() -> None:
    model = torch.nn.Linear(4, 2)
    accumulated = accumulator(model, deferred=True)
    backward(model, 4)
    model.weight.grad[0, 0] = float("nan")  # type: ignore[index]
    accumulated.add(4)
    assert accumulated.samples == 4  # not read yet
    model.zero_grad()
    backward(model, 4)
    accumulated.add(4)  # reads the previous micro-batch's check
    assert accumulated.samples == 4
    assert all(torch.isfinite(t).all() for t in mean_of(accumulated, model))


@MODES
def test_reuse_grad_buffers_averages_what_grad_holds_and_drops_it_on_a_bad_gradient(
    deferred: bool,
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    accumulated = accumulator(model, deferred=deferred, reuse=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0)
    first = backward(model, 4, scaler)
    assert accumulated.add(4, scaler)
    scaler.update()
    second = backward(model, 4, scaler)  # .grad keeps adding up: both batches, scaled
    assert accumulated.add(4, scaler)
    scaler.update()
    for mean, a, b in zip(mean_of(accumulated, model), first, second, strict=True):
        torch.testing.assert_close(mean, (a + b) / 2)
    backward(model, 4, scaler)
    model.weight.grad[0, 0] = float("nan")  # type: ignore[index]
    accumulated.add(4, scaler)
    scaler.update()
    assert scaler.get_scale() == 1.0
    after = backward(model, 4, scaler)  # into the cleared .grad, at the backed-off scale
    accumulated.add(4, scaler)
    accumulated.settle()
    assert accumulated.samples == 4 and accumulated.steps == 1
    for mean, expected in zip(mean_of(accumulated, model), after, strict=True):
        torch.testing.assert_close(mean, expected)


def test_local_updates_get_unscaled_gradients_in_place() -> None:
    model = torch.nn.Linear(4, 2)
    accumulated = GradientAccumulator(
        list(model.parameters()), reuse_grad_buffers=False, buffered=False, deferred=True
    )
    scaler = torch.amp.GradScaler("cpu", init_scale=64.0)
    expected = backward(model, 4, scaler)
    assert accumulated.add(4, scaler, decide=True)  # decide: checked now, even when deferred
    for param, grad in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(param.grad, grad)


def test_all_finite_finds_any_inf_or_nan_and_accepts_sums_that_overflow() -> None:
    grads = [torch.randn(300, 7), None, torch.randn(5), torch.empty(0)]
    assert all_finite(grads) and all_finite([]) and all_finite([None])
    for bad in (float("nan"), float("inf"), -float("inf")):
        spoiled = [g.clone() if g is not None else None for g in grads]
        spoiled[2][3] = bad  # type: ignore[index]
        assert not all_finite(spoiled)
        assert not bool(finite_on_device([g for g in spoiled if g is not None]))
    assert bool(finite_on_device([g for g in grads if g is not None]))
    mixed = torch.zeros(4)
    mixed[0], mixed[1] = float("inf"), -float("inf")  # they sum to NaN, not to a number
    assert not all_finite([mixed]) and not bool(finite_on_device([mixed]))
    # Finite elements whose sum overflows (float32, and float16 past 65504): still finite.
    assert all_finite([torch.full((8,), 3e38), torch.full((100,), 60000.0, dtype=torch.float16)])
    assert all_finite([torch.full((4,), 1.7e308, dtype=torch.float64)])
    assert not all_finite([torch.full((4,), 3e38), torch.tensor([float("nan")])])


@MODES
def test_clipping_fused_into_the_accumulation_is_torch_s_clipping(deferred: bool) -> None:
    """The norm that clips is the norm of the unscaled gradient (torch's clip_grad_norm_ rule),
    with or without a loss scale, and a bad micro-batch with clipping leaves nothing behind."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    accumulated = accumulator(model, deferred=deferred)
    expected = []
    for size, scale, max_norm in ((3, None, 0.05), (5, 64.0, 0.05), (2, None, 1e3)):
        scaler = torch.amp.GradScaler("cpu", init_scale=scale) if scale else None
        grads = backward(model, size, scaler)
        copies = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
        for copy, grad in zip(copies, grads, strict=True):
            copy.grad = grad.clone()
        torch.nn.utils.clip_grad_norm_(copies, max_norm)  # torch's rule, on the unscaled grads
        expected.append([size * copy.grad for copy in copies])  # type: ignore[operator]
        assert accumulated.add(size, scaler, clip_norm=max_norm)
        model.zero_grad()
    backward(model, 4)
    model.weight.grad[0, 0] = float("nan")  # type: ignore[index]
    accumulated.add(4, clip_norm=0.05)
    model.zero_grad()
    accumulated.settle()
    assert accumulated.samples == 10
    total = [sum(parts) / 10 for parts in zip(*expected, strict=True)]
    for mean, want in zip(mean_of(accumulated, model), total, strict=True):
        torch.testing.assert_close(mean, want, rtol=1e-5, atol=1e-7)


def test_clipping_is_refused_where_grad_holds_the_whole_epoch() -> None:
    model = torch.nn.Linear(4, 2)
    backward(model, 2)
    with pytest.raises(KitUsageError, match="help:"):
        accumulator(model, deferred=False, reuse=True).add(2, clip_norm=1.0)
