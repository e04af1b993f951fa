"""How a ``kit.Optimizer`` peer shares its training state and fetches the others'.

Holds :class:`StateSharing` (a part of ``kit.Optimizer``, with fields of its own): it snapshots
the state after every update (served by ``kit.optim.state`` to late joiners), downloads the
collaboration's state (``load_state_from_peers``, prefetched by :func:`start_download` while the
optimizer is set up), and runs the background *refresh* download after the peer fell behind.
*When* to refresh, and what a landed download means, is decided by the epoch machine
(``kit.optim.epochs``); this module only moves state. It does not hold the wire protocol
(``kit.optim.state``) nor the training step (``kit.optim.driver``).

Catching up without stopping (a peer one or a few epochs behind: its round failed, or the state
it downloaded was overtaken while it travelled, as happens when an epoch is shorter than a
download): the peer drops what it accumulated for a step that was already taken, moves to the
collaboration's epoch at once (its next samples count there, and its rounds are tagged with
that epoch, so nothing stale is mixed in), flags itself drifted, and downloads the current state
in the background. The download lands at a safe point: loaded outright if it is of the peer's
epoch (what it accumulated toward that epoch stays: computed on parameters one step old, which
DeDLOC tolerates), or, if the peer stepped on meanwhile, added as a delta (state - parameters
when the download began) so those steps are kept, as in delayed parameter averaging, and then
fetched again (up to ``epochs.REFRESH_TRIES`` downloads) for an exact copy with the optimizer
statistics; whatever remains is flagged as drift, which parameter averaging removes.

A state served while a parameter round runs names that round (``averaging_round``): its delta
will still move the donor's tensors, and the loader follows it only if it averages in the same
round (``kit.optim.landing``'s ``load``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from typing import Any

import torch

from kit.errors import KitError, KitTimeout, StateDownloadFailed
from kit.optim.state import StateServer, StateSnapshot, download_state, find_donors
from kit.optim.stepping import InnerOptimizer

logger = logging.getLogger(__name__)

CATCH_UP_TIMEOUT = 60.0  # a background catch-up download gives up after this (drift is flagged)
DONOR_POLL = 0.5  # s between looks for a donor of a recent enough state

SnapshotFuture = concurrent.futures.Future[StateSnapshot | None]


def start_download(
    dht: Any,
    run_id: str,
    timeout: float,
    *,
    only_if_running: bool = False,
    only_if_shared: bool = False,
    min_epoch: int = 0,
    only_from: frozenset[bytes] | None = None,
) -> SnapshotFuture:
    """Start downloading the newest state of ``run_id`` from peers (on the runtime loop).

    ``only_if_running``: None at once if no peer advertises a state past epoch 0.
    ``only_if_shared``: None at once if no other peer advertises a state at all.
    ``min_epoch``: wait (until the timeout, then None) for a donor at this epoch or later.
    ``only_from``: ask only these peers (ids), e.g. the group a split round must copy.
    """

    async def fetch(_: Any, node: Any) -> StateSnapshot | None:
        # A download fails only if no donor could serve a verified state (a donor that moves
        # on keeps serving the snapshot it started with); retry until the deadline.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        failures = 0
        while True:
            donors = await find_donors(node, node.peer, run_id)
            if only_from is not None:
                donors = [d for d in donors if d.peer_id.to_bytes() in only_from]
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
                    node.peer, donors, run_id, timeout=deadline - loop.time()
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

    future: SnapshotFuture = dht.run_coroutine(fetch, return_future=True)
    return future


class StateSharing:
    """This peer's served state, its downloads, and its background refresh.

    Args:
        dht, run_id: where the state is served and found.
        inner: the inner optimizer (parameters, their copies, its state).
        extra: ``extra_tensors`` shared with the parameters.
        scheduler: the learning-rate scheduler (its state travels too), or None.
        server: serves this peer's snapshots.
        prefetch: a download begun while the optimizer was built (``start_download``), or None.
        load_state_timeout: the longest a download may take.
    """

    def __init__(
        self,
        *,
        dht: Any,
        run_id: str,
        inner: InnerOptimizer,
        extra: list[torch.Tensor],
        scheduler: Any,
        server: StateServer,
        prefetch: SnapshotFuture | None,
        load_state_timeout: float,
    ) -> None:
        self.dht = dht
        self.run_id = run_id
        self.inner = inner
        self.extra = extra
        self.scheduler = scheduler
        self.server = server
        self.prefetch = prefetch
        self.load_state_timeout = load_state_timeout
        self.last_shared: StateSnapshot | None = None  # what a non-finite step rolls back to
        self._refresh: SnapshotFuture | None = None
        self._refresh_base: list[torch.Tensor] = []  # our parameters when the refresh began

    # --- the prefetch and downloads -----------------------------------------------------------

    def cancel_prefetch(self) -> None:
        if self.prefetch is not None:
            self.prefetch.cancel()
            self.prefetch = None

    def take_prefetch(self, timeout: float) -> StateSnapshot | None:
        """The prefetched state (None if there was none or it failed); the prefetch is used up."""
        prefetch, self.prefetch = self.prefetch, None
        if prefetch is None:
            return None
        try:
            return prefetch.result(timeout)
        except (KitError, KitTimeout, concurrent.futures.TimeoutError) as e:
            logger.info("prefetching the state failed (%s): downloading it again", e)
            return None

    def download(self, timeout: float) -> StateSnapshot | None:
        """The newest shared state, waiting for it (None at once if no other peer shares one)."""
        future = start_download(self.dht, self.run_id, timeout, only_if_shared=True)
        return future.result(timeout + 30.0)

    # --- the background refresh ------------------------------------------------------------

    @property
    def refreshing(self) -> bool:
        return self._refresh is not None

    def start_refresh(self, min_epoch: int, donors: frozenset[bytes] | None = None) -> None:
        """Download a state of ``min_epoch`` or newer in the background (``donors``: only from
        these peers); keep our parameters now (the base of a delta, should we step on while it
        travels)."""
        self._refresh_base = [p.detach().float().cpu().clone() for p in self.inner.params]
        timeout = min(CATCH_UP_TIMEOUT, self.load_state_timeout)
        self._refresh = start_download(
            self.dht, self.run_id, timeout, min_epoch=min_epoch, only_from=donors
        )

    def refresh_landed(self) -> tuple[bool, StateSnapshot | None]:
        """(landed, state): whether the refresh ended (None: no state, or it failed)."""
        refresh = self._refresh
        if refresh is None or not refresh.done():
            return False, None
        self._refresh = None
        try:
            return True, refresh.result()
        except (KitError, KitTimeout, concurrent.futures.CancelledError) as e:
            self._refresh_base = []
            logger.info("catching up in the background failed (%s): averaging will fix it", e)
            return True, None

    def add_refresh_delta(self, snapshot: StateSnapshot, epochs_late: int) -> None:
        """We stepped on while ``snapshot`` travelled: move the parameters by (its parameters -
        ours when the refresh began), keeping those steps on top of the others' state."""
        base, self._refresh_base = self._refresh_base, []
        params = self.checked_params(snapshot.state())
        self.inner.add([theirs.float() - old for theirs, old in zip(params, base, strict=True)])
        logger.info("caught up with epoch %d's state %d epochs late", snapshot.epoch, epochs_late)

    def cancel_refresh(self) -> None:
        if self._refresh is not None:
            self._refresh.cancel()
            self._refresh = None
        self._refresh_base = []

    # --- this peer's state ------------------------------------------------------------------

    def full_state(self, epoch: int, averaging_round: int | None = None) -> dict[str, Any]:
        return {
            "epoch": epoch,
            # The epoch of a parameter round whose delta will still move these tensors (None:
            # settled); a peer loading them follows it only if it averages in that round too.
            "averaging_round": averaging_round,
            "params": [p.detach() for p in self.inner.params],
            "extra": [t.detach() for t in self.extra],
            "optimizer": self.inner.opt.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
        }

    def publish(self, epoch: int, *, drifted: bool, averaging_round: int | None = None) -> None:
        """Serve a snapshot of the state now (the last shared one is what a rollback restores);
        ``averaging_round``: the epoch of a parameter round that will still move it."""
        try:
            state = self.full_state(epoch, averaging_round)
            snapshot = StateSnapshot.capture(epoch, state, digest=False)
        except KitError as e:
            logger.warning("cannot share the training state: %s", e)
            return
        self.last_shared = snapshot  # what a non-finite step rolls back to (set at once)
        logger.debug(
            "serving the state of epoch %d (drifted: %s, averaging round: %s)",
            epoch,
            drifted,
            averaging_round,
        )
        server = self.server

        async def publish(_: Any, node: Any) -> None:
            await server.publish(snapshot, drifted=drifted)

        self.dht.run_coroutine(publish, return_future=True)

    def checked_params(self, state: Any) -> list[torch.Tensor]:
        params = state.get("params") if isinstance(state, dict) else None
        mine = self.inner.params
        if not isinstance(params, list) or len(params) != len(mine):
            raise StateDownloadFailed(
                "the peers' state has another number of parameters - help: check the model config"
            )
        for ours, theirs in zip(mine, params, strict=True):
            if not isinstance(theirs, torch.Tensor) or tuple(ours.shape) != tuple(theirs.shape):
                raise StateDownloadFailed(
                    f"a parameter from peers does not match {tuple(ours.shape)} here"
                    " - help: check that your model config matches the run's"
                )
        return params

    def _checked_extra(self, state: dict[str, Any]) -> list[torch.Tensor]:
        """The state's ``extra_tensors``, shaped as ours (none if this run has none)."""
        extra = state.get("extra", [])
        if not self.extra:
            return []
        if not isinstance(extra, list) or len(extra) != len(self.extra):
            raise StateDownloadFailed(
                f"the peers' state has {len(extra) if isinstance(extra, list) else 'no'} extra "
                f"tensors, {len(self.extra)} here - help: pass the same extra_tensors everywhere"
            )
        for mine, theirs in zip(self.extra, extra, strict=True):
            if not isinstance(theirs, torch.Tensor) or tuple(mine.shape) != tuple(theirs.shape):
                raise StateDownloadFailed(
                    f"an extra tensor from peers does not match {tuple(mine.shape)} here"
                )
        return extra

    def load(self, snapshot: StateSnapshot) -> int | None:
        """Load a state's tensors: parameters, extras, optimizer and scheduler (checked first).

        Returns the epoch of the parameter round its donor will still apply to it (None: none).
        """
        state = snapshot.state()
        params = self.checked_params(state)
        extra = self._checked_extra(state)
        averaging_round = state.get("averaging_round")
        if averaging_round is not None and (
            not isinstance(averaging_round, int) or isinstance(averaging_round, bool)
        ):
            raise StateDownloadFailed(
                "the peers' state names no valid parameter round - help: update kit on every peer"
            )
        self.inner.load(params)
        with torch.no_grad():
            for mine, theirs in zip(self.extra, extra, strict=True):
                mine.copy_(theirs.to(device=mine.device, dtype=mine.dtype))
        self.inner.opt.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        return averaging_round

    def shutdown(self) -> None:
        self.cancel_refresh()
        self.cancel_prefetch()
