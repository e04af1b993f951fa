"""kit's fused clipping against torch.nn.utils.clip_grad_norm_ itself."""

from __future__ import annotations

import pytest
import torch

from kit.training.clipping import clip_grad_norm


@pytest.mark.parametrize("max_norm", [0.01, 1.0, 1e6], ids=["clips", "clips-some", "leaves"])
def test_clip_grad_norm_is_torch_s(max_norm: float) -> None:
    generator = torch.Generator().manual_seed(0)
    shapes = [(30, 7), (7,), (3, 4, 5)]
    ours = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
    theirs = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
    for mine, reference in zip(ours, theirs, strict=True):
        mine.grad = torch.randn(mine.shape, generator=generator)
        reference.grad = mine.grad.clone()
    ours.append(torch.nn.Parameter(torch.zeros(2)))  # no gradient: skipped, as torch skips it
    total = clip_grad_norm(ours, max_norm)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    assert total is not None
    torch.testing.assert_close(total, expected)
    for mine, reference in zip(ours, theirs, strict=False):
        torch.testing.assert_close(mine.grad, reference.grad)
    assert clip_grad_norm([torch.nn.Parameter(torch.zeros(2))], 1.0) is None
