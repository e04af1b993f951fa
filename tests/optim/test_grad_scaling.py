"""kit.optim.grad_scaling against torch's own GradScaler: its update() consumes kit's checks,
growth is held while .grad holds part of an epoch, and hivemind's GradScaler name."""

from __future__ import annotations

import pytest
import torch

import kit
from kit.optim.grad_scaling import (
    GradScaler,
    current_scale,
    found_inf_tensor,
    hold_growth,
    record_check,
)


def scaler_with_scale(**options: float) -> torch.amp.GradScaler:
    scaler = torch.amp.GradScaler("cpu", **options)  # type: ignore[arg-type]
    scaler.scale(torch.ones(()))  # torch creates the scale at the first scale() call
    return scaler


def test_torch_update_consumes_recorded_checks() -> None:
    scaler = scaler_with_scale(init_scale=8.0, growth_interval=2)
    key = object()
    record_check(scaler, key, found_inf_tensor(False, current_scale(scaler)))
    scaler.update()
    assert scaler.get_scale() == 8.0
    record_check(scaler, key, found_inf_tensor(False, None))
    scaler.update()
    assert scaler.get_scale() == 16.0  # growth_interval clean steps: it grows
    record_check(scaler, key, torch.tensor(0.0))
    record_check(scaler, object(), torch.tensor(1.0))  # two checks before one update add up
    scaler.update()
    assert scaler.get_scale() == 8.0
    with pytest.raises(AssertionError, match="No inf checks"):
        scaler.update()  # torch's own rule still holds: nothing recorded, nothing to update


def test_hold_growth_keeps_the_scale_until_a_check_without_it() -> None:
    scaler = scaler_with_scale(init_scale=4.0, growth_interval=3)
    for _ in range(10):  # a long epoch with reuse_grad_buffers: .grad holds its gradients
        record_check(scaler, scaler, torch.tensor(0.0))
        hold_growth(scaler)
        scaler.update()
    assert scaler.get_scale() == 4.0
    record_check(scaler, scaler, torch.tensor(0.0))  # the global step consumed .grad
    scaler.update()
    assert scaler.get_scale() == 8.0
    hold_growth(torch.amp.GradScaler("cpu"))  # no scale yet: nothing to hold


def test_current_scale_reads_nothing_back_and_knows_a_missing_scale() -> None:
    assert current_scale(None) is None
    assert current_scale(torch.amp.GradScaler("cpu")) is None  # before any scale()
    assert current_scale(torch.amp.GradScaler("cpu", enabled=False)) is None
    scale = current_scale(scaler_with_scale(init_scale=32.0))
    assert isinstance(scale, torch.Tensor) and float(scale) == 32.0


def test_hivemind_s_grad_scaler_takes_hivemind_s_arguments() -> None:
    scaler = kit.GradScaler(2.0**10, 4.0, 0.25, 7)
    assert isinstance(scaler, torch.amp.GradScaler) and type(scaler) is GradScaler
    assert scaler.get_growth_factor() == 4.0 and scaler.get_backoff_factor() == 0.25
    assert scaler.get_growth_interval() == 7
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert scaler._device == expected
    assert kit.optim.GradScaler is GradScaler
