"""The global step of ``kit.Optimizer``: one gradient round per epoch, then the optimizer's step.

Holds :class:`GlobalStep` (a mixin of ``kit.Optimizer``: it uses the optimizer's fields), which
takes the step when the collaboration reached the target batch: this peer's mean gradient goes
into a round tagged with its epoch (``kit.optim.rounds``), the averaged gradient into the inner
optimizer (``kit.optim.stepping``), and the round's outcome is judged at the next safe point
(drift flags, a background state refresh after a failed or partial round). With
``delay_grad_averaging`` the round and the step run in the optimizer's thread while the next
batches compute. It does not hold parameter averaging (``kit.optim.state_averaging``) nor state
downloads (``kit.optim.sharing``).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kit.averaging.averager import DecentralizedAverager, RoundResult
from kit.averaging.deadlines import Deadlines
from kit.optim.accumulation import GradientAccumulator
from kit.optim.progress import ProgressTracker
from kit.optim.rounds import RoundOutcome, average_at_epoch, average_on_grid, expected_peers
from kit.optim.state import StateSnapshot
from kit.optim.stepping import InnerOptimizer

logger = logging.getLogger(__name__)


class GlobalStep:
    """``kit.Optimizer``'s global step (a mixin: it uses the optimizer's fields)."""

    local_epoch: int
    scheduler: Any
    use_local_updates: bool
    reuse_grad_buffers: bool
    delay_grad_averaging: bool
    verbose: bool
    matchmaking_time: float
    averaging_timeout: float
    target_group_size: int | None
    dht: Any
    _deadlines: Deadlines
    tracker: ProgressTracker
    grad_averager: DecentralizedAverager | None  # None with use_local_updates
    _inner: InnerOptimizer
    _accumulated: GradientAccumulator
    _exact_gradients: bool
    exact_steps: bool
    _in_step: bool
    _last_group_size: int
    _outcome: RoundOutcome | None
    _held_report: tuple[int, int] | None
    _hold_until: float
    _prefetch: concurrent.futures.Future[StateSnapshot | None] | None
    _catch_up: concurrent.futures.Future[StateSnapshot | None] | None
    _catch_up_tries: int
    _round_listeners: list[Callable[[int, RoundResult], None]]

    if TYPE_CHECKING:  # provided by kit.Optimizer and StateSharing (no stubs at run time)

        def _finish_optimizer_step(self, wait: float | None) -> None: ...

        def _after_update(self) -> None: ...

        def _fast_forward(self, epoch: int) -> None: ...

        def _start_catch_up(self) -> None: ...

        def _set_drifted(self, drifted: bool) -> None: ...

    @property
    def _grads(self) -> DecentralizedAverager:
        assert self.grad_averager is not None, "gradient rounds need the gradient averager"
        return self.grad_averager

    def add_round_listener(self, listener: Callable[[int, RoundResult], None]) -> None:
        """Call ``listener(epoch, result)`` after each gradient round that formed a group (in
        the thread that ran it): ``kit.metrics`` attests the members' weights this way."""
        self._round_listeners.append(listener)

    def _global_step(self) -> None:
        epoch = self.local_epoch
        self._finish_optimizer_step(wait=None)  # one optimizer step in flight at a time
        if self._prefetch is not None:  # in step with the others: the prefetched state is moot
            self._prefetch.cancel()
            self._prefetch = None
        stepped = False
        global_epoch = self.tracker.global_progress.epoch
        if global_epoch > epoch and self._in_step and not self.use_local_updates:
            # The others already took this step without us (our view of their progress lagged):
            # a round tagged with our epoch would find nobody. Join the current epoch instead.
            # (With local updates there is no such round: the step is ours to take, and our
            # parameter round at the next epoch meets theirs.)
            self._fast_forward(global_epoch)
            return
        samples = self._accumulated.samples
        if self.use_local_updates:
            stepped = False  # parameters are averaged by the state round (_after_update)
        elif samples > 0:
            with self._grads.get_tensors() as buffers:
                self._accumulated.mean_gradient(buffers)
            if self.delay_grad_averaging:
                self._delayed_global_step(epoch, samples)
                return
            outcome = self._gradient_round(epoch, samples)
            global_epoch = self.tracker.global_progress.epoch
            if not outcome.averaged and global_epoch > epoch and self._in_step:
                self._fast_forward(global_epoch)  # our samples came too late for that step
                return
            if not outcome.averaged:
                # We step on our own gradient, but others may still be in this epoch's round:
                # seeing us at the next epoch, they would take the round for finished and
                # leave it. Stay at this epoch in their view until they are done.
                self._held_report = (epoch, samples)
                self._hold_until = time.monotonic() + self._round_search_time()
            self._outcome = outcome
            with self._grads.get_tensors() as buffers:
                self._inner.set_gradients(buffers, reuse_grad_buffers=self.reuse_grad_buffers)
            stepped = True
        else:
            logger.info("no samples at epoch %d: waiting for the state of the next epoch", epoch)
            self._set_drifted(True)  # the others step without us
            stepped = False
        self._next_epoch(epoch, clear_grads=False)
        self._inner.step(stepped, self.scheduler, reuse_grad_buffers=self.reuse_grad_buffers)
        if not self._inner.pending:
            self._after_update()

    def _delayed_global_step(self, epoch: int, samples: int) -> None:
        """``delay_grad_averaging``: the round and the optimizer step run in the background thread
        while this peer computes the next epoch's batches; the result lands at a safe point."""

        def average() -> None:  # in the optimizer's thread
            self._outcome = self._gradient_round(epoch, samples)
            with self._grads.get_tensors() as buffers:
                self._inner.set_gradients(buffers, reuse_grad_buffers=False)

        # Until the round is over the others must still see us at its epoch: a peer at the next
        # one tells them the round is done, and a peer still looking for its group gives up.
        self._held_report = (epoch, samples)
        self._hold_until = 0.0  # ...and, should it fail, as above (_conclude_round)
        self._inner.step(True, self.scheduler, reuse_grad_buffers=False, before=average)
        self._next_epoch(epoch, clear_grads=True)  # .grad is ours again: the mean is taken

    def _next_epoch(self, epoch: int, *, clear_grads: bool) -> None:
        self.local_epoch = epoch + 1
        self._in_step = True
        self._accumulated.reset(clear_grads=clear_grads)
        self._report_progress()
        if self.verbose:
            logger.info(
                "epoch %d done (%d peers)", self.local_epoch, self.tracker.global_progress.num_peers
            )

    def _report_progress(self) -> None:
        """Publish our progress, or the held report of a round still running (or failed while
        other peers are still in it: bounded by the time a round may search for its group)."""
        held = self._held_report
        if (
            held is not None
            and held[0] == self.local_epoch - 1
            and (  # not after a fast-forward
                self._inner.pending
                or (
                    time.monotonic() < self._hold_until
                    and self.tracker.others_at_epoch(held[0]) > 0
                )
            )
        ):
            self.tracker.report_local_progress(*held)
        else:
            self._held_report = None
            self.tracker.report_local_progress(self.local_epoch, self._accumulated.samples)

    def _round_search_time(self) -> float:
        return 2 * self.matchmaking_time + 1.0  # as average_at_epoch's search

    def _gradient_round(self, epoch: int, samples: int) -> RoundOutcome:
        """The epoch's gradient average: one group, or a Moshpit grid when more peers are
        expected than ``target_group_size`` (``kit.optim.rounds``: what a global step means)."""
        expected = expected_peers(self.tracker, epoch, self._last_group_size)
        self._apply_deadlines(expected)
        group_size = self.target_group_size
        if group_size is not None and expected > group_size:
            outcome = self._average_on_grid(epoch, samples, expected, group_size)
        else:
            result, expected = self._average_gradients(epoch, samples)
            exact = self._exact_gradients and self.exact_steps
            outcome = RoundOutcome(epoch, result, expected, exact)
        result = outcome.result
        if result is None:
            if expected >= 2:
                self._deadlines.observe_search(None, filled=False)
            return outcome
        filled = len(result) >= min(expected, self.target_group_size or expected)
        self._deadlines.observe_search(result.matchmaking_time, filled=filled)
        timed_out = not result.is_full and result.allreduce_time >= 0.9 * self.averaging_timeout
        self._deadlines.observe_round(None if timed_out else result.allreduce_time)
        return outcome

    def _apply_deadlines(self, peers: int) -> None:
        """``"auto"`` deadlines (kit.averaging.deadlines) for a round among ``peers``."""
        if not self._deadlines.auto:
            return
        self.matchmaking_time = self._deadlines.matchmaking_time(peers)
        self.averaging_timeout = self._deadlines.averaging_timeout(peers)
        self._grads.set_deadlines(self.matchmaking_time, self.averaging_timeout)

    def _average_on_grid(
        self, epoch: int, samples: int, expected: int, group_size: int
    ) -> RoundOutcome:
        total = self.tracker.samples_at_epoch(epoch)

        def first_round(index: int, result: RoundResult) -> None:
            if index == 0:  # the members' own samples (later rounds weigh whole groups)
                self._notify_round_listeners(epoch, result)

        result, grid = average_on_grid(
            self._grads,
            self.tracker,
            epoch,
            float(samples),
            me=self.dht.peer_id,
            expected=expected,
            group_size=group_size,
            matchmaking_time=self.matchmaking_time,
            averaging_timeout=self.averaging_timeout,
            on_round=first_round,
        )
        exact = self._exact_gradients and self.exact_steps
        return RoundOutcome(epoch, result, expected, exact, grid, total)

    def _average_gradients(self, epoch: int, samples: int) -> tuple[RoundResult | None, int]:
        """One group of the peers at ``epoch``: the result (None: failed), the peers expected."""
        result, expected = average_at_epoch(
            self._grads,
            self.tracker,
            epoch,
            float(samples),
            last_group_size=self._last_group_size,
            matchmaking_time=self.matchmaking_time,
            averaging_timeout=self.averaging_timeout,
        )
        if result is not None:
            self._notify_round_listeners(epoch, result)
        return result, expected

    def _notify_round_listeners(self, epoch: int, result: RoundResult) -> None:
        for listener in self._round_listeners:  # e.g. kit.metrics attests the group's weights
            try:
                listener(epoch, result)
            except Exception:  # a listener's bug must not break training
                logger.exception("a round listener failed")

    def _conclude_round(self) -> None:
        """Judge the last gradient round (at a safe point, in the caller's thread)."""
        outcome, self._outcome = self._outcome, None
        if outcome is None:
            return
        outcome.log()
        if not outcome.averaged and self._held_report is not None:
            self._hold_until = time.monotonic() + self._round_search_time()  # see _global_step
        if not outcome.identical:
            self._set_drifted(True)
        self._last_group_size = outcome.group_size
        # A round that failed or stayed partial while we keep our epoch leaves us with other
        # gradients than the rest, so our optimizer statistics (Adam's moments) differ too, and
        # parameter averaging alone would let the parameters drift apart again at every step
        # (seen in tests/netsim/test_churn.py). Fetch an exact copy of the state of the peers
        # whose round went through, in the background. (A full round with fewer peers than
        # expected left its members identical to each other: the missing peer is the one to
        # refresh; drift flags bring parameter averaging for the rest.)
        others = self.tracker.global_progress.num_peers > 1
        if outcome.failed_or_partial and others and self._catch_up is None:
            self._catch_up_tries = 0
            self._start_catch_up()
