"""The driver of ``kit.Optimizer``'s epochs: it feeds the epoch machine and carries out its actions.

Holds :class:`EpochDriver`. The decisions (when to average, hold a report, fast-forward, refresh,
flag drift) are the pure machine's (``kit.optim.epochs``); this module gives it events with the
clock's ``now`` and the tracker's view, and acts with the optimizer's parts: the accumulator
(``kit.optim.accumulation``), the gradient rounds (``kit.optim.rounds``), the inner optimizer
(``kit.optim.stepping``), parameter rounds (``kit.optim.state_averaging``) and state sharing
(``kit.optim.sharing``, through its :class:`~kit.optim.landing.StateLanding`: where a state lands).
It does not hold the public API (``kit.optim.optimizer``).

Safe points: background work (a delayed optimizer step, a parameter round, a refresh download)
lands only at the start of ``step`` (the caller's backward is done and its next forward has not
begun) or when the optimizer must be settled (a global step, a download, ``state_dict``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

from kit.averaging.grid import search_window
from kit.optim.accumulation import GradientAccumulator, all_finite
from kit.optim.epoch_actions import (
    Action,
    AverageGradients,
    CancelPrefetch,
    DropAccumulated,
    FlagDrift,
    Publish,
    ReportProgress,
    StartRefresh,
    StepWithoutRound,
)
from kit.optim.epochs import EpochLife, Phase, Position, Refresh, Report
from kit.optim.grad_scaling import current_scale, found_inf_tensor, hold_growth, record_check
from kit.optim.landing import StateLanding
from kit.optim.progress import ProgressTracker
from kit.optim.rounds import GradientRounds, RoundOutcome, group_bits
from kit.optim.sharing import StateSharing
from kit.optim.splits import TAG_BYTES, RoundTag, SplitWatch
from kit.optim.state_averaging import AveragedTensors, DelayedStateAveraging, state_averaging_needed
from kit.optim.stepping import InnerOptimizer
from kit.runtime import Runtime

logger = logging.getLogger(__name__)


class EpochDriver:
    """Runs one peer's epochs (see the module); ``kit.Optimizer`` holds one.

    Args:
        life: the epoch machine.
        inner, accumulated, tracker, sharing, state_round, averaged, runtime: the parts it acts
            with; ``rounds`` is None with ``use_local_updates`` (no gradient averager).
        options: ``kit.Optimizer``'s ``use_local_updates``, ``auxiliary``,
            ``reuse_grad_buffers``, ``delay_grad_averaging``, ``delay_state_averaging``,
            ``average_state_every``, ``load_state_timeout``, ``verbose`` (``OPTIONS``), and
            ``matchmaking_time`` (of parameter rounds without gradient rounds).
        clock: monotonic seconds, the machine's ``now`` (read here only).
    """

    OPTIONS = (  # kit.Optimizer's options it reads (see there)
        "use_local_updates",
        "auxiliary",
        "reuse_grad_buffers",
        "delay_grad_averaging",
        "delay_state_averaging",
        "average_state_every",
        "load_state_timeout",
        "verbose",
    )

    def __init__(
        self,
        *,
        life: EpochLife,
        inner: InnerOptimizer,
        accumulated: GradientAccumulator,
        tracker: ProgressTracker,
        rounds: GradientRounds | None,
        sharing: StateSharing,
        state_round: DelayedStateAveraging,
        averaged: AveragedTensors,
        runtime: Runtime,
        options: dict[str, Any],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.life = life
        self.inner = inner
        self.accumulated = accumulated
        self.tracker = tracker
        self.rounds = rounds
        self.sharing = sharing
        self.state_round = state_round
        self.averaged = averaged
        self.runtime = runtime
        self.clock = clock  # the epoch machine's "now" (held reports' deadlines)
        self.local_updates: bool = options["use_local_updates"]
        self.auxiliary: bool = options["auxiliary"]
        self.reuse_grad_buffers: bool = options["reuse_grad_buffers"]
        self.delay_grad_averaging: bool = options["delay_grad_averaging"]
        self.delay_state_averaging: bool = options["delay_state_averaging"]
        self.average_state_every: int = options["average_state_every"]
        self.matchmaking_time: float = options["matchmaking_time"]
        self.verbose: bool = options["verbose"]
        # False when this peer's inner optimizer computes differently from the others' (8-bit
        # statistics chosen by its memory plan): its steps are never bit-identical to theirs,
        # so every round marks it drifted and parameter averaging pulls it back.
        self.exact_steps = True
        self.nonfinite_rollbacks = 0  # steps undone because they left a parameter non-finite
        self._outcome: RoundOutcome | None = None  # of the last gradient round, to judge
        self._backoff_due = False  # an averaged gradient was not finite: back the scale off
        self._step_ended: float | None = None  # when the last step() returned (perf_counter)
        self.splits = SplitWatch()  # did a recent round of ours split from a larger group?
        self._splits_checked: tuple[Any, ...] | None = None  # (records, tags) last checked
        self.landing = StateLanding(  # serves, loads and downloads the state
            life=life,
            inner=inner,
            accumulated=accumulated,
            tracker=tracker,
            sharing=sharing,
            state_round=state_round,
            averaged=averaged,
            runtime=runtime,
            act=self.act,
            finish_step=lambda: self.finish_optimizer_step(wait=None),
            auxiliary=self.auxiliary,
            load_state_timeout=options["load_state_timeout"],
        )

    # --- a step -----------------------------------------------------------------------------

    def step(self, batch_size: int, grad_scaler: Any, clip_norm: float | None = None) -> None:
        """``kit.Optimizer.step`` of a training peer (see its module for the whole story)."""
        self.apply_background_work()
        self.follow_split()
        if self._backoff_due and grad_scaler is not None:
            # The last averaged gradient was not finite: every member skipped that step, and
            # backs its loss scale off as the scaler would after an inf (grad_scaling).
            record_check(grad_scaler, self, found_inf_tensor(True, current_scale(grad_scaler)))
            self._backoff_due = False
        position = self._position()
        if position is Position.STEP_WITH_THEM:
            self.global_step()  # local updates: a peer a moment ahead counted our samples
            position = self._position()
        if position is Position.DOWNLOAD_FIRST:
            self.landing.load_from_peers()  # a fresh peer, or too far behind: catch up first
            self._step_ended = None  # the download is no training time
            return
        if position is Position.FAST_FORWARD:
            self.finish_optimizer_step(wait=None)
            self._fast_forward(self.life.fast_forward(self.tracker.global_progress.epoch))
        decide = self.local_updates  # local updates step on this gradient at once
        finite = batch_size > 0 and self.accumulated.add(
            batch_size, grad_scaler, decide=decide, clip_norm=clip_norm
        )
        if finite and self.local_updates:
            self.inner.opt.step()
            self.roll_back_if_not_finite()
        if finite and self._step_ended is not None:  # local throughput, global steps excluded
            elapsed = time.perf_counter() - self._step_ended
            self.tracker.performance_ema.update(batch_size, elapsed)
        self.report()
        if self.life.may_step() and self.tracker.ready_to_update_epoch:
            self.global_step()
        if self.reuse_grad_buffers and self.accumulated.samples > 0:
            hold_growth(grad_scaler)  # .grad holds part of an epoch at this scale
        self._step_ended = time.perf_counter()

    def _position(self) -> Position:
        return self.life.position(
            self.tracker.global_progress.epoch,
            has_samples=self.accumulated.samples > 0,
            local_updates=self.local_updates,
        )

    def global_step(self) -> None:
        """The collaboration has the target batch: average, step, move to the next epoch."""
        epoch = self.life.epoch
        self.finish_optimizer_step(wait=None)  # one optimizer step in flight at a time
        self.accumulated.settle()  # the round's weight counts only finite micro-batches
        samples = self.accumulated.samples
        actions = self.life.ready(
            self.tracker.global_progress.epoch,
            samples,
            local_updates=self.local_updates,
            background=self.delay_grad_averaging,
        )
        if self.life.phase is Phase.ACCUMULATING:  # the others took this step without us
            self._fast_forward(actions)
            return
        if samples == 0 and not self.local_updates:
            logger.info("no samples at epoch %d: waiting for the state of the next epoch", epoch)
        self.act(actions)
        if self.verbose and self.life.epoch == epoch + 1:
            num_peers = self.tracker.global_progress.num_peers
            logger.info("epoch %d done (%d peers)", self.life.epoch, num_peers)

    def _average(self, action: AverageGradients) -> None:
        rounds = self._rounds()
        rounds.take_mean(self.accumulated)
        epoch, samples, last_group_size = action.epoch, action.samples, self.life.last_group_size
        if action.background:
            # delay_grad_averaging: the round and the optimizer step run in the background
            # thread while this peer computes the next epoch's batches; the result lands at a
            # safe point (one step stale, as in hivemind).
            def average() -> bool:  # in the optimizer's thread; False: skip the step
                self._outcome = outcome = rounds.average(
                    epoch, samples, last_group_size=last_group_size, exact_steps=self.exact_steps
                )
                finite = rounds.give_to(self.inner, outcome, reuse_grad_buffers=False)
                self._backoff_due = self._backoff_due or not finite
                return finite

            scheduler = self.sharing.scheduler
            self.inner.step(True, scheduler, reuse_grad_buffers=False, before=average)
            self.act(self.life.round_began_in_background())
            return
        outcome = rounds.average(
            epoch, samples, last_group_size=last_group_size, exact_steps=self.exact_steps
        )
        forward = self.life.round_ended(
            self.clock(),
            averaged=outcome.went_through,
            global_epoch=self.tracker.global_progress.epoch,
            samples=samples,
            hold_for=rounds.search_time,
        )
        if self.life.phase is Phase.ACCUMULATING:  # our samples came too late for that step
            self._fast_forward(forward)
            return
        self._outcome = outcome
        finite = rounds.give_to(self.inner, outcome, reuse_grad_buffers=self.reuse_grad_buffers)
        self.act(self.life.stepped())
        if not finite:
            self._backoff_due = True
            self.accumulated.clear_grads()  # (reuse_grad_buffers: no step consumes .grad)
        self._step_inner(apply=finite)

    def _step_inner(self, *, apply: bool) -> None:
        reuse = self.reuse_grad_buffers
        self.inner.step(apply, self.sharing.scheduler, reuse_grad_buffers=reuse)
        if not self.inner.pending:
            self.after_update()

    def _fast_forward(self, actions: list[Action]) -> None:
        logger.info(
            "the collaboration moved to epoch %d: joining it, fetching its state meanwhile",
            self.life.epoch,
        )
        self.act(actions)

    def report(self) -> None:
        """Publish our progress, or the report the epoch machine holds."""
        held = self.life.held
        after_failure = held is not None and self.life.report is Report.HELD_AFTER_FAILURE
        others = self.tracker.others_at_epoch(held[0]) if after_failure and held else 0
        samples = self.accumulated.samples
        running = self.inner.pending
        self.act(
            self.life.report_now(self.clock(), samples, step_running=running, others_at_held=others)
        )

    def act(self, actions: list[Action]) -> None:
        """Carry out the epoch machine's actions, in order."""
        for action in actions:
            if isinstance(action, Publish):
                self.tracker.report_local_progress(action.epoch, action.samples)
            elif isinstance(action, ReportProgress):
                self.report()
            elif isinstance(action, FlagDrift):
                self.tracker.set_drifted(action.drifted)
            elif isinstance(action, DropAccumulated):
                self.accumulated.reset(clear_grads=action.clear_grads)
            elif isinstance(action, CancelPrefetch):
                self.sharing.cancel_prefetch()
            elif isinstance(action, StartRefresh):
                self.sharing.start_refresh(action.min_epoch, action.donors)
            elif isinstance(action, AverageGradients):
                self._average(action)
            elif isinstance(action, StepWithoutRound):
                self._step_inner(apply=False)
            else:  # LoadRefresh, AddRefreshDelta: with the landed state (landing.apply_refresh)
                raise AssertionError(f"{action} needs a landed state")

    # --- safe points ------------------------------------------------------------------------

    def apply_background_work(self) -> None:
        """The safe point: apply whatever finished in the background (never blocks)."""
        self.finish_optimizer_step(wait=0.0)
        self.finish_state_round(wait=0.0)
        self.landing.apply_refresh()

    def finish_optimizer_step(self, wait: float | None) -> None:
        """Apply a delayed optimizer step if it is over (``wait``: as ``InnerOptimizer.finish``)."""
        if self.inner.finish(wait):
            self.after_update()

    def after_update(self) -> None:
        """At a safe point after an optimizer step: judge its round, share it, average it."""
        outcome, self._outcome = self._outcome, None
        judgement = None
        if outcome is not None:
            outcome.log()
            judgement = outcome.judgement()
            self._tag_round(outcome)
        # Someone to refresh from (only asked when it matters: the view costs an aggregate).
        others = judgement is not None and judgement.failed_or_partial
        others = others and self.tracker.global_progress.num_peers > 1
        hold_for = self.rounds.search_time if self.rounds is not None else 0.0
        self.act(self.life.concluded(self.clock(), judgement, others=others, hold_for=hold_for))
        if self.roll_back_if_not_finite():
            return  # nothing of that step is shared or averaged
        self.report()  # a report held while the round ran may go now
        self._begin_parameter_round()  # (before serving: the state says it will still move)
        if self.state_round.moves_parameters and not self.delay_state_averaging:
            self.finish_state_round(wait=None)  # lands now, and serves the averaged state
        else:
            self.landing.publish_state()

    def _begin_parameter_round(self) -> None:
        """Begin the parameter round of our epoch if one is due."""
        epoch = self.life.epoch
        needed = state_averaging_needed(
            epoch,
            self.average_state_every,
            local_updates=self.local_updates,
            drifted=self.life.drifted,
            others_drifted=self.tracker.others_drifted(epoch),
        )
        if not needed or self.tracker.global_progress.num_peers <= 1:
            return  # (nobody to average with: a peer that shows up downloads our state)
        if self.state_round.running and self.state_round.epoch < epoch:
            # An older round still looking for a group: the others are at this epoch now.
            rebased = self.state_round.rebased
            if self.state_round.give_up_search() and rebased:
                # We loaded a state whose donor averages in that round: it moves without us.
                self.act(self.life.drifted_by())
        if self.state_round.running:
            logger.debug("the previous parameter round still runs: skipping epoch %d's", epoch)
            return
        # The group of the gradient round we just took part in is who will be here; the tracker
        # may still see some of them at the previous epoch for a moment.
        expected = self.life.last_group_size or self.tracker.peers_at_epoch(epoch)
        logger.debug("a parameter round begins at epoch %d (%d peers expected)", epoch, expected)
        self.life.parameter_round_began()
        self.state_round.start(
            self.averaged.current(),
            group_bits(epoch),
            expected,
            timeout=self.rounds.search_time
            if self.rounds
            else search_window(self.matchmaking_time),
            epoch=epoch,
        )

    def _tag_round(self, outcome: RoundOutcome) -> None:
        """Publish the group of a full, exact round (one group: a Moshpit grid's differ by
        design), so that peers of one epoch that averaged apart find out (``kit.optim.splits``)."""
        result = outcome.result
        if outcome.grid is None and result is not None and result.is_full and outcome.exact:
            self.tracker.add_round(
                RoundTag(outcome.epoch, result.group_id[:TAG_BYTES], len(result))
            )

    def follow_split(self) -> None:
        """A recent round of ours was one of several groups, not the largest: copy the largest
        group's state (an exact copy: optimizer statistics differ too, ``kit.optim.splits``)."""
        if not self.life.joined or self.local_updates or self.auxiliary:
            return
        if self.life.refresh is not Refresh.IDLE:
            return  # (checked again once it landed: it may bring the other group's state)
        seen = (self.tracker.fetched_at, self.tracker.round_tags)
        if seen == self._splits_checked:
            return  # nothing new since the last look
        self._splits_checked = seen
        found = self.splits.check(self.tracker.round_tags, self.tracker.others_round_tags())
        if found is not None:
            epoch, donors = found
            logger.info(
                "epoch %d's gradient round split into groups and ours was not the largest: "
                "copying the state of its %d peers",
                epoch,
                len(donors),
            )
            self.act(self.life.lost_split(donors))

    def roll_back_if_not_finite(self) -> bool:
        """Undo a step that left any parameter inf or NaN; True if it did.

        Checked before the new parameters are shared, served or averaged, so a diverged peer
        never spreads them (sahajBERT's trainer restored a copy for the same reason, recipes.md
        §3.1). The peer reloads its last shared state (parameters, optimizer and scheduler, one
        epoch back), flags itself drifted, and catches up with the others' current state at its
        next step; ``nonfinite_rollbacks`` counts these (the volunteer's status shows it).
        """
        if all_finite(self.inner.params):
            return False
        self.nonfinite_rollbacks += 1
        snapshot = self.sharing.last_shared
        logger.warning(
            "a step left non-finite parameters: rolled back to the state of epoch %s and "
            "catching up with peers (rollbacks so far: %d) - help: lower optimizer.lr or raise "
            "optimizer.eps if this repeats",
            snapshot.epoch if snapshot is not None else "?",
            self.nonfinite_rollbacks,
        )
        if snapshot is not None:
            self.finish_optimizer_step(wait=None)  # (local updates: a scheduler step in flight)
            self.landing.load(snapshot, keep_accumulated=False)
        self.act(self.life.drifted_by())
        return True

    def finish_state_round(self, wait: float | None) -> None:
        """Apply the parameter round if it is over, and serve the state it leaves."""
        if not self.state_round.running or self.inner.pending:
            return  # never move the parameters under a running optimizer step
        moves, rebased = self.state_round.moves_parameters, self.state_round.rebased
        over, result = self.state_round.finish(wait)
        if not over:
            return
        complete = result is not None and self.state_round.complete(result)
        if result is not None:
            logger.debug(
                "parameters averaged with %d peers (full: %s)", len(result), result.is_full
            )
            actions = self.life.parameters_averaged(
                complete=complete, local_updates=self.local_updates
            )
            self.act(actions)
        if rebased and not complete:
            # We loaded a state its donor was averaging in this very round: what the round
            # gave the donor, we did not all get.
            self.act(self.life.drifted_by())
        if moves:
            self.landing.publish_state()  # it was served marked as still moving

    # --- auxiliary peers --------------------------------------------------------------------

    def auxiliary_step(self) -> None:
        """Auxiliary peers bring no gradients: they join the rounds when the others are ready."""
        progress = self.runtime.call(self.tracker.wait_for_update(5.0), timeout=10.0)
        self.life.auxiliary_saw(progress.epoch, joined_round=False)
        if progress.ready:
            last_group_size = self.life.last_group_size
            self._rounds().average(  # weight 0: it brings no samples
                self.life.epoch, 0, last_group_size=last_group_size, exact_steps=self.exact_steps
            )
            self.life.auxiliary_saw(progress.epoch, joined_round=True)
            self.tracker.report_local_progress(self.life.epoch, 0)
        else:
            time.sleep(
                min(1.0, max(0.05, progress.eta_next_epoch / 2))
                if math.isfinite(progress.eta_next_epoch)
                else 0.5
            )

    def _rounds(self) -> GradientRounds:
        assert self.rounds is not None, "gradient rounds need the gradient averager"
        return self.rounds
