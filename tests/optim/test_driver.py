"""The epoch driver carries out the epoch machine's actions with the optimizer's parts (and its
state landing, ``kit.optim.landing``: loads, refreshes, serving).

In-process and fast: a real inner optimizer and accumulator on a tiny model; the tracker, the
gradient rounds and state sharing are recorders standing in for the DHT and the averager (the
swarm tests in test_optimizer.py / test_options.py run the real ones).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kit.errors import AveragingFailed
from kit.optim.accumulation import GradientAccumulator
from kit.optim.driver import EpochDriver
from kit.optim.epoch_actions import DropAccumulated, FlagDrift, Publish, StartRefresh
from kit.optim.epochs import EpochLife, Phase, Refresh, Report, Sync
from kit.optim.progress import GlobalProgress, PerformanceEMA
from kit.optim.rounds import RoundOutcome, group_bits
from kit.optim.splits import ROUND_HISTORY, RoundTag
from kit.optim.state import StateSnapshot
from kit.optim.state_averaging import AveragedTensors, DelayedStateAveraging
from kit.optim.stepping import InnerOptimizer
from tests.optim.recorders import Averager, Result

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
        self.others_drift = False  # what others_drifted says
        self.round_tags: tuple[RoundTag, ...] = ()  # ours, as the driver tagged them
        self.others_tags: list[tuple[bytes, tuple[RoundTag, ...]]] = []  # the others', "fetched"
        self.fetched_at = 0.0
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
        return self.others_drift

    def peers_at_epoch(self, epoch: int, *, with_samples: bool = False) -> int:
        return self.peers

    def add_round(self, tag: RoundTag) -> None:
        self.round_tags = (*self.round_tags, tag)[-ROUND_HISTORY:]

    def others_round_tags(self) -> list[tuple[bytes, tuple[RoundTag, ...]]]:
        return self.others_tags


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
    ) -> bool:
        if not all(bool(torch.isfinite(t).all()) for t in self.mean):
            return False
        inner.set_gradients(self.mean, reuse_grad_buffers=reuse_grad_buffers)
        return True

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
        self.averaging_rounds: list[int | None] = []  # the marks of what was published
        self.loaded: list[int] = []
        self.load_tensors: list[torch.Tensor] = []  # what a load puts in the parameters, if set
        self.inner: InnerOptimizer | None = None

    def cancel_prefetch(self) -> None:
        self.calls.append("cancel prefetch")

    def start_refresh(self, min_epoch: int, donors: frozenset[bytes] | None = None) -> None:
        self.calls.append(f"refresh from {min_epoch}")
        self.refresh_donors = donors
        self.refreshing = True

    def refresh_landed(self) -> tuple[bool, StateSnapshot | None]:
        self.refreshing = not self.landed[0]
        return self.landed

    def add_refresh_delta(self, snapshot: StateSnapshot, epochs_late: int) -> None:
        self.calls.append(f"delta of {snapshot.epoch}, {epochs_late} late")

    def load(self, snapshot: StateSnapshot) -> int | None:
        self.loaded.append(snapshot.epoch)
        if self.load_tensors and self.inner is not None:
            self.inner.load(self.load_tensors)
        averaging_round: int | None = snapshot.state().get("averaging_round")
        return averaging_round

    def publish(self, epoch: int, *, drifted: bool, averaging_round: int | None = None) -> None:
        self.published.append((epoch, drifted))
        self.averaging_rounds.append(averaging_round)


class StateRound:
    running = False
    rebased = False
    epoch = -1

    def __init__(self) -> None:
        self.started: list[int] = []

    def start(self, source: Any, bits: str, expected: int, timeout: float, epoch: int = -1) -> None:
        self.started.append(expected)
        self.running = True
        self.epoch = epoch

    def give_up_search(self) -> bool:
        self.running = False  # (still looking for its group)
        return True

    @property
    def moves_parameters(self) -> bool:
        return self.running

    def forget(self) -> None:
        pass

    def rebase(self, source: Any) -> None:
        pass

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
    sharing.inner = inner
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


@pytest.mark.parametrize("case", ["lost", "won", "partial", "refreshing"])
def test_a_round_that_split_from_a_larger_group_copies_that_groups_state(case: str) -> None:
    # The churn test's split (kit.optim.splits): four peers averaged 2 + 2 at epoch 0, each
    # pair full and exact, and parted for good (Adam's statistics differed too).
    driver, tracker, rounds, sharing, _ = make_driver()
    rounds.result = Result(2, is_full=case != "partial", group_id=b"pair-B-of-epoch-0")
    backward(driver)
    tracker.samples = 64
    driver.step(64, None)
    tracker.samples = 0
    ours = RoundTag(0, b"pair-B-o", 2)
    assert tracker.round_tags == (() if case == "partial" else (ours,))
    other = (b"pair-A-o" if case == "lost" else b"pair-C-o", 2)
    tracker.others_tags = [(b"p%d" % i, (RoundTag(0, *other),)) for i in (1, 2)]
    if case == "refreshing":  # a catch-up under way: the split waits for it to land
        driver.act(driver.life.fast_forward(1))
    calls = list(sharing.calls)
    driver.step(8, None)  # a fresh look at the records
    if case != "lost":
        assert sharing.calls == calls and getattr(sharing, "refresh_donors", None) is None
        return
    assert sharing.calls == [*calls, "refresh from 1"] and driver.life.drifted
    assert sharing.refresh_donors == {b"p1", b"p2"} and tracker.drift_flags[-1] is True
    tracker.fetched_at += 1.0
    driver.step(8, None)  # once only
    assert sharing.calls == [*calls, "refresh from 1"]


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
    driver.landing.apply_refresh()
    assert sharing.loaded == [5] and driver.life.sync is Sync.IN_SYNC
    assert driver.accumulated.samples == 8  # of our epoch: what we accumulated stays
    assert tracker.reports[-1] == (5, 8) and sharing.published[-1] == (5, False)


def test_a_refresh_overtaken_by_our_steps_lands_as_a_delta_and_is_fetched_again() -> None:
    driver, _, _, sharing, _ = make_driver()
    driver.act(driver.life.fast_forward(5))
    driver.life.epoch_set(7)  # we stepped twice while it travelled
    sharing.landed = (True, StateSnapshot.capture(5, {"epoch": 5}, digest=False))
    driver.landing.apply_refresh()
    assert sharing.calls[-2:] == ["delta of 5, 2 late", "refresh from 7"]
    assert sharing.loaded == [] and driver.life.drifted


def test_a_state_download_that_lands_nothing_leaves_the_drift_flag() -> None:
    driver, _, _, sharing, _ = make_driver()
    driver.act(driver.life.fast_forward(5))
    sharing.landed = (True, None)
    driver.landing.apply_refresh()
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


def with_real_parameter_rounds(driver: EpochDriver) -> tuple[Averager, list[torch.Tensor]]:
    """The driver's parameter rounds through ``DelayedStateAveraging`` (the delta rule), on an
    averager whose rounds the test ends; returns it and its buffers (what a round averaged)."""
    buffers = [torch.zeros_like(p) for p in driver.inner.params]
    averager = Averager(buffers)
    state_round = DelayedStateAveraging(averager, driver.averaged.add)  # type: ignore[arg-type]
    driver.state_round = driver.landing.state_round = state_round  # (both hold the part)
    return averager, buffers


def drifted_global_step(driver: EpochDriver, tracker: Tracker) -> None:
    """A drifted peer's global step: its parameter round of epoch 1 begins in the background."""
    driver.act(driver.life.drifted_by())
    backward(driver)
    tracker.samples = 64
    driver.step(64, None)
    tracker.samples = 0
    assert driver.life.epoch == 1 and driver.state_round.running


def land(averager: Averager, buffers: list[torch.Tensor], average: float | None) -> None:
    """End the running round: the group's average, or no group (None)."""
    if average is None:
        averager.steps[-1].set_exception(AveragingFailed("no group"))
        return
    for buffer in buffers:
        buffer.fill_(average)
    averager.steps[-1].set_result(Result(3))


def test_a_state_served_while_its_parameter_round_runs_names_the_round() -> None:
    driver, tracker, _, sharing, _ = make_driver()
    averager, buffers = with_real_parameter_rounds(driver)
    drifted_global_step(driver, tracker)
    assert sharing.published[-1] == (1, True) and sharing.averaging_rounds[-1] == 1
    land(averager, buffers, 3.0)
    driver.step(0, None)  # a safe point: the round lands
    assert all(torch.all(p == 3.0) for p in driver.inner.params)
    assert sharing.published[-1] == (1, False) and sharing.averaging_rounds[-1] is None


def test_a_parameter_round_without_a_group_serves_the_state_settled() -> None:
    driver, tracker, _, sharing, _ = make_driver()
    averager, buffers = with_real_parameter_rounds(driver)
    drifted_global_step(driver, tracker)
    land(averager, buffers, None)
    driver.step(0, None)
    assert sharing.published[-1] == (1, True) and sharing.averaging_rounds[-1] is None


@pytest.mark.parametrize(("searching", "rebased"), [(True, False), (True, True), (False, False)])
def test_a_due_parameter_round_replaces_an_older_one_still_looking_for_its_group(
    searching: bool, rebased: bool
) -> None:
    # The churn test's livelock (tests/netsim/test_churn.py): a joiner's lone round of epoch 3
    # searched until epoch 6, so it skipped the round of epoch 4 the three others held; they,
    # never complete (3 of 4 expected), went on at 6, 8, ... and the joiner, at 7, 11, ...,
    # always out of phase: its parameters stayed apart for good.
    driver, tracker, _, sharing, _ = make_driver()
    averager, buffers = with_real_parameter_rounds(driver)
    drifted_global_step(driver, tracker)  # epoch 1's round: nobody came yet
    if rebased:  # we loaded a state whose donor averages in that round
        state = {"epoch": 1, "averaging_round": 1}
        driver.landing.load(StateSnapshot.capture(1, state, digest=False), keep_accumulated=True)
        assert driver.state_round.rebased and not driver.life.drifted
        tracker.others_drift = True  # (so epoch 2's round is due)
    averager.is_looking_for_group = searching
    before = [p.detach().clone() for p in driver.inner.params]
    backward(driver)
    tracker.samples = 64
    driver.step(64, None)  # epoch 2: its round is due (still drifted)
    tracker.samples = 0
    assert driver.life.epoch == 2 and driver.state_round.running
    if searching:  # given up: epoch 2's round runs instead, nothing of epoch 1's lands
        assert averager.steps[0].cancelled() and averager.bits[-1] == group_bits(2)
        assert len(averager.steps) == 2 and driver.state_round.epoch == 2
        assert driver.life.drifted  # (rebased: that round moves its donor without us)
        assert tracker.drift_flags[-1]
        land(averager, buffers, 3.0)
        driver.step(0, None)
        for param in driver.inner.params:  # (3 - snapshot + snapshot: rounded)
            torch.testing.assert_close(param.detach(), torch.full_like(param, 3.0))
        assert not driver.life.drifted  # complete, with everyone: in sync again
    else:  # its group formed: it lands first, and epoch 2's round is skipped
        assert len(averager.steps) == 1 and not averager.steps[0].cancelled()
        land(averager, buffers, 3.0)
        driver.step(0, None)
        assert not driver.state_round.running
        moved = [p - b for p, b in zip(driver.inner.params, before, strict=True)]
        assert all(torch.all(m != 0) for m in moved)  # the delta of epoch 1's round landed


@pytest.mark.parametrize(
    ("donor_round", "our_round_averaged", "expected", "drifted"),
    [
        (1, True, 3.0, False),  # the donor averages in our round: we land where it does
        (None, True, 7.0, False),  # a settled state: our round is not applied to it
        (0, True, 7.0, True),  # the donor's round is another: we cannot follow it
        (1, False, 7.0, True),  # the donor's round, which failed for us
    ],
)
def test_a_state_loaded_while_a_parameter_round_runs_lands_where_its_donor_does(
    donor_round: int | None, our_round_averaged: bool, expected: float, drifted: bool
) -> None:
    # The churn test's failure (tests/optim/test_optimizer.py): a drifted late joiner and the
    # donors began the parameter round of epoch 13 together; the joiner's refresh landed the
    # donors' state of epoch 13, served just before their round moved it, and then the joiner's
    # round added its own delta (average - its drifted parameters) on top: it ended ~1e-3 from
    # the donors, flagged in sync, and served that to the next peer that fell behind.
    driver, tracker, _, sharing, _ = make_driver()
    averager, buffers = with_real_parameter_rounds(driver)
    drifted_global_step(driver, tracker)  # our parameters are 0.5 below the initial ones
    sharing.load_tensors = [torch.full_like(p, 7.0) for p in driver.inner.params]
    state = {"epoch": 1, "averaging_round": donor_round}
    driver.landing.load(StateSnapshot.capture(1, state, digest=False), keep_accumulated=True)
    assert driver.life.drifted is (donor_round == 0)
    land(averager, buffers, 3.0 if our_round_averaged else None)  # the donor lands on 3.0
    driver.step(0, None)
    assert all(torch.all(p == expected) for p in driver.inner.params)
    assert driver.life.drifted is drifted and not driver.state_round.running


def test_a_settled_state_loaded_after_following_a_round_is_not_drifted_by_it() -> None:
    driver, tracker, _, sharing, _ = make_driver()
    averager, buffers = with_real_parameter_rounds(driver)
    drifted_global_step(driver, tracker)
    sharing.load_tensors = [torch.full_like(p, 7.0) for p in driver.inner.params]
    pending = {"epoch": 1, "averaging_round": 1}
    driver.landing.load(StateSnapshot.capture(1, pending, digest=False), keep_accumulated=True)
    sharing.load_tensors = [torch.full_like(p, 5.0) for p in driver.inner.params]
    settled = {"epoch": 1, "averaging_round": None}
    driver.landing.load(StateSnapshot.capture(1, settled, digest=False), keep_accumulated=True)
    land(averager, buffers, None)  # our round found no group: the settled state stands
    driver.step(0, None)
    assert all(torch.all(p == 5.0) for p in driver.inner.params) and not driver.life.drifted


@pytest.mark.parametrize("delay", [False, True], ids=["now", "in-thread"])
def test_a_non_finite_average_skips_the_step_and_backs_the_scale_off(delay: bool) -> None:
    """Every member of a round holds the same average: an inf in it makes each skip that step
    alike (the epoch and the schedule move on), and back its loss scale off."""
    driver, tracker, rounds, _, _ = make_driver(
        delay=delay, delay_grad_averaging=delay, reuse_grad_buffers=False
    )
    before = [p.detach().clone() for p in driver.inner.params]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    scaler.scale(torch.ones(()))  # the scaler holds its scale from the first scale() on
    rounds.mean = [torch.full_like(p, float("inf")) for p in driver.inner.params]
    rounds.take_mean = lambda accumulated: None  # type: ignore[method-assign]
    backward(driver)
    tracker.samples = 64
    driver.step(64, scaler)
    scaler.update()
    driver.finish_optimizer_step(wait=5.0)
    assert driver.life.epoch == 1 and rounds.rounds == [(0, 64)]
    for old, new in zip(before, driver.inner.params, strict=True):
        assert torch.equal(old, new.detach())  # skipped
    assert scaler.get_scale() == 2.0**8  # backed off at the next step, as after an inf
    backward(driver)
    driver.step(1, scaler)
    scaler.update()
    assert scaler.get_scale() == 2.0**7
    driver.inner.shutdown()


def test_a_lone_peer_steps_without_a_round_and_stays_in_sync() -> None:
    driver, tracker, rounds, sharing, _ = make_driver()
    tracker.peers = 1
    before = [p.detach().clone() for p in driver.inner.params]

    def alone(epoch: int, samples: int, **options: Any) -> RoundOutcome:
        rounds.rounds.append((epoch, samples))
        return RoundOutcome(epoch, None, 1, exact=True, alone=True)

    rounds.average = alone  # type: ignore[method-assign]
    backward(driver)
    tracker.samples = 64
    driver.step(64, None)
    assert driver.life.epoch == 1 and driver.life.report is Report.LIVE
    assert driver.life.sync is Sync.IN_SYNC and sharing.calls == []  # no refresh, no drift
    for old, new in zip(before, driver.inner.params, strict=True):
        torch.testing.assert_close(new.detach(), old - 0.5)
