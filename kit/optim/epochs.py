"""The epoch life of one ``kit.Optimizer`` peer, as a pure state machine.

Holds :class:`EpochLife`: where this peer is in the collaboration's epochs, and what it does next.
Like the protocol cores of h11 and python-websockets it does no I/O: it takes events (with
``now`` where time matters) and returns actions for the optimizer's drivers to carry out (the
tracker publishes reports and drift flags, the gradient averager runs rounds, the state download
refreshes parameters). It reads no clock, touches no tensor and imports no torch, so every
transition is unit-tested in microseconds (tests/optim/test_epochs.py). It does not hold the
averaging itself (``kit.optim.rounds``), the state download (``kit.optim.sharing``) nor the
tensors (``kit.optim.optimizer``).

Four small machines, each an enum and a transition table (an event not in a table is a bug of
the driver and raises ``AssertionError``):

* :class:`Phase`, the epoch's life: JOINING (no state loaded, no global step taken) or
  ACCUMULATING samples toward ``epoch``; READY when the collaboration has the target batch;
  IN_ROUND while the gradient round runs (in the background with ``delay_grad_averaging``:
  the peer already accumulates toward the next epoch meanwhile); STEPPED once the optimizer
  stepped (or steps in its thread) until the round is judged at the next safe point.
* :class:`Report`, what the others see: LIVE progress, or a report HELD_IN_ROUND (the round's
  epoch and samples while it runs: a peer seen at the next epoch tells the others the round is
  over, and they would leave it), then HELD_AFTER_FAILURE until a deadline (others may still be
  looking for their group at that epoch; bounded by the time a round may search).
* :class:`Sync`, the drift flag published with the progress: IN_SYNC, or DRIFTED (a failed,
  partial or lossy round, a missed epoch, a checkpoint or rollback): parameter averaging is then
  due (``kit.optim.state_averaging``).
* :class:`Refresh`, a background download of the collaboration's state: IDLE or DOWNLOADING,
  started after a failed or partial round or a fast-forward (the peer fell behind and joined
  the current epoch at once); it lands as a load (a state of our epoch or newer) or as a delta
  (we stepped on meanwhile: ``kit.optim.sharing``), then is fetched again, up to
  :data:`REFRESH_TRIES` downloads, for an exact copy.
"""

from __future__ import annotations

import enum

from kit.optim.epoch_actions import (
    Action,
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

MAX_FAST_FORWARD = 16  # further behind than this many epochs, a peer downloads the state first
REFRESH_TRIES = 5  # downloads trying to land on our epoch exactly, before leaving it to averaging


class Phase(enum.Enum):
    JOINING = "joining"
    ACCUMULATING = "accumulating"
    READY = "ready"
    IN_ROUND = "in a round"
    STEPPED = "stepped"


class Report(enum.Enum):
    LIVE = "live"
    HELD_IN_ROUND = "held in round"
    HELD_AFTER_FAILURE = "held after failure"


class Sync(enum.Enum):
    IN_SYNC = "in sync"
    DRIFTED = "drifted"


class Refresh(enum.Enum):
    IDLE = "idle"
    DOWNLOADING = "downloading"


class Event(enum.Enum):
    STATE_LOADED = "state loaded"
    READY = "ready"
    ROUND_BEGAN = "round began"
    STEP_WITHOUT_ROUND = "step without round"
    STEPPED = "stepped"
    CONCLUDED = "concluded"
    FAST_FORWARD = "fast forward"
    HOLD = "hold"
    ROUND_FAILED = "round failed"
    RELEASE = "release"
    MARK_DRIFTED = "mark drifted"
    CLEAR_DRIFT = "clear drift"
    START = "start"
    LANDED = "landed"
    CANCEL = "cancel"


P, R, S, F, E = Phase, Report, Sync, Refresh, Event

PHASES: dict[tuple[Phase, Event], Phase] = {
    (P.JOINING, E.STATE_LOADED): P.ACCUMULATING,
    (P.ACCUMULATING, E.STATE_LOADED): P.ACCUMULATING,
    (P.JOINING, E.READY): P.READY,
    (P.ACCUMULATING, E.READY): P.READY,
    (P.READY, E.ROUND_BEGAN): P.IN_ROUND,
    (P.READY, E.STEP_WITHOUT_ROUND): P.STEPPED,
    (P.READY, E.FAST_FORWARD): P.ACCUMULATING,  # the others took this step without us
    (P.IN_ROUND, E.FAST_FORWARD): P.ACCUMULATING,  # our round failed after they moved on
    (P.IN_ROUND, E.STEPPED): P.STEPPED,
    (P.IN_ROUND, E.CONCLUDED): P.ACCUMULATING,  # a background round and its step landed
    (P.STEPPED, E.CONCLUDED): P.ACCUMULATING,
    (P.ACCUMULATING, E.FAST_FORWARD): P.ACCUMULATING,
}
REPORTS: dict[tuple[Report, Event], Report] = {
    (R.LIVE, E.HOLD): R.HELD_IN_ROUND,
    (R.LIVE, E.ROUND_FAILED): R.HELD_AFTER_FAILURE,
    (R.HELD_IN_ROUND, E.ROUND_FAILED): R.HELD_AFTER_FAILURE,
    (R.HELD_AFTER_FAILURE, E.ROUND_FAILED): R.HELD_AFTER_FAILURE,  # its step landed: from now
    **{(report, E.RELEASE): R.LIVE for report in Report},
}
SYNCS: dict[tuple[Sync, Event], Sync] = {
    **{(sync, E.MARK_DRIFTED): S.DRIFTED for sync in Sync},
    **{(sync, E.CLEAR_DRIFT): S.IN_SYNC for sync in Sync},
}
REFRESHES: dict[tuple[Refresh, Event], Refresh] = {
    (F.IDLE, E.START): F.DOWNLOADING,
    (F.DOWNLOADING, E.LANDED): F.IDLE,
    (F.DOWNLOADING, E.CANCEL): F.IDLE,
    (F.IDLE, E.CANCEL): F.IDLE,
}


class Position(enum.Enum):
    """Where a step begins, against the collaboration's epoch (:meth:`EpochLife.position`)."""

    IN_EPOCH = "in epoch"  # accumulate toward our epoch
    STEP_WITH_THEM = "step with them"  # local updates: the others counted our samples, step too
    DOWNLOAD_FIRST = "download first"  # a fresh peer, or too far behind: load the state, then go on
    FAST_FORWARD = "fast forward"  # a few epochs behind: join the current one, refresh meanwhile


class EpochLife:
    """One peer's epochs (see the module). Read its fields; change them only by events.

    Args:
        epoch: the epoch to start at (a checkpoint's, else 0).
        prefetching: a state download was started while the optimizer was built.
    """

    def __init__(self, epoch: int = 0, *, prefetching: bool = False) -> None:
        self.epoch = epoch
        self.joined = False  # loaded a state or took a global step with the others
        self.phase = Phase.JOINING
        self.report = Report.LIVE
        # A fresh peer's parameters match nobody's (random init, or a checkpoint): drifted until
        # a state download or a complete parameter round says otherwise.
        self.sync = Sync.DRIFTED
        self.refresh = Refresh.IDLE
        self.prefetching = prefetching
        self.held: tuple[int, int] | None = None  # (epoch, samples) the others see meanwhile
        self.hold_until = 0.0  # HELD_AFTER_FAILURE: at most until then (the driver's clock)
        self.round_epoch = -1  # of the round in IN_ROUND / STEPPED
        self.last_group_size = 0  # of the last gradient round (0: none, or it failed)
        self.refresh_epoch = 0  # our epoch when the refresh download began
        self.refresh_tries = 0  # downloads since we fell behind
        self.refresh_donors: frozenset[bytes] | None = None  # whom the refresh copies (None: any)
        self.drift_marks = 0  # times drift was marked (a parameter round clears only older ones)
        self.marks_at_parameter_round = 0  # drift_marks when the running parameter round began

    @property
    def drifted(self) -> bool:
        return self.sync is Sync.DRIFTED

    def _go(self, event: Event) -> None:
        phase = PHASES.get((self.phase, event))
        if phase is None:  # raised, not asserted: python -O must not let it pass
            raise AssertionError(f"{event.value} while {self.phase.value}")
        self.phase = phase

    def _report(self, event: Event) -> None:
        report = REPORTS.get((self.report, event))
        if report is None:
            raise AssertionError(f"{event.value} while {self.report.value}")
        self.report = report
        if report is Report.LIVE:
            self.held, self.hold_until = None, 0.0

    def _sync(self, event: Event) -> list[Action]:
        self.sync = SYNCS[(self.sync, event)]
        if event is Event.MARK_DRIFTED:
            self.drift_marks += 1
        return [FlagDrift(self.drifted)]

    def _refresh(self, event: Event) -> None:
        refresh = REFRESHES.get((self.refresh, event))
        if refresh is None:
            raise AssertionError(f"refresh {event.value} while {self.refresh.value}")
        self.refresh = refresh

    def _begin_refresh(self, donors: frozenset[bytes] | None = None) -> list[Action]:
        """A new catch-up: up to REFRESH_TRIES downloads, from ``donors`` (None: any)."""
        self.refresh_tries = 0
        self.refresh_donors = donors
        return self._start_refresh()

    def _start_refresh(self) -> list[Action]:
        self._refresh(Event.START)
        self.refresh_epoch = self.epoch
        # A state of our epoch at least: right after our round failed, the others may still be
        # in theirs, advertising the previous epoch's state, which would be of no use.
        return [StartRefresh(self.epoch, self.refresh_donors)]

    def _cancel_prefetch(self) -> list[Action]:
        if not self.prefetching:
            return []
        self.prefetching = False
        return [CancelPrefetch()]

    # --- events of a step ---------------------------------------------------------------------

    def position(self, global_epoch: int, *, has_samples: bool, local_updates: bool) -> Position:
        """Where a step begins (pure query: changes nothing)."""
        behind = global_epoch - self.epoch
        if behind == 1 and local_updates and has_samples:
            # Local updates: a peer that took the step a moment before us counted our samples
            # (it reports the next epoch at once, before its parameter round). There is no
            # gradient round to miss: take the step too, so our parameter round meets theirs.
            return Position.STEP_WITH_THEM
        if behind > 0 and (not self.joined or behind > MAX_FAST_FORWARD):
            return Position.DOWNLOAD_FIRST
        if behind > 0:
            return Position.FAST_FORWARD
        return Position.IN_EPOCH

    def may_step(self) -> bool:
        """No report held: a step taken now would not tell the others a running round is over."""
        return self.report is Report.LIVE

    def ready(
        self, global_epoch: int, samples: int, *, local_updates: bool, background: bool
    ) -> list[Action]:
        """The collaboration has the target batch for our epoch (the drivers finished any
        optimizer step in flight first: one at a time)."""
        self._go(Event.READY)
        actions = self._cancel_prefetch()  # in step with the others: a prefetched state is moot
        if global_epoch > self.epoch and self.joined and not local_updates:
            # The others already took this step without us (our view of their progress lagged):
            # a round tagged with our epoch would find nobody. Join the current epoch instead.
            # (With local updates the step is ours to take; our parameter round meets theirs.)
            return actions + self.fast_forward(global_epoch)
        self.round_epoch = self.epoch
        if local_updates:  # parameters are averaged by the state round after the step
            self._go(Event.STEP_WITHOUT_ROUND)
            return [*actions, *self._next_epoch(clear_grads=False), StepWithoutRound()]
        if samples > 0:
            self._go(Event.ROUND_BEGAN)
            if background:
                # Until the round is over the others must still see us at its epoch: a peer at
                # the next one tells them the round is done, and one still looking gives up.
                self._report(Event.HOLD)
                self.held, self.hold_until = (self.epoch, samples), 0.0
                return [*actions, AverageGradients(self.epoch, samples, background=True)]
            return [*actions, AverageGradients(self.epoch, samples, background=False)]
        self._go(Event.STEP_WITHOUT_ROUND)  # no samples: the others step without us
        actions += self._sync(Event.MARK_DRIFTED)
        return [*actions, *self._next_epoch(clear_grads=False), StepWithoutRound()]

    def round_began_in_background(self) -> list[Action]:
        """The background round (and its step) is submitted: accumulate toward the next epoch."""
        assert self.phase is Phase.IN_ROUND and self.report is Report.HELD_IN_ROUND
        return self._next_epoch(clear_grads=True)  # .grad is ours again: the mean is taken

    def round_ended(
        self, now: float, *, averaged: bool, global_epoch: int, samples: int, hold_for: float
    ) -> list[Action]:
        """The (blocking) round of our epoch ended; ``hold_for``: how long a round may search.

        Returns [] to step with the round's gradient (then :meth:`stepped`), or the actions of
        a fast-forward when it failed after the others moved on (nothing to step then).
        """
        assert self.phase is Phase.IN_ROUND
        if not averaged and global_epoch > self.epoch and self.joined:
            return self.fast_forward(global_epoch)  # our samples came too late for that step
        if not averaged:
            # We step on our own gradient, but others may still be in this epoch's round:
            # seeing us at the next epoch, they would take the round for finished and leave it.
            # Stay at this epoch in their view until they are done.
            self._report(Event.ROUND_FAILED)
            self.held, self.hold_until = (self.epoch, samples), now + hold_for
        return []

    def stepped(self) -> list[Action]:
        """The optimizer has the round's gradient and steps: count toward the next epoch."""
        self._go(Event.STEPPED)
        return self._next_epoch(clear_grads=False)

    def _next_epoch(self, *, clear_grads: bool) -> list[Action]:
        self.epoch = self.round_epoch + 1
        self.joined = True
        return [DropAccumulated(clear_grads), ReportProgress()]

    def concluded(
        self, now: float, judgement: Judgement | None, *, others: bool, hold_for: float
    ) -> list[Action]:
        """At the safe point after the step landed: judge its round (None: it had none).

        ``others``: the tracker sees other peers (a refresh has someone to download from).
        """
        self._go(Event.CONCLUDED)
        if judgement is None:
            return []
        actions: list[Action] = []
        if not judgement.averaged and self.report is not Report.LIVE:
            self._report(Event.ROUND_FAILED)
            self.hold_until = now + hold_for  # see round_ended
        if not judgement.identical:
            actions += self._sync(Event.MARK_DRIFTED)
        self.last_group_size = judgement.group_size
        # A round that failed or stayed partial while we keep our epoch leaves us with other
        # gradients than the rest, so our optimizer statistics (Adam's moments) differ too, and
        # parameter averaging alone would let the parameters drift apart again at every step
        # (seen in tests/netsim/test_churn.py). Fetch an exact copy of the state of the peers
        # whose round went through, in the background. (A full round with fewer peers than
        # expected left its members identical to each other: the missing peer is the one to
        # refresh; drift flags bring parameter averaging for the rest.)
        if judgement.failed_or_partial and others and self.refresh is Refresh.IDLE:
            actions += self._begin_refresh()
        return actions

    def report_now(
        self, now: float, samples: int, *, step_running: bool, others_at_held: int
    ) -> list[Action]:
        """Publish our progress, or the held report while its round (or step) runs, or after it
        failed while other peers are still at its epoch, until the deadline.

        ``others_at_held``: other training peers the tracker sees at the held report's epoch.
        """
        held = self.held
        failed_round_searching = (
            self.report is Report.HELD_AFTER_FAILURE
            and now < self.hold_until
            and others_at_held > 0
        )
        # (not after a fast-forward: the held epoch is then far behind ours)
        if (
            held is not None
            and held[0] == self.epoch - 1
            and (step_running or failed_round_searching)
        ):
            return [Publish(*held)]
        self._report(Event.RELEASE)
        return [Publish(self.epoch, samples)]

    def fast_forward(self, global_epoch: int) -> list[Action]:
        """Behind the others (our round failed, or a downloaded state was overtaken while it
        travelled): join their epoch at once, drop what we accumulated for a batch already
        applied, and refresh the state in the background (the drivers finished any step)."""
        self._go(Event.FAST_FORWARD)
        self._report(Event.RELEASE)
        self.epoch = global_epoch
        actions: list[Action] = [DropAccumulated(), *self._sync(Event.MARK_DRIFTED)]
        actions += [Publish(global_epoch, 0), *self._cancel_prefetch()]
        if self.refresh is Refresh.IDLE:  # else the download under way brings a newer state
            actions += self._begin_refresh()
        return actions

    # --- events of the state ----------------------------------------------------------------

    def state_loaded(self, epoch: int, samples: int, *, keep_accumulated: bool) -> list[Action]:
        """A state of ``epoch`` was loaded (downloaded, or ours rolled back); ``samples``: what
        we accumulated (kept only if ``keep_accumulated``: a state of our own epoch)."""
        self._go(Event.STATE_LOADED)
        self.epoch = epoch
        self.joined = True
        actions: list[Action] = [] if keep_accumulated else [DropAccumulated(clear_grads=True)]
        actions += self._sync(Event.CLEAR_DRIFT)
        return [*actions, Publish(epoch, samples if keep_accumulated else 0)]

    def downloading_first(self) -> list[Action]:
        """``load_state_from_peers``: a background refresh is moot (the prefetch is taken)."""
        self.prefetching = False
        self._refresh(Event.CANCEL)
        return []

    def refresh_landed(self, snapshot_epoch: int | None) -> list[Action]:
        """The background download ended with a state of ``snapshot_epoch`` (None: none was
        found in time, or it failed: parameter averaging removes the drift then)."""
        self._refresh(Event.LANDED)
        if snapshot_epoch is None:
            return []
        if snapshot_epoch >= self.epoch:  # then state_loaded
            return [LoadRefresh(keep_accumulated=snapshot_epoch == self.epoch)]
        actions: list[Action] = []
        if snapshot_epoch == self.refresh_epoch:
            # We stepped on while it travelled: keep those steps (the same averaged gradients
            # as everyone's) on top of the state, the delta rule as for parameter averaging.
            # Optimizer statistics stay ours; the drift flag keeps asking for parameter averaging.
            actions.append(AddRefreshDelta())
        # Fetch again, for an exact copy (statistics included) of our epoch: epochs may be
        # shorter than a download, a few tries land on one; after that, averaging does the rest.
        self.refresh_tries += 1
        if self.refresh_tries < REFRESH_TRIES:
            actions += self._start_refresh()
        return actions

    def lost_split(self, donors: frozenset[bytes]) -> list[Action]:
        """Our gradient round of a recent epoch was one of several groups, not the one everyone
        follows (``kit.optim.splits``): flag drift and copy the state of ``donors``, its peers
        (call it while no refresh runs: one under way may bring another group's state)."""
        if self.refresh is not Refresh.IDLE:
            raise AssertionError("lost_split while a refresh runs")
        return [*self._sync(Event.MARK_DRIFTED), *self._begin_refresh(donors)]

    def drifted_by(self) -> list[Action]:
        """Our parameters may differ from the others' (a checkpoint loaded, a step rolled back)."""
        return self._sync(Event.MARK_DRIFTED)

    def parameter_round_began(self) -> None:
        """A parameter round began: it averages the parameters we hold now."""
        self.marks_at_parameter_round = self.drift_marks

    def parameters_averaged(self, *, complete: bool, local_updates: bool) -> list[Action]:
        """A parameter round ended; ``complete``: full, with every peer we expected.

        It clears the drift only if nothing drifted since it began: it averaged the parameters
        of then, and a later failed round or rollback (delay_state_averaging: the round runs for
        epochs) is in ours on top of the average (the delta rule), not in anyone else's.
        """
        later_drift = self.drift_marks != self.marks_at_parameter_round
        if complete and not local_updates and not later_drift:
            return self._sync(Event.CLEAR_DRIFT)
        return []

    def checkpoint_loaded(self, epoch: int) -> list[Action]:
        """``load_state_dict``: a checkpoint need not match the collaboration."""
        self.epoch = epoch
        return self._sync(Event.MARK_DRIFTED)

    def epoch_set(self, epoch: int) -> None:
        """The user set ``local_epoch`` (writable, as hivemind's): nothing else changes."""
        self.epoch = epoch

    def auxiliary_saw(self, global_epoch: int, *, joined_round: bool) -> None:
        """An auxiliary peer follows the others' epoch (past it once it joined their round)."""
        self.epoch = max(self.epoch, global_epoch + 1 if joined_round else global_epoch)
