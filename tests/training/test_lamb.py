"""kit's LAMB against the recipe's reference, ``torch_optimizer.Lamb``, and its 8-bit twin."""

from __future__ import annotations

import pytest
import torch

from kit.errors import ConfigError
from kit.training.lamb import Lamb

torch_optimizer = pytest.importorskip("torch_optimizer")

STEPS = 200


def make_model() -> torch.nn.Module:
    """Weights, a LayerNorm and zero-initialized biases (trust ratio 1 at their first step)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.LayerNorm(64), torch.nn.GELU(), torch.nn.Linear(64, 8)
    )
    with torch.no_grad():
        model[0].bias.zero_()
        model[3].bias.zero_()
        model[3].weight.mul_(30.0)  # a norm above the clamp of the clamp test
    return model


def groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, object]]:
    """sahajBERT's two groups: no decay on biases and LayerNorm weights."""
    named = list(model.named_parameters())
    no_decay = [p for n, p in named if n.endswith("bias") or n.startswith("1.")]
    decay = [p for n, p in named if not (n.endswith("bias") or n.startswith("1."))]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int = STEPS) -> None:
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(16, 32, generator=generator)
        y = torch.randn(16, 8, generator=generator)
        optimizer.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        optimizer.step()


def relative_difference(
    ours: torch.nn.Module, reference: torch.nn.Module, start: list[torch.Tensor]
) -> float:
    """The largest, over tensors, of |ours - reference| relative to the reference's displacement."""
    return max(
        float((a - b).detach().norm() / (b - s).detach().norm())
        for a, b, s in zip(ours.parameters(), reference.parameters(), start, strict=True)
    )


@pytest.mark.parametrize(
    ("debias", "clamp_value"),
    [(True, 10_000.0), (True, 2.0), (False, 10_000.0)],
    ids=["sahajbert", "clamped", "ttt-no-debias"],
)
def test_lamb_follows_torch_optimizer_over_200_steps(debias: bool, clamp_value: float) -> None:
    settings = dict(
        lr=0.01, betas=(0.9, 0.96), eps=1e-6, weight_decay=0.01, clamp_value=clamp_value
    )
    ours, reference = make_model(), make_model()
    start = [p.detach().clone() for p in reference.parameters()]
    assert (
        float(reference[3].weight.detach().norm()) > 2.0
    )  # the clamp is active in the "clamped" case
    train(ours, Lamb(groups(ours, 0.01), debias=debias, **settings))
    train(reference, torch_optimizer.Lamb(groups(reference, 0.01), debias=debias, **settings))
    assert relative_difference(ours, reference, start) <= 1e-6


def test_the_acceptance_signature_matches_the_reference_with_debias() -> None:
    ours, reference = make_model(), make_model()
    start = [p.detach().clone() for p in reference.parameters()]
    train(ours, Lamb(ours.parameters(), 0.00176, (0.9, 0.999), 1e-6, 0.01, 10_000.0))
    train(
        reference,
        torch_optimizer.Lamb(
            reference.parameters(), 0.00176, (0.9, 0.999), 1e-6, 0.01, 10_000.0, debias=True
        ),
    )
    assert relative_difference(ours, reference, start) <= 1e-6


def test_debias_changes_the_first_steps_as_the_recipe_says() -> None:
    """With debias, step t is scaled by sqrt(1 - b2^t) / (1 - b1^t) after the trust ratio."""
    param = torch.nn.Parameter(torch.ones(4))
    plain = torch.nn.Parameter(torch.ones(4))
    param.grad = plain.grad = torch.tensor([1.0, -2.0, 3.0, 0.5])
    Lamb([param], lr=0.1, betas=(0.9, 0.999), debias=True).step()
    Lamb([plain], lr=0.1, betas=(0.9, 0.999), debias=False).step()
    factor = (1 - 0.999) ** 0.5 / (1 - 0.9)
    assert torch.allclose(1 - param.detach(), factor * (1 - plain.detach()), rtol=1e-6)


def test_clipping_inside_the_step_is_global_clipping_first() -> None:
    ours, reference = make_model(), make_model()
    start = [p.detach().clone() for p in reference.parameters()]
    ours_opt = Lamb(ours.parameters(), lr=0.01, max_grad_norm=0.05)
    ref_opt = torch_optimizer.Lamb(reference.parameters(), lr=0.01, debias=True)
    generator = torch.Generator().manual_seed(1)
    for _ in range(50):
        x, y = torch.randn(16, 32, generator=generator), torch.randn(16, 8, generator=generator)
        for model, optimizer in ((ours, ours_opt), (reference, ref_opt)):
            optimizer.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            if optimizer is ref_opt:
                assert float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)) > 0.05
            optimizer.step()
    assert relative_difference(ours, reference, start) <= 1e-6


def test_bad_hyperparameters_are_config_errors_with_help() -> None:
    for bad in (dict(lr=0.0), dict(betas=(1.0, 0.9)), dict(clamp_value=0.0), dict(max_grad_norm=0)):
        with pytest.raises(ConfigError, match="help:"):
            Lamb([torch.nn.Parameter(torch.ones(2))], **bad)  # type: ignore[arg-type]


# --- 8-bit LAMB ---------------------------------------------------------------------------------


def test_lamb8bit_is_a_bitsandbytes_optimizer_with_8bit_statistics_on_the_cpu() -> None:
    pytest.importorskip("bitsandbytes")
    from bitsandbytes.optim.optimizer import Optimizer8bit

    from kit.training.lamb8bit import Lamb8bit

    big = torch.nn.Parameter(torch.randn(300, 300))  # 90,000 elements: 8-bit statistics
    small = torch.nn.Parameter(torch.zeros(300))  # fp32 statistics, as TTT kept them
    optimizer = Lamb8bit([big, small], lr=0.01)
    assert isinstance(optimizer, Optimizer8bit)
    big.grad, small.grad = torch.randn_like(big), torch.randn_like(small)
    optimizer.step()
    state = optimizer.state[big]
    assert state["state1"].dtype == state["state2"].dtype == torch.uint8
    assert state["absmax1"].numel() == -(-big.numel() // 4096)
    assert optimizer.state[small]["state1"].dtype == torch.float32
    assert torch.isfinite(big).all() and torch.isfinite(small).all()
    # bitsandbytes' own state_dict/load_state_dict carry the 8-bit tensors.
    restored = Lamb8bit([big, small], lr=0.01)
    restored.load_state_dict(optimizer.state_dict())
    assert torch.equal(restored.state[big]["state1"], state["state1"])


def test_lamb8bit_is_lamb_with_quantized_statistics() -> None:
    pytest.importorskip("bitsandbytes")
    from kit.training.lamb8bit import Lamb8bit

    def wide() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(512, 256), torch.nn.Linear(256, 8))

    settings = dict(lr=0.01, weight_decay=0.01, debias=False, max_grad_norm=4.0)
    fp32 = wide()
    start = [p.detach().clone() for p in fp32.parameters()]
    exact, quantized = wide(), wide()

    def run(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        generator = torch.Generator().manual_seed(1)
        for _ in range(100):
            x, y = (
                torch.randn(16, 512, generator=generator),
                torch.randn(16, 8, generator=generator),
            )
            optimizer.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            optimizer.step()

    run(fp32, Lamb(fp32.parameters(), **settings))  # type: ignore[arg-type]
    run(exact, Lamb8bit(exact.parameters(), min_8bit_size=10**9, **settings))  # type: ignore[arg-type]
    run(quantized, Lamb8bit(quantized.parameters(), **settings))  # type: ignore[arg-type]
    # No tensor quantized: the same update as the fp32 LAMB, to rounding.
    assert relative_difference(exact, fp32, start) <= 1e-6
    # 8-bit moments: the same trajectory within a few percent of the displacement.
    assert relative_difference(quantized, fp32, start) < 0.1
