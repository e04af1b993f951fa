"""The epoch life of a kit.Optimizer peer (pure: events and ``now`` in, actions out)."""

from __future__ import annotations

import ast
import types
from pathlib import Path

import pytest

import kit.optim.epoch_actions as epoch_actions_module
import kit.optim.epochs as epochs_module
import kit.optim.splits as splits_module
from kit.optim.epoch_actions import (
    AddRefreshDelta,
    AverageGradients,
    CancelPrefetch,
    DropAccumulated,
    FlagDrift,
    Judgement,
    LoadRefresh,
    Publish,
    ReportProgress,
    StartRefresh,
    StepWithoutRound,
)
from kit.optim.epochs import (
    MAX_FAST_FORWARD,
    REFRESH_TRIES,
    EpochLife,
    Phase,
    Position,
    Refresh,
    Report,
    Sync,
)

HOLD = 7.0  # s a failed round's report stays held at most (the round's search time)
FULL = Judgement(averaged=True, identical=True, failed_or_partial=False, group_size=3)
PARTIAL = Judgement(averaged=True, identical=False, failed_or_partial=True, group_size=2)
FAILED = Judgement(averaged=False, identical=False, failed_or_partial=True, group_size=0)
LOSSY = Judgement(averaged=True, identical=False, failed_or_partial=False, group_size=3)


def joined_at(epoch: int) -> EpochLife:
    """A peer that downloaded the state of ``epoch`` (in sync, accumulating)."""
    life = EpochLife(prefetching=True)
    life.downloading_first()
    life.state_loaded(epoch, 0, keep_accumulated=False)
    return life


def stepped_at(epoch: int, samples: int = 32) -> EpochLife:
    """A joined peer whose blocking round of ``epoch`` went through, stepped, not judged yet."""
    life = joined_at(epoch)
    assert life.ready(epoch, samples, local_updates=False, background=False) == [
        AverageGradients(epoch, samples, background=False)
    ]
    assert (
        life.round_ended(0.0, averaged=True, global_epoch=epoch, samples=samples, hold_for=HOLD)
        == []
    )
    life.stepped()
    return life


def test_a_fresh_peer_is_joining_drifted_and_reports_live() -> None:
    life = EpochLife(prefetching=True)
    assert (life.phase, life.report, life.sync, life.refresh) == (
        Phase.JOINING,
        Report.LIVE,
        Sync.DRIFTED,
        Refresh.IDLE,
    )
    assert life.drifted and not life.joined and life.may_step() and life.epoch == 0


def test_the_position_of_a_step_against_the_collaboration() -> None:
    fresh = EpochLife()
    assert fresh.position(0, has_samples=False, local_updates=False) is Position.IN_EPOCH
    assert fresh.position(1, has_samples=True, local_updates=False) is Position.DOWNLOAD_FIRST
    life = joined_at(5)
    assert life.position(5, has_samples=True, local_updates=False) is Position.IN_EPOCH
    assert life.position(4, has_samples=True, local_updates=False) is Position.IN_EPOCH
    assert life.position(6, has_samples=True, local_updates=False) is Position.FAST_FORWARD
    far = 5 + MAX_FAST_FORWARD
    assert life.position(far, has_samples=True, local_updates=False) is Position.FAST_FORWARD
    assert life.position(far + 1, has_samples=True, local_updates=False) is Position.DOWNLOAD_FIRST
    # Local updates: one behind with samples, the others counted ours: step with them.
    assert life.position(6, has_samples=True, local_updates=True) is Position.STEP_WITH_THEM
    assert life.position(6, has_samples=False, local_updates=True) is Position.FAST_FORWARD
    assert life.position(7, has_samples=True, local_updates=True) is Position.FAST_FORWARD


def test_a_state_download_joins_the_collaboration_in_sync() -> None:
    life = EpochLife(prefetching=True)
    life.refresh = Refresh.IDLE
    assert life.downloading_first() == [] and not life.prefetching
    actions = life.state_loaded(12, 40, keep_accumulated=False)
    assert actions == [DropAccumulated(clear_grads=True), FlagDrift(False), Publish(12, 0)]
    assert (life.phase, life.sync, life.epoch, life.joined) == (
        Phase.ACCUMULATING,
        Sync.IN_SYNC,
        12,
        True,
    )
    # A state of our own epoch keeps what we accumulated toward it.
    assert life.state_loaded(12, 40, keep_accumulated=True) == [FlagDrift(False), Publish(12, 40)]


def test_the_first_global_step_cancels_the_prefetch_and_averages() -> None:
    life = EpochLife(prefetching=True)  # the first peer of a run: nothing to download
    actions = life.ready(0, 32, local_updates=False, background=False)
    assert actions == [CancelPrefetch(), AverageGradients(0, 32, background=False)]
    assert life.phase is Phase.IN_ROUND and not life.prefetching
    assert life.round_ended(1.0, averaged=True, global_epoch=0, samples=32, hold_for=HOLD) == []
    assert life.stepped() == [DropAccumulated(clear_grads=False), ReportProgress()]
    assert (life.phase, life.epoch, life.joined) == (Phase.STEPPED, 1, True)
    assert life.report_now(1.0, 0, step_running=True, others_at_held=0) == [Publish(1, 0)]
    # A full exact round with everyone leaves the drift flag as it was (only parameter rounds
    # and downloads clear it) and remembers the group for the next epoch's expectation.
    assert life.concluded(2.0, FULL, others=True, hold_for=HOLD) == []
    assert (life.phase, life.last_group_size, life.refresh) == (
        Phase.ACCUMULATING,
        3,
        Refresh.IDLE,
    )


def test_a_failed_round_holds_the_report_until_the_deadline() -> None:
    life = joined_at(4)
    life.ready(4, 32, local_updates=False, background=False)
    assert life.round_ended(10.0, averaged=False, global_epoch=4, samples=32, hold_for=HOLD) == []
    assert (life.report, life.held, life.hold_until) == (Report.HELD_AFTER_FAILURE, (4, 32), 17.0)
    life.stepped()  # on our own gradient
    assert life.epoch == 5 and not life.may_step()
    # Others still at epoch 4 may be looking for their group: they must not see us at 5.
    assert life.report_now(12.0, 8, step_running=False, others_at_held=2) == [Publish(4, 32)]
    assert life.report_now(12.0, 8, step_running=True, others_at_held=0) == [Publish(4, 32)]
    # Nobody else there any more: released, live from now on.
    assert life.report_now(12.0, 8, step_running=False, others_at_held=0) == [Publish(5, 8)]
    assert life.report is Report.LIVE and life.held is None and life.may_step()


def test_a_held_report_is_released_at_the_deadline() -> None:
    life = joined_at(4)
    life.ready(4, 32, local_updates=False, background=False)
    life.round_ended(10.0, averaged=False, global_epoch=4, samples=32, hold_for=HOLD)
    life.stepped()
    assert life.report_now(16.9, 0, step_running=False, others_at_held=1) == [Publish(4, 32)]
    assert life.report_now(17.0, 3, step_running=False, others_at_held=1) == [Publish(5, 3)]
    assert life.report is Report.LIVE


def test_a_failed_round_is_judged_drifted_refreshed_and_held_again_from_its_step() -> None:
    life = joined_at(4)
    life.ready(4, 32, local_updates=False, background=False)
    life.round_ended(10.0, averaged=False, global_epoch=4, samples=32, hold_for=HOLD)
    life.stepped()
    # The delayed optimizer step lands at 15 s: the hold runs from then.
    actions = life.concluded(15.0, FAILED, others=True, hold_for=HOLD)
    assert actions == [FlagDrift(True), StartRefresh(5)]
    assert (life.sync, life.refresh, life.refresh_epoch, life.refresh_tries) == (
        Sync.DRIFTED,
        Refresh.DOWNLOADING,
        5,
        0,
    )
    assert (life.report, life.hold_until, life.last_group_size) == (
        Report.HELD_AFTER_FAILURE,
        22.0,
        0,
    )


def test_a_failed_round_of_a_lone_peer_refreshes_nothing() -> None:
    life = stepped_at(4)
    assert life.concluded(1.0, FAILED, others=False, hold_for=HOLD) == [FlagDrift(True)]
    assert life.refresh is Refresh.IDLE


def test_a_partial_round_refreshes_unless_a_download_runs() -> None:
    life = stepped_at(4)
    assert life.concluded(1.0, PARTIAL, others=True, hold_for=HOLD) == [
        FlagDrift(True),
        StartRefresh(5),
    ]
    assert life.report is Report.LIVE  # averaged: nothing held
    life.ready(5, 32, local_updates=False, background=False)
    life.round_ended(2.0, averaged=True, global_epoch=5, samples=32, hold_for=HOLD)
    life.stepped()
    assert life.concluded(3.0, PARTIAL, others=True, hold_for=HOLD) == [FlagDrift(True)]
    assert life.refresh_epoch == 5  # the download under way is kept


def test_a_lossy_round_marks_drift_without_a_refresh() -> None:
    life = stepped_at(4)
    life.parameters_averaged(complete=True, local_updates=False)
    assert life.concluded(1.0, LOSSY, others=True, hold_for=HOLD) == [FlagDrift(True)]
    assert life.refresh is Refresh.IDLE and life.drifted


def test_a_round_that_failed_after_the_others_moved_on_fast_forwards() -> None:
    life = joined_at(4)
    life.refresh = Refresh.IDLE
    life.ready(4, 32, local_updates=False, background=False)
    actions = life.round_ended(10.0, averaged=False, global_epoch=6, samples=32, hold_for=HOLD)
    assert actions == [DropAccumulated(), FlagDrift(True), Publish(6, 0), StartRefresh(6)]
    assert (life.phase, life.epoch, life.report, life.refresh) == (
        Phase.ACCUMULATING,
        6,
        Report.LIVE,
        Refresh.DOWNLOADING,
    )
    # A first peer (never in step with anyone) holds instead: it has no epoch to join.
    first = EpochLife()
    first.ready(0, 32, local_updates=False, background=False)
    assert first.round_ended(1.0, averaged=False, global_epoch=1, samples=32, hold_for=HOLD) == []
    assert first.report is Report.HELD_AFTER_FAILURE


def test_ready_after_the_others_took_the_step_joins_their_epoch() -> None:
    life = joined_at(4)
    actions = life.ready(5, 32, local_updates=False, background=False)
    assert actions == [DropAccumulated(), FlagDrift(True), Publish(5, 0), StartRefresh(5)]
    assert (life.phase, life.epoch) == (Phase.ACCUMULATING, 5)
    # A download under way already brings a newer state: no second one; a prefetch is cancelled.
    life = EpochLife(prefetching=True)
    life.state_loaded(4, 0, keep_accumulated=False)
    life.refresh = Refresh.DOWNLOADING
    actions = life.ready(5, 32, local_updates=False, background=False)
    assert actions == [CancelPrefetch(), DropAccumulated(), FlagDrift(True), Publish(5, 0)]


def test_a_background_round_holds_the_report_while_it_runs() -> None:
    life = joined_at(4)
    actions = life.ready(4, 32, local_updates=False, background=True)
    assert actions == [AverageGradients(4, 32, background=True)]
    assert (life.phase, life.report, life.held) == (Phase.IN_ROUND, Report.HELD_IN_ROUND, (4, 32))
    assert life.round_began_in_background() == [DropAccumulated(clear_grads=True), ReportProgress()]
    assert life.epoch == 5 and not life.may_step()
    assert life.report_now(1.0, 16, step_running=True, others_at_held=0) == [Publish(4, 32)]
    assert life.position(5, has_samples=True, local_updates=False) is Position.IN_EPOCH
    # It went through: judged at the safe point, the next report is live.
    assert life.concluded(2.0, FULL, others=True, hold_for=HOLD) == []
    assert life.phase is Phase.ACCUMULATING
    assert life.report_now(2.0, 48, step_running=False, others_at_held=3) == [Publish(5, 48)]
    assert life.may_step()


def test_a_failed_background_round_holds_the_report_until_the_deadline() -> None:
    life = joined_at(4)
    life.ready(4, 32, local_updates=False, background=True)
    life.round_began_in_background()
    assert life.concluded(20.0, FAILED, others=True, hold_for=HOLD) == [
        FlagDrift(True),
        StartRefresh(5),
    ]
    assert (life.report, life.hold_until) == (Report.HELD_AFTER_FAILURE, 27.0)
    assert life.report_now(26.0, 8, step_running=False, others_at_held=1) == [Publish(4, 32)]
    assert life.report_now(27.5, 8, step_running=False, others_at_held=1) == [Publish(5, 8)]


def test_a_held_report_is_dropped_by_a_fast_forward() -> None:
    life = joined_at(4)
    life.ready(4, 32, local_updates=False, background=False)
    life.round_ended(10.0, averaged=False, global_epoch=4, samples=32, hold_for=HOLD)
    life.stepped()
    life.concluded(11.0, FAILED, others=False, hold_for=HOLD)
    actions = life.fast_forward(9)
    assert actions == [DropAccumulated(), FlagDrift(True), Publish(9, 0), StartRefresh(9)]
    assert life.report is Report.LIVE and life.held is None
    assert life.report_now(12.0, 0, step_running=False, others_at_held=5) == [Publish(9, 0)]


def test_a_step_without_samples_marks_drift_and_steps_the_scheduler() -> None:
    life = joined_at(4)
    life.parameters_averaged(complete=True, local_updates=False)
    actions = life.ready(4, 0, local_updates=False, background=False)
    assert actions == [
        FlagDrift(True),
        DropAccumulated(clear_grads=False),
        ReportProgress(),
        StepWithoutRound(),
    ]
    assert (life.phase, life.epoch) == (Phase.STEPPED, 5)
    assert life.concluded(1.0, None, others=True, hold_for=HOLD) == []
    assert life.phase is Phase.ACCUMULATING and life.drifted


def test_local_updates_step_without_a_gradient_round_even_one_epoch_behind() -> None:
    life = joined_at(4)
    actions = life.ready(5, 32, local_updates=True, background=False)
    assert actions == [DropAccumulated(clear_grads=False), ReportProgress(), StepWithoutRound()]
    assert (life.phase, life.epoch, life.sync) == (Phase.STEPPED, 5, Sync.IN_SYNC)
    life.concluded(1.0, None, others=True, hold_for=HOLD)
    # Parameters differ by design: a complete parameter round does not clear anything.
    life.drifted_by()
    assert life.parameters_averaged(complete=True, local_updates=True) == []
    assert life.drifted


def test_parameter_rounds_clear_drift_only_when_complete() -> None:
    life = EpochLife()
    assert life.parameters_averaged(complete=False, local_updates=False) == []
    assert life.drifted
    assert life.parameters_averaged(complete=True, local_updates=False) == [FlagDrift(False)]
    assert life.sync is Sync.IN_SYNC
    assert life.drifted_by() == [FlagDrift(True)]  # a rolled-back step


def test_a_parameter_round_clears_no_drift_marked_after_it_began() -> None:
    life = EpochLife()
    life.parameter_round_began()
    life.drifted_by()  # e.g. a rolled-back step while the (delayed) round ran
    assert life.parameters_averaged(complete=True, local_updates=False) == []
    assert life.drifted
    life.parameter_round_began()  # the next round averages the parameters with that step in
    assert life.parameters_averaged(complete=True, local_updates=False) == [FlagDrift(False)]
    assert not life.drifted


def test_a_checkpoint_sets_the_epoch_and_drift() -> None:
    life = joined_at(4)
    assert life.checkpoint_loaded(40) == [FlagDrift(True)]
    assert (life.epoch, life.sync) == (40, Sync.DRIFTED)


@pytest.mark.parametrize(
    ("landed", "actions", "sync"),
    [
        (None, [], Sync.DRIFTED),  # none in time, or failed: averaging removes the drift
        (9, [LoadRefresh(keep_accumulated=True)], Sync.DRIFTED),  # then state_loaded clears it
        (11, [LoadRefresh(keep_accumulated=False)], Sync.DRIFTED),
        (7, [AddRefreshDelta(), StartRefresh(9)], Sync.DRIFTED),  # we stepped on meanwhile
        (6, [StartRefresh(9)], Sync.DRIFTED),  # older than what we asked for: fetch again
    ],
)
def test_a_refresh_lands_as_a_load_a_delta_or_a_retry(
    landed: int | None, actions: list[object], sync: Sync
) -> None:
    life = joined_at(7)
    life.ready(8, 32, local_updates=False, background=False)  # fast-forward: refresh from 8
    assert (life.refresh, life.refresh_epoch) == (Refresh.DOWNLOADING, 8)
    life.refresh_epoch = 7  # as if it began at 7 and we stepped twice since
    life.epoch = 9
    assert life.refresh_landed(landed) == actions
    assert life.sync is sync
    assert life.refresh is (Refresh.DOWNLOADING if StartRefresh(9) in actions else Refresh.IDLE)


def test_a_refresh_is_retried_a_bounded_number_of_times() -> None:
    life = joined_at(3)
    life.fast_forward(5)
    tries = 1
    while life.refresh_landed(4):  # always a step late
        tries += 1
        assert life.refresh is Refresh.DOWNLOADING and tries <= REFRESH_TRIES
    assert tries == REFRESH_TRIES and life.refresh is Refresh.IDLE and life.drifted


def test_downloading_first_cancels_a_refresh() -> None:
    life = joined_at(3)
    life.fast_forward(5)
    life.downloading_first()
    assert life.refresh is Refresh.IDLE
    life.state_loaded(30, 0, keep_accumulated=False)
    assert (life.epoch, life.sync) == (30, Sync.IN_SYNC)


def test_the_epoch_set_by_the_user_changes_nothing_else() -> None:
    life = joined_at(4)
    life.epoch_set(9)
    assert (life.epoch, life.phase, life.sync, life.joined) == (
        9,
        Phase.ACCUMULATING,
        Sync.IN_SYNC,
        True,
    )


def test_an_auxiliary_peer_follows_the_epoch() -> None:
    life = EpochLife()
    life.auxiliary_saw(5, joined_round=False)
    assert life.epoch == 5
    life.auxiliary_saw(5, joined_round=True)
    assert life.epoch == 6
    life.auxiliary_saw(3, joined_round=False)
    assert life.epoch == 6


@pytest.mark.parametrize(
    "misuse",
    [
        lambda life: life.stepped(),  # no round
        lambda life: life.concluded(0.0, None, others=False, hold_for=HOLD),  # nothing stepped
        lambda life: life.round_began_in_background(),
        lambda life: life.refresh_landed(3),  # no download
        lambda life: (
            life.ready(0, 1, local_updates=False, background=False),
            life.ready(0, 1, local_updates=False, background=False),
        ),
    ],
)
def test_an_event_out_of_order_is_a_bug_of_the_driver(misuse: object) -> None:
    with pytest.raises(AssertionError):
        misuse(EpochLife())  # type: ignore[operator]


def test_a_state_cannot_load_while_a_step_is_in_flight() -> None:
    life = stepped_at(2)
    with pytest.raises(AssertionError, match="state loaded while stepped"):
        life.state_loaded(3, 0, keep_accumulated=False)
    with pytest.raises(AssertionError, match="fast forward while stepped"):
        life.fast_forward(5)


class Recorded(EpochLife):
    """Records every (state, event) pair the transition tables are asked for."""

    taken: set[tuple[object, object]] = set()

    def _go(self, event: epochs_module.Event) -> None:
        self.taken.add((self.phase, event))
        super()._go(event)

    def _report(self, event: epochs_module.Event) -> None:
        self.taken.add((self.report, event))
        super()._report(event)

    def _refresh(self, event: epochs_module.Event) -> None:
        self.taken.add((self.refresh, event))
        super()._refresh(event)


def test_a_tour_takes_every_transition_of_the_tables() -> None:
    """Every entry of the tables is reachable through the events (no dead design)."""
    life = Recorded(prefetching=True)
    life.ready(0, 32, local_updates=False, background=False)  # JOINING -> READY -> IN_ROUND
    life.round_ended(0.0, averaged=False, global_epoch=0, samples=32, hold_for=HOLD)  # hold
    life.stepped()  # IN_ROUND -> STEPPED
    life.concluded(1.0, FAILED, others=True, hold_for=HOLD)  # held again; refresh starts
    life.report_now(99.0, 0, step_running=False, others_at_held=0)  # released
    life.refresh_landed(None)  # DOWNLOADING -> IDLE
    life.ready(1, 32, local_updates=False, background=True)  # ACCUMULATING -> READY, HOLD
    life.round_began_in_background()
    life.concluded(2.0, FULL, others=False, hold_for=HOLD)  # IN_ROUND -> ACCUMULATING
    life.report_now(2.0, 0, step_running=False, others_at_held=0)  # HELD_IN_ROUND released
    life.ready(2, 32, local_updates=False, background=True)
    life.round_began_in_background()
    life.concluded(2.0, FAILED, others=False, hold_for=HOLD)  # HELD_IN_ROUND -> AFTER_FAILURE
    life.ready(3, 0, local_updates=False, background=False)  # no samples: step without round
    life.concluded(3.0, None, others=False, hold_for=HOLD)
    life.fast_forward(5)  # ACCUMULATING -> ACCUMULATING, refresh starts
    life.downloading_first()  # refresh cancelled; IDLE -> IDLE below
    life.downloading_first()
    life.state_loaded(6, 0, keep_accumulated=False)  # ACCUMULATING -> ACCUMULATING
    life.ready(7, 32, local_updates=False, background=False)  # READY -> fast-forward
    life.ready(7, 32, local_updates=False, background=False)
    life.round_ended(4.0, averaged=False, global_epoch=9, samples=32, hold_for=HOLD)  # IN_ROUND ->
    life.fast_forward(10)  # refresh under way: kept
    life.refresh_landed(3)  # retried: IDLE -> DOWNLOADING again
    life.refresh_landed(10)
    fresh = Recorded()
    fresh.state_loaded(1, 0, keep_accumulated=False)  # JOINING -> ACCUMULATING
    tables = {**epochs_module.PHASES, **epochs_module.REPORTS, **epochs_module.REFRESHES}
    assert set(tables) - Recorded.taken == set()
    sources = {phase for phase, _ in epochs_module.PHASES}
    assert sources | set(epochs_module.PHASES.values()) == set(Phase)


@pytest.mark.parametrize("module", [epochs_module, epoch_actions_module, splits_module])
def test_the_core_does_no_io_and_reads_no_clock(module: types.ModuleType) -> None:
    tree = ast.parse(Path(str(module.__file__)).read_text())
    imported = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported <= {
        "__future__",
        "collections.abc",
        "dataclasses",
        "enum",
        "kit.optim.epoch_actions",
    }


def test_a_lost_split_flags_drift_and_copies_the_winners_even_on_retries() -> None:
    life = joined_at(5)
    donors = frozenset({b"p1", b"p2"})
    assert life.lost_split(donors) == [FlagDrift(True), StartRefresh(5, donors)]
    assert life.refresh is Refresh.DOWNLOADING and life.drifted
    with pytest.raises(AssertionError):
        life.lost_split(donors)  # the driver waits for the download under way
    life.epoch = 6  # we stepped on while it travelled: a delta, then again from them
    assert life.refresh_landed(5) == [AddRefreshDelta(), StartRefresh(6, donors)]
    assert life.refresh_landed(6) == [LoadRefresh(keep_accumulated=True)]
    actions = life.fast_forward(9)  # a later catch-up, for another reason: from anyone
    assert StartRefresh(9) in actions and life.refresh_donors is None
