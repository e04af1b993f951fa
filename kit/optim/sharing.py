"""How a ``kit.Optimizer`` peer shares its training state and catches up with the others'.

Holds :class:`StateSharing`, the part of ``kit.Optimizer`` that snapshots its state after every
update (served by ``kit.optim.state`` to late joiners), downloads the collaboration's state
(``load_state_from_peers``, prefetched while the optimizer is set up), and catches up in the
background after falling behind. It does not hold the wire protocol (``kit.optim.state``) nor
the training step (``kit.optim.optimizer``).

Catching up without stopping (a peer one or a few epochs behind: its round failed, or the state
it downloaded was overtaken while it travelled, as happens when an epoch is shorter than a
download): the peer drops what it accumulated for a step that was already taken, moves to the
collaboration's epoch at once (its next samples count there, and its rounds are tagged with
that epoch, so nothing stale is mixed in), flags itself drifted, and downloads the current state
in the background. The download lands at a safe point: loaded outright if it is of the peer's
epoch (what it accumulated toward that epoch stays: computed on parameters one step old, which
DeDLOC tolerates), or, if the peer stepped on meanwhile, added as a delta (state - parameters
when the download began) so those steps are kept, as in delayed parameter averaging, and then
fetched again (up to CATCH_UP_TRIES downloads) for an exact copy with the optimizer statistics;
whatever remains is flagged as drift, which parameter averaging removes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from typing import Any

import torch

from kit.errors import KitError, KitTimeout, StateDownloadFailed
from kit.optim.accumulation import GradientAccumulator
from kit.optim.progress import ProgressTracker
from kit.optim.state import StateServer, StateSnapshot, download_state, find_donors
from kit.optim.stepping import InnerOptimizer
from kit.runtime import Runtime

logger = logging.getLogger(__name__)

CATCH_UP_TIMEOUT = 60.0  # a background catch-up download gives up after this (drift is flagged)
DONOR_POLL = 0.5  # s between looks for a donor of a recent enough state
PROGRESS_LOOK_TIMEOUT = 5.0  # a joiner's look at the progress before its first step, at most
CATCH_UP_TRIES = 5  # downloads trying to land on our epoch exactly, before leaving it to averaging
MAX_FAST_FORWARD = 16  # further behind than this many epochs, a peer downloads the state first

SnapshotFuture = concurrent.futures.Future[StateSnapshot | None]


class StateSharing:
    """``kit.Optimizer``'s state sharing and catching up (a mixin: it uses the optimizer's fields)."""

    dht: Any
    run_id: str
    auxiliary: bool
    reuse_grad_buffers: bool
    load_state_timeout: float
    local_epoch: int
    scheduler: Any
    opt: torch.optim.Optimizer
    tracker: ProgressTracker
    _inner: InnerOptimizer
    _params: list[torch.Tensor]
    _accumulated: GradientAccumulator
    _extra: list[torch.Tensor]
    _in_step: bool
    _state_server: StateServer
    _runtime: Runtime
    _prefetch: SnapshotFuture | None
    _catch_up: SnapshotFuture | None
    _catch_up_base: list[torch.Tensor]
    _catch_up_epoch: int
    _catch_up_tries: int
    _drifted: bool
    _last_shared: StateSnapshot | None

    def _finish_optimizer_step(self, wait: float | None) -> None:
        raise NotImplementedError

    def _set_drifted(self, drifted: bool) -> None:
        raise NotImplementedError

    def load_state_from_peers(self, timeout: float | None = None) -> bool:
        """Download parameters, optimizer and scheduler state and epoch from up-to-date peers.

        Returns:
            Whether a state was loaded: False at once, keeping this peer's own state, when no
            other peer shares one (the first peer of a run), as hivemind does.

        Raises:
            StateDownloadFailed: peers share a state, but none could provide a verified one
                within the timeout.
        """
        started = time.perf_counter()
        self._finish_optimizer_step(wait=None)
        self._cancel_catch_up()
        timeout = timeout or self.load_state_timeout
        snapshot = None
        prefetch, self._prefetch = self._prefetch, None
        if prefetch is not None:  # begun in __init__: current unless the collaboration moved on
            try:
                snapshot = prefetch.result(timeout)
            except (KitError, KitTimeout, concurrent.futures.TimeoutError) as e:
                logger.info("prefetching the state failed (%s): downloading it again", e)
            # A few epochs old is as good as a new download, which epochs shorter than a
            # download overtake too: the first step joins the current epoch and catches up in
            # the background (_fast_forward).
            behind = self.tracker.global_progress.epoch - snapshot.epoch if snapshot else 0
            if behind > MAX_FAST_FORWARD:
                snapshot = None
        if snapshot is None:
            snapshot = self._download(timeout, only_if_shared=True).result(timeout + 30.0)
        if snapshot is None:
            logger.info("no other peer shares a state yet: keeping this peer's own")
            return False
        # The first step must see where the collaboration is now: look while the state loads.
        looked = self._runtime.call(
            self.tracker.wait_for_update(PROGRESS_LOOK_TIMEOUT), return_future=True
        )
        self._load_snapshot(snapshot, keep_accumulated=False)
        try:
            looked.result(PROGRESS_LOOK_TIMEOUT + 1.0)
        except concurrent.futures.TimeoutError:
            looked.cancel()  # the step goes on with the last view; the tracker keeps trying
        logger.info(
            "downloaded the state of epoch %d from peers in %.1f s",
            self.local_epoch,
            time.perf_counter() - started,
        )
        return True

    def _apply_catch_up(self) -> None:
        """Load a finished background download (see ``_fast_forward``)."""
        catch_up = self._catch_up
        if catch_up is None or not catch_up.done() or self._inner.pending:
            return
        self._catch_up = None
        base, self._catch_up_base = self._catch_up_base, []
        try:
            snapshot = catch_up.result()
        except (KitError, KitTimeout, concurrent.futures.CancelledError) as e:
            logger.info("catching up in the background failed (%s): averaging will fix it", e)
            return
        if snapshot is None:
            return
        if snapshot.epoch == self.local_epoch:
            self._load_snapshot(snapshot, keep_accumulated=True)
        elif snapshot.epoch > self.local_epoch:
            self._load_snapshot(snapshot, keep_accumulated=False)
        elif snapshot.epoch == self._catch_up_epoch and base:
            # We stepped on while it travelled: keep those steps (the same averaged gradients
            # as everyone's) on top of the state, the delta rule as for parameter averaging.
            # Optimizer statistics stay ours: they differ less with every step (Adam's decay),
            # and the drift flag keeps asking for parameter averaging to remove the rest.
            params = self._checked_params(snapshot.state())
            self._inner.add(
                [theirs.float() - old for theirs, old in zip(params, base, strict=True)]
            )
            logger.info(
                "caught up with epoch %d's state %d epochs late",
                snapshot.epoch,
                self.local_epoch - snapshot.epoch,
            )
            self._retry_catch_up()
        else:
            logger.info("the downloaded state (epoch %d) is already old", snapshot.epoch)
            self._retry_catch_up()

    def _retry_catch_up(self) -> None:
        """Fetch the state again, for an exact copy (optimizer statistics included) of our epoch.

        Epochs may be shorter than a download: a few tries land on one; after that, the drift
        flag leaves the rest to parameter averaging.
        """
        self._catch_up_tries += 1
        if self._catch_up_tries < CATCH_UP_TRIES:
            self._start_catch_up()

    def _fast_forward(self, epoch: int) -> None:
        logger.info(
            "the collaboration moved to epoch %d: joining it, fetching its state meanwhile", epoch
        )
        self._finish_optimizer_step(wait=None)
        self.local_epoch = epoch
        self._accumulated.reset()
        self._set_drifted(True)
        self.tracker.report_local_progress(self.local_epoch, 0)
        if self._prefetch is not None:  # taken before our epoch: too old to be of use now
            self._prefetch.cancel()
            self._prefetch = None
        if self._catch_up is None:  # else the download under way brings a newer state than ours
            self._catch_up_tries = 0
            self._start_catch_up()

    def _start_catch_up(self) -> None:
        self._catch_up_epoch = self.local_epoch
        self._catch_up_base = [p.detach().float().cpu().clone() for p in self._params]
        # A state of our epoch at least: right after our round failed, the others may still be
        # in theirs, advertising the previous epoch's state, which would be of no use.
        self._catch_up = self._download(
            min(CATCH_UP_TIMEOUT, self.load_state_timeout), min_epoch=self.local_epoch
        )

    def _cancel_catch_up(self) -> None:
        if self._catch_up is not None:
            self._catch_up.cancel()
            self._catch_up = None

    def _download(
        self,
        timeout: float,
        *,
        only_if_running: bool = False,
        only_if_shared: bool = False,
        min_epoch: int = 0,
    ) -> concurrent.futures.Future[StateSnapshot | None]:
        """Start downloading the newest state from peers (on the runtime loop).

        ``only_if_running``: None at once if no peer advertises a state past epoch 0.
        ``only_if_shared``: None at once if no other peer advertises a state at all.
        ``min_epoch``: wait (until the timeout, then None) for a donor at this epoch or later.
        """

        async def fetch(_: Any, node: Any) -> StateSnapshot | None:
            # A download fails only if no donor could serve a verified state (a donor that moves
            # on keeps serving the snapshot it started with); retry until the deadline.
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            failures = 0
            while True:
                donors = await find_donors(node, node.peer, self.run_id)
                if only_if_running and not any(d.epoch > 0 for d in donors):
                    return None
                if only_if_shared and not donors:
                    return None
                if min_epoch > 0 and not any(d.epoch >= min_epoch for d in donors):
                    if loop.time() + DONOR_POLL > deadline:
                        return None
                    await asyncio.sleep(DONOR_POLL)
                    continue
                try:
                    begun = loop.time()
                    snapshot = await download_state(
                        node.peer, donors, self.run_id, timeout=deadline - loop.time()
                    )
                    logger.debug(
                        "state of epoch %d downloaded from %d donors in %.2f s",
                        snapshot.epoch,
                        len(donors),
                        loop.time() - begun,
                    )
                    return snapshot
                except StateDownloadFailed as e:
                    if loop.time() + 1.0 > deadline:
                        raise
                    logger.info("state download failed (%s); trying again", e)
                    # Once at once (the donors moved on to a newer state: ask again), then
                    # with a pause (they are gone or failing: let the DHT catch up).
                    failures += 1
                    if failures > 1:
                        await asyncio.sleep(0.5)

        future: concurrent.futures.Future[StateSnapshot | None] = self.dht.run_coroutine(
            fetch, return_future=True
        )
        return future

    def _full_state(self) -> dict[str, Any]:
        return {
            "epoch": self.local_epoch,
            "params": [p.detach() for p in self._params],
            "extra": [t.detach() for t in self._extra],
            "optimizer": self.opt.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
        }

    def _publish_state(self, *, even_auxiliary: bool = False) -> None:
        if self.auxiliary and not even_auxiliary:
            return  # an auxiliary peer's parameters are not trained: nothing to share
        try:
            snapshot = StateSnapshot.capture(self.local_epoch, self._full_state(), digest=False)
        except KitError as e:
            logger.warning("cannot share the training state: %s", e)
            return

        drifted = self._drifted
        self._last_shared = snapshot  # what a non-finite step rolls back to (set at once)

        async def publish(_: Any, node: Any) -> None:
            await self._state_server.publish(snapshot, drifted=drifted)

        self.dht.run_coroutine(publish, return_future=True)

    def _checked_params(self, state: Any) -> list[torch.Tensor]:
        params = state.get("params") if isinstance(state, dict) else None
        if not isinstance(params, list) or len(params) != len(self._params):
            raise StateDownloadFailed(
                "the peers' state has another number of parameters - help: check the model config"
            )
        for mine, theirs in zip(self._params, params, strict=True):
            if not isinstance(theirs, torch.Tensor) or tuple(mine.shape) != tuple(theirs.shape):
                raise StateDownloadFailed(
                    f"a parameter from peers does not match {tuple(mine.shape)} here"
                    " - help: check that your model config matches the run's"
                )
        return params

    def _checked_extra(self, state: dict[str, Any]) -> list[torch.Tensor]:
        """The state's ``extra_tensors``, shaped as ours (none if this run has none)."""
        extra = state.get("extra", [])
        if not self._extra:
            return []
        if not isinstance(extra, list) or len(extra) != len(self._extra):
            raise StateDownloadFailed(
                f"the peers' state has {len(extra) if isinstance(extra, list) else 'no'} extra "
                f"tensors, {len(self._extra)} here - help: pass the same extra_tensors everywhere"
            )
        for mine, theirs in zip(self._extra, extra, strict=True):
            if not isinstance(theirs, torch.Tensor) or tuple(mine.shape) != tuple(theirs.shape):
                raise StateDownloadFailed(
                    f"an extra tensor from peers does not match {tuple(mine.shape)} here"
                )
        return extra

    def _load_snapshot(self, snapshot: StateSnapshot, *, keep_accumulated: bool) -> None:
        """Load a downloaded state. ``keep_accumulated``: it is of our current epoch, and what we
        accumulated toward it stays (computed on one-step-old parameters: DeDLOC tolerates it)."""
        state = snapshot.state()
        params = self._checked_params(state)
        extra = self._checked_extra(state)
        self._inner.load(params)
        with torch.no_grad():
            for mine, theirs in zip(self._extra, extra, strict=True):
                mine.copy_(theirs.to(device=mine.device, dtype=mine.dtype))
        self.opt.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.local_epoch = snapshot.epoch
        self._in_step = True
        if not keep_accumulated:
            self._accumulated.reset()
        self._set_drifted(False)
        self.tracker.report_local_progress(self.local_epoch, self._accumulated.samples)
        self._publish_state()
