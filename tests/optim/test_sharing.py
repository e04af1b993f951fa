"""A late joiner's state download runs while its inner optimizer is built (torch 2.x imports
torch._dynamo on the first optimizer: ~1.4 s), and a failed construction leaves nothing running."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import kit
from kit.errors import StateDownloadFailed
from kit.optim.sharing import StateSharing
from kit.optim.state import StateSnapshot
from kit.optim.stepping import InnerOptimizer
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
            prefetch = joiner._driver.sharing.prefetch
            assert prefetch is not None and prefetch.done()  # during the 1 s
            assert prefetch.result() is not None
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


# --- StateSharing on its own (no sockets: the DHT is a recorder) ----------------------------


class RecordingDHT:
    """Runs nothing: records the coroutines it is given and returns futures the test ends."""

    def __init__(self) -> None:
        self.futures: list[concurrent.futures.Future[Any]] = []

    def run_coroutine(self, fn: Any, return_future: bool = False) -> Any:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self.futures.append(future)
        return future


def sharing_of(model: torch.nn.Module, extra: list[torch.Tensor] | None = None) -> StateSharing:
    inner = InnerOptimizer(
        lambda p: torch.optim.Adam(p, lr=0.1), model.parameters(), copies=True, delay=False
    )
    scheduler = torch.optim.lr_scheduler.StepLR(inner.opt, step_size=1, gamma=0.5)
    return StateSharing(
        dht=RecordingDHT(),
        run_id="run",
        inner=inner,
        extra=extra or [],
        scheduler=scheduler,
        server=None,  # type: ignore[arg-type]
        prefetch=None,
        load_state_timeout=10.0,
    )


def trained(epoch: int, seed: int) -> StateSnapshot:
    """A state of another peer: its model trained one step, its scheduler stepped."""
    torch.manual_seed(seed)
    other = sharing_of(torch.nn.Linear(3, 2), [torch.full((2,), float(seed))])
    other.inner.set_gradients(
        [torch.ones_like(p) for p in other.inner.params], reuse_grad_buffers=False
    )
    other.inner.step(True, other.scheduler, reuse_grad_buffers=False)
    other.publish(epoch, drifted=False)
    assert other.last_shared is not None and other.last_shared.epoch == epoch
    return other.last_shared


def test_a_loaded_state_sets_parameters_copies_extras_optimizer_and_scheduler() -> None:
    theirs = trained(7, seed=1)
    extra = torch.zeros(2)
    mine = sharing_of(torch.nn.Linear(3, 2), [extra])
    mine.load(theirs)
    state = theirs.state()
    for param, master, their in zip(
        mine.inner.params, mine.inner.master, state["params"], strict=True
    ):
        assert torch.equal(param.detach(), their) and torch.equal(master, their)
    assert torch.equal(extra, torch.full((2,), 1.0))
    assert mine.inner.opt.state_dict()["state"][0]["step"] == 1
    assert mine.scheduler is not None and mine.scheduler.get_last_lr() == [0.05]


@pytest.mark.parametrize(
    ("model", "extra", "message"),
    [
        (torch.nn.Linear(3, 3), [torch.zeros(2)], "does not match"),
        (torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)), [], "number of"),
        (torch.nn.Linear(3, 2), [torch.zeros(2), torch.zeros(1)], "extra tensors"),
    ],
)
def test_a_state_of_another_model_is_refused_and_nothing_is_loaded(
    model: torch.nn.Module, extra: list[torch.Tensor], message: str
) -> None:
    mine = sharing_of(model, extra)
    before = [p.detach().clone() for p in mine.inner.params]
    with pytest.raises(StateDownloadFailed, match=message):
        mine.load(trained(7, seed=1))
    for old, param in zip(before, mine.inner.params, strict=True):
        assert torch.equal(old, param.detach())


def test_a_state_tells_the_parameter_round_that_will_still_move_it() -> None:
    theirs = trained(7, seed=1)
    mine = sharing_of(torch.nn.Linear(3, 2), [torch.zeros(2)])
    assert mine.load(theirs) is None  # settled
    mine.publish(8, drifted=True, averaging_round=8)
    assert mine.last_shared is not None
    assert sharing_of(torch.nn.Linear(3, 2), [torch.zeros(2)]).load(mine.last_shared) == 8
    for bad in ("8", 8.0, True):  # a peer's value, checked before anything is loaded
        state = mine.full_state(8)
        state["averaging_round"] = bad
        other = sharing_of(torch.nn.Linear(3, 2), [torch.zeros(2)])
        before = [p.detach().clone() for p in other.inner.params]
        with pytest.raises(StateDownloadFailed, match="help:"):
            other.load(StateSnapshot.capture(8, state))
        after = other.inner.params
        assert all(torch.equal(a, p.detach()) for a, p in zip(before, after, strict=True))


def test_a_refresh_overtaken_by_our_steps_adds_its_delta() -> None:
    mine = sharing_of(torch.nn.Linear(3, 2))
    dht: RecordingDHT = mine.dht
    mine.start_refresh(5)
    assert mine.refreshing and mine.refresh_landed() == (False, None)
    base = [p.detach().clone() for p in mine.inner.params]
    with torch.no_grad():
        for param in mine.inner.params:
            param.add_(1.0)  # our steps while it travelled
    theirs = trained(5, seed=2)
    dht.futures[0].set_result(theirs)
    assert mine.refresh_landed() == (True, theirs) and not mine.refreshing
    mine.add_refresh_delta(theirs, epochs_late=2)
    for old, param, their in zip(base, mine.inner.params, theirs.state()["params"], strict=True):
        torch.testing.assert_close(param.detach(), old + 1.0 + (their - old))


def test_a_failed_refresh_or_prefetch_lands_nothing() -> None:
    mine = sharing_of(torch.nn.Linear(3, 2))
    dht: RecordingDHT = mine.dht
    mine.start_refresh(5)
    dht.futures[0].set_exception(StateDownloadFailed("no donor"))
    assert mine.refresh_landed() == (True, None)
    failed: concurrent.futures.Future[Any] = concurrent.futures.Future()
    failed.set_exception(StateDownloadFailed("no donor"))
    mine.prefetch = failed
    assert mine.take_prefetch(1.0) is None and mine.prefetch is None
    mine.start_refresh(6)
    mine.shutdown()
    assert dht.futures[-1].cancelled() and not mine.refreshing
