"""A late joiner's state download runs while its inner optimizer is built (torch 2.x imports
torch._dynamo on the first optimizer: ~1.4 s), and a failed construction leaves nothing running."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import kit
from kit.runtime import get_runtime

pytestmark = [pytest.mark.sockets]


@pytest.fixture
def dhts() -> Iterator[tuple[kit.DHT, kit.DHT]]:
    first = kit.DHT(host="127.0.0.1", client_mode=False)
    second = kit.DHT(initial_peers=first.get_visible_maddrs(), host="127.0.0.1", client_mode=False)
    yield first, second
    second.shutdown()
    first.shutdown()


def optimizer(dht: kit.DHT, model: torch.nn.Module, factory: Any, run_id: str) -> kit.Optimizer:
    return kit.Optimizer(
        dht=dht,
        run_id=run_id,
        target_batch_size=64,
        batch_size_per_step=4,
        optimizer=factory,
        params=model.parameters(),
        matchmaking_time=0.5,
        averaging_timeout=5.0,
    )


def tracker_tasks() -> list[asyncio.Task[Any]]:
    async def running() -> list[asyncio.Task[Any]]:
        return [t for t in asyncio.all_tasks() if "ProgressTracker._run" in repr(t.get_coro())]

    return get_runtime().call(running(), timeout=5.0)


def test_the_state_downloads_while_the_inner_optimizer_is_built(dhts) -> None:
    first, second = dhts
    torch.manual_seed(0)
    donor_model = torch.nn.Linear(8, 4)
    donor = optimizer(first, donor_model, lambda p: torch.optim.Adam(p, lr=0.1), "join")
    built: list[float] = []

    def slow_adam(params: Any) -> torch.optim.Optimizer:
        time.sleep(1.0)  # as long as torch._dynamo's first import, roughly
        built.append(time.monotonic())
        return torch.optim.Adam(params, lr=0.1)

    try:
        donor.local_epoch = 3  # as if it had trained 3 global steps
        donor.share_state()
        time.sleep(0.5)  # its record reaches the DHT
        joiner = optimizer(second, torch.nn.Linear(8, 4), slow_adam, "join")
        try:
            assert joiner._prefetch is not None and joiner._prefetch.done()  # during the 1 s
            assert joiner._prefetch.result() is not None
            joiner.load_state_from_peers()
            assert joiner.local_epoch == 3 and len(built) == 1
            assert joiner.tracker.fetched_at is not None  # it looked at the progress, too
        finally:
            joiner.shutdown()
    finally:
        donor.shutdown()


def test_a_failing_optimizer_factory_leaves_no_tracker_running(dhts) -> None:
    first, _ = dhts
    before = len(tracker_tasks())

    def broken(params: Any) -> torch.optim.Optimizer:
        raise ValueError("a typo in the factory")

    with pytest.raises(ValueError, match="typo"):
        optimizer(first, torch.nn.Linear(2, 2), broken, "broken")
    give_up = time.monotonic() + 5.0
    while len(tracker_tasks()) > before and time.monotonic() < give_up:
        time.sleep(0.05)
    assert len(tracker_tasks()) == before
