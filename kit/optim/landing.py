"""Where a state lands in a peer: ours served, a donor's loaded, a background refresh landed, the
first download of a joiner.

Holds :class:`StateLanding`, a part of ``kit.optim.driver``'s :class:`EpochDriver` (which owns
it and gives it its ``act``). The epoch machine (``kit.optim.epochs``) decides what a landed
state means for the epoch, the drift flag and the report; state sharing (``kit.optim.sharing``)
moves the bytes; this module keeps the two and the running parameter round
(``kit.optim.state_averaging``) in agreement. Called at the driver's safe points only.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable

from kit.optim.accumulation import GradientAccumulator
from kit.optim.epoch_actions import Action, AddRefreshDelta, LoadRefresh
from kit.optim.epochs import MAX_FAST_FORWARD, EpochLife
from kit.optim.progress import ProgressTracker
from kit.optim.sharing import StateSharing
from kit.optim.state import StateSnapshot
from kit.optim.state_averaging import AveragedTensors, DelayedStateAveraging
from kit.optim.stepping import InnerOptimizer
from kit.runtime import Runtime

logger = logging.getLogger(__name__)

PROGRESS_LOOK_TIMEOUT = 5.0  # a joiner's look at the progress before its first step, at most


class StateLanding:
    """Serves, loads and downloads one peer's state (see the module).

    Args:
        life, inner, accumulated, tracker, sharing, state_round, averaged, runtime: the
            driver's parts (see :class:`kit.optim.driver.EpochDriver`).
        act: the driver's, to carry out what the epoch machine answers.
        finish_step: the driver's, to land a delayed optimizer step (waiting for it) first.
        auxiliary: ``kit.Optimizer``'s option: such a peer serves no state of its own.
        load_state_timeout: ``kit.Optimizer``'s, the default wait of a download.
    """

    def __init__(
        self,
        *,
        life: EpochLife,
        inner: InnerOptimizer,
        accumulated: GradientAccumulator,
        tracker: ProgressTracker,
        sharing: StateSharing,
        state_round: DelayedStateAveraging,
        averaged: AveragedTensors,
        runtime: Runtime,
        act: Callable[[list[Action]], None],
        finish_step: Callable[[], None],
        auxiliary: bool,
        load_state_timeout: float,
    ) -> None:
        self.life = life
        self.inner = inner
        self.accumulated = accumulated
        self.tracker = tracker
        self.sharing = sharing
        self.state_round = state_round
        self.averaged = averaged
        self.runtime = runtime
        self.act = act
        self.finish_step = finish_step  # the driver's: a delayed optimizer step lands first
        self.auxiliary = auxiliary
        self.load_state_timeout = load_state_timeout

    def publish_state(self, *, even_auxiliary: bool = False) -> None:
        """Serve the state now, marked with the parameter round that will still move it (the
        delta of a running round lands on these tensors later: see ``load``)."""
        if self.auxiliary and not even_auxiliary:
            return  # an auxiliary peer's parameters are not trained: nothing to share
        moving = self.state_round.epoch if self.state_round.moves_parameters else None
        self.sharing.publish(self.life.epoch, drifted=self.life.drifted, averaging_round=moving)

    def load(self, snapshot: StateSnapshot, *, keep_accumulated: bool) -> None:
        """Load a state. ``keep_accumulated``: it is of our current epoch, and what we
        accumulated toward it stays (computed on one-step-old parameters: DeDLOC tolerates it).

        A parameter round of ours still running averaged the parameters we had before, and a
        donor's state may still be moved by its own round (the state says which). Round and
        state must agree, or we hold parameters nobody has, flagged in sync (the churn test of
        tests/optim/test_optimizer.py ended ~1e-3 apart: a joiner took a donor's state just
        before their common round averaged it with the joiner's drifted parameters):

        * the donor averages in the same round as we do: our round's delta is taken from the
          loaded tensors, so we land where the donor lands;
        * the state is settled: our round is not applied to it (it runs on for the others);
        * the donor's round is not ours: we cannot follow it, so we are flagged drifted.
        """
        pending = self.sharing.load(snapshot)  # the donor's round that will still move it
        # (captured as the round began: a donor's later steps would be missing from its delta)
        same_round = pending == snapshot.epoch == self.state_round.epoch
        if same_round and self.state_round.moves_parameters:
            self.state_round.rebase(self.averaged.current())
        else:
            same_round = False
            self.state_round.forget()
        logger.debug(
            "loaded the state of epoch %d (its parameter round: %s, ours: %s, followed: %s)",
            snapshot.epoch,
            pending,
            self.state_round.epoch if self.state_round.running else None,
            same_round,
        )
        samples = self.accumulated.samples
        self.act(self.life.state_loaded(snapshot.epoch, samples, keep_accumulated=keep_accumulated))
        if pending is not None and not same_round:
            self.act(self.life.drifted_by())
        self.publish_state()

    def apply_refresh(self) -> None:
        """Land a finished background download as the epoch machine says."""
        if not self.sharing.refreshing or self.inner.pending:
            return
        landed, snapshot = self.sharing.refresh_landed()
        if not landed:
            return
        old = snapshot is not None and snapshot.epoch < self.life.epoch
        actions = self.life.refresh_landed(snapshot.epoch if snapshot is not None else None)
        logger.debug(
            "a downloaded state of epoch %s landed at epoch %d: %s",
            snapshot.epoch if snapshot is not None else None,
            self.life.epoch,
            actions,
        )
        if old and snapshot is not None and AddRefreshDelta() not in actions:
            logger.info("the downloaded state (epoch %d) is already old", snapshot.epoch)
        for action in actions:
            if isinstance(action, LoadRefresh):
                assert snapshot is not None
                self.load(snapshot, keep_accumulated=action.keep_accumulated)
            elif isinstance(action, AddRefreshDelta):
                assert snapshot is not None
                self.sharing.add_refresh_delta(snapshot, self.life.epoch - snapshot.epoch)
            else:
                self.act([action])

    def load_from_peers(self, timeout: float | None = None) -> bool:
        """``kit.Optimizer.load_state_from_peers`` (see there)."""
        started = time.perf_counter()
        self.finish_step()
        self.sharing.cancel_refresh()
        self.act(self.life.downloading_first())
        timeout = timeout or self.load_state_timeout
        snapshot = self.sharing.take_prefetch(timeout)  # begun in __init__: current unless...
        # ...the collaboration moved on. A few epochs old is as good as a new download, which
        # epochs shorter than a download overtake too: the first step joins the current epoch
        # and refreshes in the background (a fast-forward).
        behind = self.tracker.global_progress.epoch - snapshot.epoch if snapshot else 0
        if behind > MAX_FAST_FORWARD:
            snapshot = None
        if snapshot is None:
            snapshot = self.sharing.download(timeout)
        if snapshot is None:
            logger.info("no other peer shares a state yet: keeping this peer's own")
            return False
        # The first step must see where the collaboration is now: look while the state loads.
        looked = self.runtime.call(
            self.tracker.wait_for_update(PROGRESS_LOOK_TIMEOUT), return_future=True
        )
        self.load(snapshot, keep_accumulated=False)
        try:
            looked.result(PROGRESS_LOOK_TIMEOUT + 1.0)
        except concurrent.futures.TimeoutError:
            looked.cancel()  # the step goes on with the last view; the tracker keeps trying
        logger.info(
            "downloaded the state of epoch %d from peers in %.1f s",
            self.life.epoch,
            time.perf_counter() - started,
        )
        return True
