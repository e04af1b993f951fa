"""The gradient average of ``kit.Optimizer``, tagged with its epoch, and what its result means.

Holds :class:`GradientRounds` (the gradient averager's driver: the mean gradient in, a round
of one group or a Moshpit grid, "auto" deadlines, the average out to the inner optimizer, round
listeners), :func:`average_at_epoch` (blocking: form a group with the peers at the same epoch and
all-reduce; safe to call from the optimizer's background thread with ``delay_grad_averaging``),
:func:`average_on_grid` (the same over a Moshpit grid, when more peers are expected than
``target_group_size``), :class:`RoundOutcome` (judged for the epoch machine, ``kit.optim.epochs``)
and :func:`group_bits`. It does not hold the averager (``kit.averaging``) nor decides when a
round is due (``kit.optim.epochs``).

A global step keeps DeDLOC's meaning with Moshpit: the sample-weighted mean of the gradients of
every peer of the epoch. Each peer averages with the weight of what its value stands for (its
samples, then its group's total, ...; ``kit.averaging.grid``), so its gradient is at every
moment the exact sample-weighted mean over a set of distinct peers, and the weight says how many
samples that set holds. On a full grid (every round's groups full: N = G^d peers) d rounds cover
all of them: the exact global-batch gradient, as with one group. When the grid is incomplete, a
round fails for a peer (no group, or aborted: it keeps its value and weight and goes on), or a
peer crashes mid-way, a peer may end with a weight below the epoch's total: it then steps with
the exact mean of that part of the global batch, flags itself drifted (so parameters are
averaged and, after a failed round, an exact state fetched: ``kit.optim.epochs``), and logs
the share it covered. The error this leaves is measured by ``benchmarks/swarm.py``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Callable

from kit.averaging.averager import DecentralizedAverager, RoundResult
from kit.averaging.control import StepControl
from kit.averaging.deadlines import Deadlines
from kit.averaging.grid import (
    GridAverage,
    begin_after_pool,
    later_round_delay,
    rounds_for,
    search_window,
)
from kit.dht.node import get_dht_time
from kit.errors import AveragingFailed, KitError, KitTimeout, TransientError
from kit.optim.accumulation import GradientAccumulator, all_finite
from kit.optim.epoch_actions import Judgement
from kit.optim.progress import ProgressTracker
from kit.optim.stepping import InnerOptimizer
from kit.p2p.identity import PeerID
from kit.runtime import get_runtime

logger = logging.getLogger(__name__)

POLL = 0.05  # s between checks of a running round against the collaboration's progress
ALONE_LOOK_TIMEOUT = 2.0  # s: a fresh look at the progress before stepping without a round
ALONE_LOOK_AGE = 1.0  # s: a look at the progress this recent needs no fresh one


def group_bits(epoch: int) -> str:
    """The matchmaking key of ``epoch``'s rounds (hivemind's group bits): peers at different
    epochs never average together, so a late peer cannot mix stale gradients into a step."""
    return format(epoch % 2**20, "020b")


@dataclasses.dataclass(frozen=True)
class RoundOutcome:
    """A gradient round's result, judged.

    ``expected``: the peers the tracker saw at that epoch when it began; ``exact``: the codec
    is lossless (then a full round leaves every member with bit-identical gradients).
    """

    epoch: int
    result: RoundResult | None  # of the (last) round
    expected: int
    exact: bool
    grid: GridAverage | None = None  # Moshpit: the rounds this peer went through
    total_weight: float = 0.0  # Moshpit: the samples of the epoch, as the tracker saw them
    alone: bool = False  # nobody else in the collaboration: the step needed no round
    in_sync: bool = True  # alone: nobody could have stepped without us (we never saw anyone)

    @property
    def went_through(self) -> bool:
        """The step has its gradient: a round formed, or there was nobody to form one with."""
        return self.alone or self.result is not None

    @property
    def group_size(self) -> int:
        if self.alone:
            return 1
        if self.grid is not None:  # the swarm averaged over, for the next epoch's expectation
            return self.expected if self.result is not None else 0
        return len(self.result) if self.result is not None else 0

    @property
    def averaged(self) -> bool:
        """Our gradient was averaged with someone's (in at least one round), or needed none."""
        if self.alone:
            return True
        return self.grid.completed > 0 if self.grid is not None else self.result is not None

    @property
    def covered(self) -> float:
        """Moshpit: the share of the epoch's samples our gradient is the exact mean of."""
        if self.grid is None or self.total_weight <= 0:
            return 1.0 if self.identical else 0.0
        return min(1.0, self.grid.weight / self.total_weight)

    @property
    def identical(self) -> bool:
        """Every peer we expected got the same, exact average: nobody drifted apart."""
        if self.alone:
            return self.in_sync
        result, grid = self.result, self.grid
        if grid is not None:
            complete = grid.completed == grid.rounds and grid.weight >= self.total_weight - 0.5
            return grid.exact and self.exact and complete
        return result is not None and result.is_full and self.exact and len(result) >= self.expected

    @property
    def failed_or_partial(self) -> bool:
        """Our gradient (or part of it) stayed local: it differs from everyone else's."""
        if self.alone:
            return False
        if self.grid is not None:
            return self.grid.completed < self.grid.rounds or not self.grid.exact
        return self.result is None or not self.result.is_full

    def judgement(self) -> Judgement:
        """What the round means for the epoch machine (``kit.optim.epochs``)."""
        return Judgement(
            averaged=self.averaged,
            identical=self.identical,
            failed_or_partial=self.failed_or_partial,
            group_size=self.group_size,
        )

    def log(self) -> None:
        if self.alone:
            return
        if self.grid is not None and not self.identical:
            logger.warning(
                "averaging at epoch %d: %d of %d grid rounds went through, covering %.1f%% of "
                "the samples (the gradient is their exact mean)",
                self.epoch,
                self.grid.completed,
                self.grid.rounds,
                100 * self.covered,
            )
            return
        if self.result is None:
            logger.warning(
                "averaging failed at epoch %d: proceeding with the local gradients", self.epoch
            )
        elif not self.result.is_full:
            logger.warning(
                "averaging at epoch %d was partial: parts %s step with a zero gradient",
                self.epoch,
                self.result.unaveraged_parts,
            )


def average_at_epoch(
    averager: DecentralizedAverager,
    tracker: ProgressTracker,
    epoch: int,
    weight: float,
    *,
    expected: int,
    matchmaking_time: float,
    averaging_timeout: float,
) -> RoundResult | None:
    """One round tagged with ``epoch``; returns the result (None: failed).

    It begins as soon as the ``expected`` peers (:func:`expected_peers`) are in, and gives up
    early when the others already finished ``epoch``'s round without us.
    """
    averager.set_group_bits(group_bits(epoch))
    averager.set_target_group_size(expected if expected >= 2 else None)
    return _blocking_step(averager, tracker, epoch, weight, matchmaking_time, averaging_timeout)


def expected_peers(tracker: ProgressTracker, epoch: int, last_group_size: int) -> int:
    """Everyone the tracker sees at ``epoch`` (auxiliary peers included)."""
    expected = tracker.peers_at_epoch(epoch, with_samples=True)
    if expected < 2:
        # Only we reported samples: the others' reports have not reached us yet (the peers of
        # our last round are surely coming: their records may still show the previous epoch),
        # or nobody else is there at all.
        expected = max(tracker.peers_at_epoch(epoch), last_group_size)
    return expected


def average_on_grid(
    averager: DecentralizedAverager,
    tracker: ProgressTracker,
    epoch: int,
    weight: float,
    *,
    me: PeerID,
    expected: int,
    group_size: int,
    matchmaking_time: float,
    averaging_timeout: float,
    on_round: Callable[[int, RoundResult], None] | None = None,
) -> tuple[RoundResult | None, GridAverage]:
    """Moshpit: ceil(log_G(expected)) rounds of groups of ``group_size`` (see the module).

    ``on_round(index, result)`` is called after each round that formed a group.

    Returns the last round's result (None: it failed) and the grid bookkeeping (how many rounds
    went through, the weight of the final gradient).
    """
    grid = GridAverage(group_bits(epoch), group_size, rounds_for(expected, group_size), weight)
    result: RoundResult | None = None
    wait = 0.0  # how long the next round's leader waits for its key (0: matchmaking_time)
    settings = averager.settings
    try:
        for index in range(grid.rounds):
            averager.set_group_bits(grid.bits)
            averager.set_target_group_size(grid.next_target(expected))
            shards = grid.next_shards(expected)
            averager.set_shards(shards)
            scheduled = begin_after_pool(wait, get_dht_time(), None)  # (the search waits)
            late = grid.next_has_late_groups(expected)
            everyones = grid.next_round_is_everyones
            started = time.monotonic()
            result = _blocking_step(
                averager,
                tracker,
                epoch,
                grid.weight,
                matchmaking_time,
                averaging_timeout,
                scheduled_time=scheduled,
                ends_when_others_step=everyones,
            )
            took = time.monotonic() - started
            wait = later_round_delay(late, took, matchmaking_time, settings.request_timeout)
            grid.round_ended(result, me)
            if result is None and everyones and tracker.global_progress.epoch > epoch:
                break  # every group formed without us: nobody is left to average with
            if result is not None and on_round is not None:
                on_round(index, result)
    finally:
        averager.set_shards(1)  # the epoch's other rounds (parameters) use the plain key
    return result, grid


def _blocking_step(
    averager: DecentralizedAverager,
    tracker: ProgressTracker,
    epoch: int,
    weight: float,
    matchmaking_time: float,
    averaging_timeout: float,
    *,
    scheduled_time: float | None = None,
    ends_when_others_step: bool = True,
) -> RoundResult | None:
    # The timeout bounds the search for a group; the all-reduce has its own (allreduce_timeout).
    # A round scheduled later (after a sharded one) searches that much longer.
    # ``ends_when_others_step``: the others stepping past ``epoch`` means this round's groups
    # all formed (its key holds everyone: GridAverage.next_round_is_everyones). Not so for a
    # later grid round: its key's members may still be finishing the round before, and giving
    # up then left them a member short (two peers with 1 of 2 rounds, and a group that began
    # with them while they gave up).
    search = search_window(matchmaking_time)
    if scheduled_time is not None:
        search += max(0.0, scheduled_time - get_dht_time())
    future = averager.step(weight=weight, timeout=search, scheduled_time=scheduled_time, wait=False)
    if not isinstance(future, StepControl):  # step(wait=False) returns one
        raise TypeError(f"averager.step(wait=False) returned {type(future).__name__}")
    bound = search + averaging_timeout + 30.0
    give_up = time.monotonic() + bound
    while True:
        try:
            result = future.result(timeout=POLL)
            break
        except concurrent.futures.TimeoutError:
            # Still looking while the others already finished this epoch's round (we were not
            # in their view in time): nobody will come, stop now rather than time out.
            moved_on = ends_when_others_step and tracker.global_progress.epoch > epoch
            if moved_on and averager.give_up_search(future):
                logger.info("the others finished epoch %d's round without us", epoch)
                return None
            if time.monotonic() > give_up:
                future.cancel()
                logger.warning("epoch %d's round did not end in %.0f s: given up", epoch, bound)
                return None
        except AveragingFailed as e:  # no group, or the round failed: RoundOutcome.log warns
            logger.info("%s: %s", averager.settings.prefix, e)
            return None
        except (TransientError, KitTimeout, KitError, concurrent.futures.CancelledError) as e:
            logger.warning("averaging round failed: %s", e)
            return None
    if result is not None:
        logger.debug(
            "%s: averaged with %d peers (full: %s) in %.2f + %.2f s",
            averager.settings.prefix,
            len(result),
            result.is_full,
            result.matchmaking_time,
            result.allreduce_time,
        )
    return result


class GradientRounds:
    """One gradient average per epoch with ``averager`` (the optimizer's gradient averager): one
    group, or a Moshpit grid when more peers are expected than ``target_group_size``.

    Args:
        averager: the gradient averager (float32 CPU buffers shaped as the parameters).
        tracker: the progress tracker (who is at which epoch).
        deadlines: the matchmaking time and averaging timeout, fixed or "auto"
            (``kit.averaging.deadlines``: updated before every round).
        target_group_size: the largest group (None: one group of everyone).
        me: this peer's id (its place on a grid).
        exact_gradients: every member of a full round gets bit-identical gradients (an exact
            codec, or one shared lossy average: ``kit.optim.state_averaging``).
    """

    def __init__(
        self,
        averager: DecentralizedAverager,
        tracker: ProgressTracker,
        *,
        deadlines: Deadlines,
        target_group_size: int | None,
        me: PeerID,
        exact_gradients: bool,
    ) -> None:
        self.averager = averager
        self.tracker = tracker
        self.deadlines = deadlines
        self.target_group_size = target_group_size
        self.me = me
        self.matchmaking_time = deadlines.matchmaking_time(2)
        self.averaging_timeout = deadlines.averaging_timeout(2)
        self.exact_gradients = exact_gradients
        self.listeners: list[Callable[[int, RoundResult], None]] = []
        self._was_alone = False  # the last epoch stepped alone (log the switch once)

    @property
    def saw_others(self) -> bool:
        """This peer has seen another peer of the collaboration since it started."""
        return self.tracker.saw_others

    def _alone(self) -> bool:
        """Nobody else in the collaboration, by a recent look at the progress records: the
        tracker's last fetch if it is at most ``ALONE_LOOK_AGE`` old, else a fresh one (a DHT
        fetch; only when the last look showed nobody)."""
        if self.tracker.global_progress.num_peers > 1:
            return False
        fetched = self.tracker.fetched_at
        if fetched is not None and get_dht_time() - fetched <= ALONE_LOOK_AGE:
            return True
        progress = get_runtime().call(
            self.tracker.wait_for_update(ALONE_LOOK_TIMEOUT), timeout=ALONE_LOOK_TIMEOUT + 1.0
        )
        return progress.num_peers <= 1

    @property
    def search_time(self) -> float:
        """How long a round may look for its group (as average_at_epoch's search)."""
        return search_window(self.matchmaking_time)

    def take_mean(self, accumulated: GradientAccumulator) -> None:
        """Put this epoch's mean gradient in the averager's buffers."""
        with self.averager.get_tensors() as buffers:
            accumulated.mean_gradient(buffers)

    def give_to(
        self, inner: InnerOptimizer, outcome: RoundOutcome, *, reuse_grad_buffers: bool
    ) -> bool:
        """Give the (averaged) buffers to the inner optimizer for its step.

        Chunks a one-group round left unaveraged (their aggregator failed, or the deadline came)
        step with a zero gradient, not with this peer's own: when an aggregator dies every member
        loses the same chunks, so all of them still step alike and stay bit-identical
        (parameters and optimizer statistics). With their own gradients there each member would
        step differently, and no member would hold the collaboration's state to copy. (On a
        Moshpit grid a peer's value is already a mean over other groups' members, whose groups
        lost other chunks or none: it keeps it and is marked drifted, ``RoundOutcome``.)

        Returns:
            Whether the gradient is finite. Every member of a round holds the same average, so
            an inf/NaN in it (an overflow on the wire, a bad aggregate) makes every member skip
            that optimizer step alike (``kit.optim.grad_scaling``); it is not given then.
        """
        result = outcome.result
        with self.averager.get_tensors() as buffers:
            if outcome.grid is None and result is not None and not result.is_full:
                for part, specs in zip(result.report.parts, result.plan.parts, strict=False):
                    for spec, peers in zip(specs, part.chunk_peers, strict=False):
                        if not peers:
                            result.plan.chunk_view(buffers, spec).zero_()
            if not all_finite(buffers):
                logger.warning(
                    "the averaged gradient of epoch %d is not finite: this optimizer step is "
                    "skipped (by every member of the round alike)",
                    outcome.epoch,
                )
                return False
            inner.set_gradients(buffers, reuse_grad_buffers=reuse_grad_buffers)
        return True

    def average(
        self, epoch: int, samples: int, *, last_group_size: int, exact_steps: bool
    ) -> RoundOutcome:
        """The average of ``epoch`` (blocking), weighted by ``samples``; listeners hear of it.

        ``exact_steps``: this peer's optimizer steps bit-identically to the others'.
        """
        exact = self.exact_gradients and exact_steps
        expected = expected_peers(self.tracker, epoch, last_group_size)
        if expected < 2 and self._alone():
            # Nobody to average with: a round would search 2 x matchmaking_time + 1 s for
            # nothing at every global step. Rounds resume as soon as a peer shows up.
            log = logger.debug if self._was_alone else logger.info
            log("no other peer in the collaboration: epoch %d steps without a round", epoch)
            self._was_alone = True
            return RoundOutcome(epoch, None, 1, exact, alone=True, in_sync=not self.saw_others)
        self._was_alone = False
        self._apply_deadlines(expected)
        group_size = self.target_group_size
        if group_size is not None and expected > group_size:
            outcome = self._average_on_grid(epoch, samples, expected, group_size, exact)
        else:
            result = average_at_epoch(
                self.averager,
                self.tracker,
                epoch,
                float(samples),
                expected=expected,
                matchmaking_time=self.matchmaking_time,
                averaging_timeout=self.averaging_timeout,
            )
            if result is not None:
                self._notify(epoch, result)
            outcome = RoundOutcome(epoch, result, expected, exact)
        result = outcome.result
        if result is None:
            if expected >= 2:
                self.deadlines.observe_search(None, filled=False)
            return outcome
        filled = len(result) >= min(expected, self.target_group_size or expected)
        self.deadlines.observe_search(result.matchmaking_time, filled=filled)
        timed_out = not result.is_full and result.allreduce_time >= 0.9 * self.averaging_timeout
        self.deadlines.observe_round(None if timed_out else result.allreduce_time)
        return outcome

    def _apply_deadlines(self, peers: int) -> None:
        """``"auto"`` deadlines (kit.averaging.deadlines) for a round among ``peers``."""
        if not self.deadlines.auto:
            return
        self.matchmaking_time = self.deadlines.matchmaking_time(peers)
        self.averaging_timeout = self.deadlines.averaging_timeout(peers)
        self.averager.set_deadlines(self.matchmaking_time, self.averaging_timeout)

    def _average_on_grid(
        self, epoch: int, samples: int, expected: int, group_size: int, exact: bool
    ) -> RoundOutcome:
        total = self.tracker.samples_at_epoch(epoch)

        def first_round(index: int, result: RoundResult) -> None:
            if index == 0:  # the members' own samples (later rounds weigh whole groups)
                self._notify(epoch, result)

        result, grid = average_on_grid(
            self.averager,
            self.tracker,
            epoch,
            float(samples),
            me=self.me,
            expected=expected,
            group_size=group_size,
            matchmaking_time=self.matchmaking_time,
            averaging_timeout=self.averaging_timeout,
            on_round=first_round,
        )
        return RoundOutcome(epoch, result, expected, exact, grid, total)

    def _notify(self, epoch: int, result: RoundResult) -> None:
        for listener in self.listeners:  # e.g. kit.metrics attests the group's weights
            try:
                listener(epoch, result)
            except Exception:  # a listener's bug must not break training
                logger.exception("a round listener failed")
