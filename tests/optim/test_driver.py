"""The epoch driver carries out the epoch machine's actions with the optimizer's parts.

In-process and fast: a real inner optimizer and accumulator on a tiny model; the tracker, the
gradient rounds and state sharing are recorders standing in for the DHT and the averager (the
swarm tests in test_optimizer.py / test_options.py run the real ones).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kit.optim.accumulation import GradientAccumulator
from kit.optim.driver import EpochDriver
from kit.optim.epoch_actions import DropAccumulated, FlagDrift, Publish, StartRefresh
from kit.optim.epochs import EpochLife, Phase, Refresh, Report, Sync
from kit.optim.progress import GlobalProgress, PerformanceEMA
from kit.optim.rounds import RoundOutcome
from kit.optim.state import StateSnapshot
from kit.optim.state_averaging import AveragedTensors
from kit.optim.stepping import InnerOptimizer
from tests.optim.recorders import Result

SEARCH = 7.0  # s a round may look for its group


class Tracker:
    """What the driver asks the progress tracker, and what it tells it."""

    def __init__(self) -> None:
        self.epoch = 0
        self.samples = 0
        self.peers = 3
        self.others_at = 0  # other peers at any epoch asked about
        self.reports: list[tuple[int, int]] = []
        self.drift_flags: list[bool] = []
        self.performance_ema = PerformanceEMA()

    @property
    def global_progress(self) -> GlobalProgress:
        return GlobalProgress(self.epoch, self.samples, 64, self.peers, 0, 1.0, 0.0)

    @property
    def ready_to_update_epoch(self) -> bool:
        return self.samples >= 64

    def report_local_progress(self, epoch: int, samples: int) -> None:
        self.reports.append((epoch, samples))

    def set_drifted(self, drifted: bool) -> None:
        self.drift_flags.append(drifted)

    def others_at_epoch(self, epoch: int) -> int:
        return self.others_at

    def others_drifted(self, epoch: int) -> bool:
        return False

    def peers_at_epoch(self, epoch: int, *, with_samples: bool = False) -> int:
        return self.peers


class Rounds:
    """Gradient rounds that return the outcome a test sets."""

    search_time = SEARCH

    def __init__(self) -> None:
        self.result: Result | None = Result(3)
        self.rounds: list[tuple[int, int]] = []
        self.listeners: list[Any] = []
        self.exact_gradients = True

    def take_mean(self, accumulated: GradientAccumulator) -> None:
        self.mean = [torch.full_like(p, 0.5) for p in accumulated.params]

    def give_to(
        self, inner: InnerOptimizer, outcome: RoundOutcome, *, reuse_grad_buffers: bool
    ) -> None:
        inner.set_gradients(self.mean, reuse_grad_buffers=reuse_grad_buffers)

    def average(self, epoch: int, samples: int, **options: Any) -> RoundOutcome:
        self.rounds.append((epoch, samples))
        return RoundOutcome(epoch, self.result, 3, exact=True)  # type: ignore[arg-type]


class Sharing:
    """State sharing that records what it was asked to do; downloads land when a test says."""

    scheduler = None
    last_shared = None

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.landed: tuple[bool, StateSnapshot | None] = (False, None)
        self.refreshing = False
        self.published: list[tuple[int, bool]] = []
        self.loaded: list[int] = []

    def cancel_prefetch(self) -> None:
        self.calls.append("cancel prefetch")

    def start_refresh(self, min_epoch: int) -> None:
        self.calls.append(f"refresh from {min_epoch}")
        self.refreshing = True

    def refresh_landed(self) -> tuple[bool, StateSnapshot | None]:
        self.refreshing = not self.landed[0]
        return self.landed

    def add_refresh_delta(self, snapshot: StateSnapshot, epochs_late: int) -> None:
        self.calls.append(f"delta of {snapshot.epoch}, {epochs_late} late")

    def load(self, snapshot: StateSnapshot) -> None:
        self.loaded.append(snapshot.epoch)

    def publish(self, epoch: int, *, drifted: bool) -> None:
        self.published.append((epoch, drifted))


class StateRound:
    running = False

    def __init__(self) -> None:
        self.started: list[int] = []

    def start(self, source: Any, bits: str, expected: int, timeout: float) -> None:
        self.started.append(expected)
        self.running = True

    def finish(self, wait: float | None) -> tuple[bool, Result]:
        self.running = False
        return True, Result(3)

    def complete(self, result: Result) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_driver(
    delay: bool = False, **options: Any
) -> tuple[EpochDriver, Tracker, Rounds, Sharing, Clock]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    sgd = (lambda params: torch.optim.SGD(params, lr=1.0)) if delay else None
    inner = InnerOptimizer(
        sgd or torch.optim.SGD(model.parameters(), lr=1.0),
        model.parameters() if delay else None,
        copies=False,
        delay=delay,
    )
    tracker, rounds, sharing, clock = Tracker(), Rounds(), Sharing(), Clock()
    life = EpochLife()
    life.state_loaded(0, 0, keep_accumulated=False)  # joined at epoch 0, in sync
    driver = EpochDriver(
        life=life,
        inner=inner,
        accumulated=GradientAccumulator(inner.params, reuse_grad_buffers=False, buffered=True),
        tracker=tracker,  # type: ignore[arg-type]
        rounds=rounds,  # type: ignore[arg-type]
        sharing=sharing,  # type: ignore[arg-type]
        state_round=StateRound(),  # type: ignore[arg-type]
        averaged=AveragedTensors(inner, (), []),
        runtime=None,  # type: ignore[arg-type]
        options={
            "use_local_updates": False,
            "auxiliary": False,
            "reuse_grad_buffers": False,
            "delay_grad_averaging": False,
            "delay_state_averaging": True,
            "average_state_every": 1,
            "matchmaking_time": 3.0,
            "load_state_timeout": 10.0,
            "verbose": False,
            **options,
        },
        clock=clock,
    )
    return driver, tracker, rounds, sharing, clock


def backward(driver: EpochDriver) -> None:
    for param in driver.inner.params:
        param.grad = torch.ones_like(param)


def test_each_action_reaches_its_part() -> None:
    driver, tracker, _, sharing, _ = make_driver()
    backward(driver)
    driver.accumulated.add(8)
    driver.act([Publish(4, 9), FlagDrift(True), DropAccumulated(), StartRefresh(4)])
    assert tracker.reports == [(4, 9)] and tracker.drift_flags == [True]
    assert driver.accumulated.samples == 0 and sharing.calls == ["refresh from 4"]
    mean = [torch.ones_like(p) for p in driver.inner.params]
    driver.accumulated.mean_gradient(mean)
    assert all(not m.any() for m in mean)  # what was accumulated is gone


def test_a_global_step_averages_steps_and_reports_the_next_epoch() -> None:
    driver, tracker, rounds, sharing, _ = make_driver()
    before = [p.detach().clone() for p in driver.inner.params]
    for _ in range(2):
        backward(driver)
        tracker.samples += 32
        driver.step(32, None)
    assert rounds.rounds == [(0, 64)] and driver.life.epoch == 1
    assert driver.life.phase is Phase.ACCUMULATING and driver.life.last_group_size == 3
    # SGD(lr=1) with the averaged gradient 0.5 everywhere.
    for old, new in zip(before, driver.inner.params, strict=True):
        torch.testing.assert_close(new.detach(), old - 0.5)
    assert tracker.reports[-1] == (1, 0) and sharing.published[-1] == (1, False)


def test_a_failed_round_holds_the_report_then_refreshes() -> None:
    driver, tracker, rounds, sharing, clock = make_driver()
    rounds.result = None  # its group never formed
    tracker.others_at = 2  # the others still look for theirs at epoch 0
    backward(driver)
    tracker.samples = 64
    driver.step(64, None)
    assert driver.life.epoch == 1 and driver.life.report is Report.HELD_AFTER_FAILURE
    assert tracker.reports[-1] == (0, 64)  # the others still see us in their round
    assert tracker.drift_flags[-1] is True and sharing.calls == ["refresh from 1"]
    tracker.samples = 0
    backward(driver)
    driver.step(8, None)
    assert tracker.reports[-1] == (0, 64)  # still held...
    clock.now += SEARCH  # ...until the deadline
    driver.step(8, None)
    assert tracker.reports[-1] == (1, 16) and driver.life.report is Report.LIVE


def test_a_round_failed_after_the_others_moved_on_joins_their_epoch() -> None:
    driver, tracker, rounds, sharing, _ = make_driver()
    rounds.result = None

    def late_average(epoch: int, samples: int, **options: Any) -> RoundOutcome:
        tracker.epoch = 3  # they went on while we looked for a group
        return RoundOutcome(epoch, None, 3, exact=True)

    rounds.average = late_average  # type: ignore[method-assign]
    before = [p.detach().clone() for p in driver.inner.params]
    backward(driver)
    tracker.samples = 64
    driver.step(64, None)
    assert driver.life.epoch == 3 and driver.accumulated.samples == 0
    assert tracker.reports[-1] == (3, 0) and sharing.calls == ["refresh from 3"]
    for old, new in zip(before, driver.inner.params, strict=True):
        torch.testing.assert_close(new.detach(), old)  # no step on a stale batch


def test_a_landed_refresh_of_our_epoch_is_loaded_and_clears_drift() -> None:
    driver, tracker, _, sharing, _ = make_driver()
    driver.act(driver.life.fast_forward(5))
    assert driver.life.refresh is Refresh.DOWNLOADING and driver.life.drifted
    backward(driver)
    driver.accumulated.add(8)
    sharing.landed = (True, StateSnapshot.capture(5, {"epoch": 5}, digest=False))
    driver.apply_refresh()
    assert sharing.loaded == [5] and driver.life.sync is Sync.IN_SYNC
    assert driver.accumulated.samples == 8  # of our epoch: what we accumulated stays
    assert tracker.reports[-1] == (5, 8) and sharing.published[-1] == (5, False)


def test_a_refresh_overtaken_by_our_steps_lands_as_a_delta_and_is_fetched_again() -> None:
    driver, _, _, sharing, _ = make_driver()
    driver.act(driver.life.fast_forward(5))
    driver.life.epoch_set(7)  # we stepped twice while it travelled
    sharing.landed = (True, StateSnapshot.capture(5, {"epoch": 5}, digest=False))
    driver.apply_refresh()
    assert sharing.calls[-2:] == ["delta of 5, 2 late", "refresh from 7"]
    assert sharing.loaded == [] and driver.life.drifted


def test_a_state_download_that_lands_nothing_leaves_the_drift_flag() -> None:
    driver, _, _, sharing, _ = make_driver()
    driver.act(driver.life.fast_forward(5))
    sharing.landed = (True, None)
    driver.apply_refresh()
    assert driver.life.refresh is Refresh.IDLE and driver.life.drifted and sharing.loaded == []


@pytest.mark.parametrize("flag", [True, False])
def test_the_drift_flag_brings_a_parameter_round(flag: bool) -> None:
    driver, tracker, _, _, _ = make_driver()
    if flag:
        driver.act(driver.life.drifted_by())
    driver.state_round.running = False  # type: ignore[misc]
    backward(driver)
    tracker.samples = 64
    driver.step(64, None)
    started = driver.state_round.started  # type: ignore[attr-defined]
    assert started == ([3] if flag else [])  # the round's group is who will be there


@pytest.mark.parametrize("drift_meanwhile", [True, False])
def test_a_parameter_round_clears_only_the_drift_before_it(drift_meanwhile: bool) -> None:
    driver, tracker, _, _, _ = make_driver()
    driver.act(driver.life.drifted_by())
    backward(driver)
    tracker.samples = 64
    driver.step(64, None)  # the round starts (delay_state_averaging: it runs in the background)
    assert driver.state_round.running  # type: ignore[truthy-function]
    if drift_meanwhile:
        driver.act(driver.life.drifted_by())  # e.g. a rolled-back step while the round ran
    driver.finish_state_round(wait=None)  # complete, with everyone expected
    assert driver.life.drifted is drift_meanwhile
    assert tracker.drift_flags[-1] is drift_meanwhile


@pytest.mark.parametrize("averaged", [True, False])
def test_a_background_round_holds_the_report_until_its_step_lands(averaged: bool) -> None:
    driver, tracker, rounds, sharing, clock = make_driver(delay=True, delay_grad_averaging=True)
    rounds.result = Result(3) if averaged else None
    tracker.others_at = 1
    try:
        backward(driver)
        tracker.samples = 64
        driver.step(64, None)
        assert driver.life.epoch == 1 and driver.life.report is Report.HELD_IN_ROUND
        assert tracker.reports[-1] == (0, 64) and not driver.life.may_step()
        backward(driver)
        tracker.samples = 0
        driver.finish_optimizer_step(wait=None)  # the safe point where the step lands
        assert rounds.rounds == [(0, 64)] and driver.life.phase is Phase.ACCUMULATING
        if averaged:
            assert tracker.reports[-1] == (1, 0) and driver.life.may_step()
        else:  # held while others may still be in that round, until the deadline
            assert driver.life.report is Report.HELD_AFTER_FAILURE
            assert tracker.reports[-1] == (0, 64) and sharing.calls == ["refresh from 1"]
            clock.now += SEARCH
            driver.report()
            assert tracker.reports[-1] == (1, 0)
    finally:
        driver.inner.shutdown()
