"""Issue 10, scenario 5: one byzantine peer of eight, in training, through real averagers.

Eight ``AsyncAverager`` peers (DHT, matchmaking and the butterfly all-reduce, on one
MemoryNetwork in one process, so the test costs CPU and no namespaces) train a linear regression
together on synthetic data: every step each peer computes its minibatch gradient, the eight
average their gradients, and each honest peer applies the average with SGD. The byzantine peer
sends its gradient scaled by -100, or random noise of a large norm.

* clean run (eight honest peers): the reference loss;
* byzantine + ``robust_aggregation="centered_clip"``: within 5 % of the clean loss;
* byzantine + the weighted mean: at least twice the clean loss (in fact it diverges).

The byzantine peer only lies as a sender: as the owner of its part it reduces honestly. A lying
owner corrupts its own part whatever the aggregation (see ``kit.averaging.robust``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
import torch

from kit.averaging.averager import AsyncAverager
from kit.p2p.memory import MemoryNetwork
from tests.averaging.test_averager import start, stop

logger = logging.getLogger(__name__)

PEERS = 8
BYZANTINE = 3
FEATURES = 63  # + a bias: 64 parameters, 8 per part
SAMPLES = 512  # per peer
BATCH = 64
STEPS = 20
LR = 0.3
NOISE = 0.5  # label noise: the loss floor is NOISE**2 / 2


def make_data(peer: int) -> tuple[torch.Tensor, torch.Tensor]:
    truth = torch.randn(FEATURES + 1, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(100 + peer)
    x = torch.cat([torch.randn(SAMPLES, FEATURES, generator=g), torch.ones(SAMPLES, 1)], dim=1)
    return x, x @ truth + NOISE * torch.randn(SAMPLES, generator=g)


def loss_and_gradient(
    w: torch.Tensor, x: torch.Tensor, y: torch.Tensor
) -> tuple[float, torch.Tensor]:
    residual = x @ w - y
    loss = float(residual.double().square().mean() / 2)  # float64: a diverged run stays finite
    return loss, x.T @ residual / len(y)


def attack(gradient: torch.Tensor, kind: str, step: int) -> torch.Tensor:
    if kind == "scaled":
        return -100.0 * gradient
    noise = torch.randn(gradient.shape, generator=torch.Generator().manual_seed(7_000 + step))
    return 100.0 * noise  # ~100 x the initial gradient's norm per coordinate


async def train(byzantine: str | None, method: str) -> float:
    """Train together for STEPS steps; return the honest peers' loss on held-out data."""
    network = MemoryNetwork()
    averagers: list[AsyncAverager] = await start(
        network.create_peer,
        PEERS,
        values=lambda i: [torch.zeros(FEATURES + 1)],
        target_group_size=PEERS,
        robust_aggregation=method,
    )
    data = [make_data(i) for i in range(PEERS)]
    weights = [torch.zeros(FEATURES + 1) for _ in range(PEERS)]
    try:
        for step in range(STEPS):
            for i, averager in enumerate(averagers):
                g = torch.Generator().manual_seed(step * PEERS + i)
                batch = torch.randint(SAMPLES, (BATCH,), generator=g)
                _, gradient = loss_and_gradient(weights[i], data[i][0][batch], data[i][1][batch])
                if byzantine is not None and i == BYZANTINE:
                    gradient = attack(gradient, byzantine, step)
                averager.tensors[0].copy_(gradient)
            results = await asyncio.gather(*(a.step(timeout=10.0) for a in averagers))
            assert all(r is not None and r.is_full for r in results), results
            for i, averager in enumerate(averagers):
                weights[i] -= LR * averager.tensors[0]
    finally:
        await stop(averagers)
    honest = [i for i in range(PEERS) if byzantine is None or i != BYZANTINE]
    assert all(torch.equal(weights[i], weights[honest[0]]) for i in honest)
    held_out_x, held_out_y = make_data(PEERS + 1)
    return loss_and_gradient(weights[honest[0]], held_out_x, held_out_y)[0]


def run(byzantine: str | None, method: str) -> float:
    return asyncio.run(asyncio.wait_for(train(byzantine, method), 120.0))


_clean: list[float] = []


def clean_loss() -> float:
    if not _clean:  # the reference run is the same for both attacks: run it once
        _clean.append(run(None, "mean"))
    return _clean[0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["scaled", "random"])
def test_centered_clip_keeps_the_loss_of_the_clean_run(kind: str, record_property: Any) -> None:
    clean = clean_loss()
    clipped = run(kind, "centered_clip")
    damaged = run(kind, "mean")
    logger.info(
        "byzantine %s: clean %.4f, centered_clip %.4f, mean %.4g", kind, clean, clipped, damaged
    )
    record_property("losses", {"clean": clean, "centered_clip": clipped, "mean": damaged})
    assert clean < 2 * NOISE**2  # the clean run learned (floor NOISE**2 / 2; start ~ 32)
    assert abs(clipped - clean) <= 0.05 * clean, (clean, clipped)
    assert damaged >= 2 * clean, (clean, damaged)
