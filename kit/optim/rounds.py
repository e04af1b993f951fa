"""One averaging round of ``kit.Optimizer``, tagged with its epoch, and what its result means.

Holds :class:`GradientRounds` (the gradient averager's driver: the mean gradient in, a round,
the average out to the inner optimizer, round listeners), :func:`average_at_epoch` (blocking:
form a group with the peers at the same epoch and all-reduce; safe to call from the optimizer's
background thread with ``delay_grad_averaging``), :class:`RoundOutcome` (judged for the epoch
machine, ``kit.optim.epochs``) and :func:`group_bits`. It does not hold the averager
(``kit.averaging``) nor decides when a round is due (``kit.optim.epochs``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Callable

from kit.averaging.averager import DecentralizedAverager, RoundResult
from kit.averaging.control import StepControl
from kit.errors import AveragingFailed, KitError, KitTimeout, TransientError
from kit.optim.accumulation import GradientAccumulator
from kit.optim.epoch_actions import Judgement
from kit.optim.progress import ProgressTracker
from kit.optim.stepping import InnerOptimizer

logger = logging.getLogger(__name__)

POLL = 0.05  # s between checks of a running round against the collaboration's progress


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
    result: RoundResult | None
    expected: int
    exact: bool

    @property
    def group_size(self) -> int:
        return len(self.result) if self.result is not None else 0

    @property
    def identical(self) -> bool:
        """Every peer we expected got the same, exact average: nobody drifted apart."""
        result = self.result
        return result is not None and result.is_full and self.exact and len(result) >= self.expected

    @property
    def failed_or_partial(self) -> bool:
        """Our gradient (or part of it) stayed local: it differs from everyone else's."""
        return self.result is None or not self.result.is_full

    def judgement(self) -> Judgement:
        """What the round means for the epoch machine (``kit.optim.epochs``)."""
        return Judgement(
            averaged=self.result is not None,
            identical=self.identical,
            failed_or_partial=self.failed_or_partial,
            group_size=self.group_size,
        )

    def log(self) -> None:
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
    last_group_size: int,
    matchmaking_time: float,
    averaging_timeout: float,
) -> tuple[RoundResult | None, int]:
    """One round tagged with ``epoch``; returns the result (None: failed) and the peers expected.

    It begins as soon as every peer the tracker sees at ``epoch`` is in, and gives up early when
    the others already finished ``epoch``'s round without us.
    """
    averager.set_group_bits(group_bits(epoch))
    # Everyone the tracker sees at our epoch (auxiliary peers included): begin when they are in.
    expected = tracker.peers_at_epoch(epoch, with_samples=True)
    if expected < 2:
        # Only we reported samples: the others' reports have not reached us yet (the peers of
        # our last round are surely coming: their records may still show the previous epoch),
        # or nobody else is there at all.
        expected = max(tracker.peers_at_epoch(epoch), last_group_size)
    averager.set_target_group_size(expected if expected >= 2 else None)
    # The timeout bounds the search for a group; the all-reduce has its own (allreduce_timeout).
    search = 2 * matchmaking_time + 1.0
    future = averager.step(weight=weight, timeout=search, wait=False)
    if not isinstance(future, StepControl):  # step(wait=False) returns one
        raise TypeError(f"averager.step(wait=False) returned {type(future).__name__}")
    give_up = time.monotonic() + search + averaging_timeout + 30.0
    while True:
        try:
            result = future.result(timeout=POLL)
            break
        except concurrent.futures.TimeoutError:
            # Still looking while the others already finished this epoch's round (we were not
            # in their view in time): nobody will come, stop now rather than time out.
            moved_on = tracker.global_progress.epoch > epoch
            if (moved_on and averager.is_looking_for_group) or time.monotonic() > give_up:
                future.cancel()
                logger.info("the others finished epoch %d's round without us", epoch)
                return None, expected
        except AveragingFailed as e:  # no group, or the round failed: RoundOutcome.log warns
            logger.info("%s: %s", averager.settings.prefix, e)
            return None, expected
        except (TransientError, KitTimeout, KitError, concurrent.futures.CancelledError) as e:
            logger.warning("averaging round failed: %s", e)
            return None, expected
    if result is not None:
        logger.debug(
            "%s: averaged with %d peers (full: %s) in %.2f + %.2f s",
            averager.settings.prefix,
            len(result),
            result.is_full,
            result.matchmaking_time,
            result.allreduce_time,
        )
    return result, expected


class GradientRounds:
    """One gradient round per epoch with ``averager`` (the optimizer's gradient averager).

    Args:
        averager: the gradient averager (float32 CPU buffers shaped as the parameters).
        tracker: the progress tracker (who is at which epoch).
        matchmaking_time, averaging_timeout: as ``kit.Optimizer``'s.
        exact_gradients: every member of a full round gets bit-identical gradients (an exact
            codec, or one shared lossy average: ``kit.optim.state_averaging``).
    """

    def __init__(
        self,
        averager: DecentralizedAverager,
        tracker: ProgressTracker,
        *,
        matchmaking_time: float,
        averaging_timeout: float,
        exact_gradients: bool,
    ) -> None:
        self.averager = averager
        self.tracker = tracker
        self.matchmaking_time = matchmaking_time
        self.averaging_timeout = averaging_timeout
        self.exact_gradients = exact_gradients
        self.listeners: list[Callable[[int, RoundResult], None]] = []

    @property
    def search_time(self) -> float:
        """How long a round may look for its group (as average_at_epoch's search)."""
        return 2 * self.matchmaking_time + 1.0

    def take_mean(self, accumulated: GradientAccumulator) -> None:
        """Put this epoch's mean gradient in the averager's buffers."""
        with self.averager.get_tensors() as buffers:
            accumulated.mean_gradient(buffers)

    def give_to(
        self, inner: InnerOptimizer, outcome: RoundOutcome, *, reuse_grad_buffers: bool
    ) -> None:
        """Give the (averaged) buffers to the inner optimizer for its step.

        Chunks the round left unaveraged (their aggregator failed, or the deadline came) step
        with a zero gradient, not with this peer's own: when an aggregator dies every member
        loses the same chunks, so all of them still step alike and stay bit-identical
        (parameters and optimizer statistics). With their own gradients there each member would
        step differently, and no member would hold the collaboration's state to copy.
        """
        result = outcome.result
        with self.averager.get_tensors() as buffers:
            if result is not None and not result.is_full:
                for part, specs in zip(result.report.parts, result.plan.parts, strict=False):
                    for spec, peers in zip(specs, part.chunk_peers, strict=False):
                        if not peers:
                            result.plan.chunk_view(buffers, spec).zero_()
            inner.set_gradients(buffers, reuse_grad_buffers=reuse_grad_buffers)

    def average(
        self, epoch: int, samples: int, *, last_group_size: int, exact_steps: bool
    ) -> RoundOutcome:
        """The round of ``epoch`` (blocking), weighted by ``samples``; listeners hear of it.

        ``exact_steps``: this peer's optimizer steps bit-identically to the others'.
        """
        result, expected = average_at_epoch(
            self.averager,
            self.tracker,
            epoch,
            float(samples),
            last_group_size=last_group_size,
            matchmaking_time=self.matchmaking_time,
            averaging_timeout=self.averaging_timeout,
        )
        if result is not None:
            for listener in self.listeners:  # e.g. kit.metrics attests the group's weights
                try:
                    listener(epoch, result)
                except Exception:  # a listener's bug must not break training
                    logger.exception("a round listener failed")
        return RoundOutcome(epoch, result, expected, self.exact_gradients and exact_steps)
