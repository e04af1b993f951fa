"""Publishing this peer's contribution record to the DHT (a task on the runtime loop).

A training peer creates one :class:`MetricsReporter` when its trainer starts, calls
:meth:`MetricsReporter.update` after its steps, and the reporter stores the owner-signed record
under ``f"{run_id}_metrics"`` (subkey: the peer's ``[owner:...]`` marker, as
``kit.optim.progress`` does) at most every ``period`` seconds: at once after a change if the
last store is older than that, and every :attr:`MetricsReporter.refresh_interval` if nothing
changed. Records expire after ``expiration`` seconds, so a peer that leaves
drops off the dashboard by itself.

Counters (``samples_total``, ``compute_seconds``) count from when this reporter was created: each
reporter is a new *session*, so a restarted process never counts twice (``kit.metrics.book``).

What this module does not do: reading the records (``collector``), measuring the loss or the
throughput (the trainer does and passes them to :meth:`MetricsReporter.update`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
from collections.abc import Callable
from typing import Any

from kit.dht.node import DHTNode, get_dht_time
from kit.errors import ConfigError, KitError, KitUsageError
from kit.metrics.attestations import AveragedRound, RoundAttestor
from kit.metrics.records import ContributionRecord, metrics_key
from kit.metrics.signed_store import SignedStore
from kit.p2p.identity import Identity, PeerID

logger = logging.getLogger(__name__)

#: Fields the trainer may change with :meth:`MetricsReporter.update`.
UPDATABLE = frozenset(
    {
        "username", "epoch", "loss", "samples_total", "compute_seconds", "samples_per_second",
        "client_mode", "auxiliary", "device",
    }
)  # fmt: skip
FINAL_STORE_TIMEOUT = 5.0  # seconds shutdown() waits to publish the last counts


class MetricsReporter:
    """Publishes this peer's :class:`ContributionRecord`, refreshed in the background.

    Create and :meth:`start` it on the runtime loop (e.g. inside ``dht.run_coroutine``); call
    :meth:`update` from anywhere: from the runtime loop, or from the trainer's thread, since it
    only swaps one frozen record (an atomic assignment) and wakes the loop thread-safely.

    Args:
        node: the running DHT node of this peer.
        run_id: the run; records live under ``metrics_key(run_id)``.
        identity: this peer's key (the one its handshake proves): it signs the record, and in
            authenticated runs the access token must have been issued to it.
        token: returns the peer's current ``kit.auth.AccessToken`` bytes (tokens refresh, so it
            is asked at every store), or None in open runs.
        period: seconds between stores. Increase this on swarms of hundreds of peers if the
            DHT is busy; lower it for a livelier dashboard.
        expiration: lifetime of a stored record; a peer silent for longer disappears.
        username: the user name shown in open runs (authenticated runs use the token's).
        device: short device description, e.g. "Tesla T4 (fp16)".
        client_mode, auxiliary: what this peer is (see ``ContributionRecord``).

    Raises:
        ConfigError: a period or expiration that is not positive, or expiration <= period.
    """

    def __init__(
        self,
        node: DHTNode,
        run_id: str,
        identity: Identity,
        *,
        token: Callable[[], bytes | None] | None = None,
        period: float = 10.0,
        expiration: float = 300.0,
        username: str = "",
        device: str = "cpu",
        client_mode: bool = False,
        auxiliary: bool = False,
    ) -> None:
        if not (period > 0 and expiration > period):
            raise ConfigError(
                f"MetricsReporter: period={period!r} and expiration={expiration!r} must satisfy "
                "0 < period < expiration - help: keep the defaults (10 s and 300 s)"
            )
        self.node = node
        self.period = period
        self.expiration = expiration
        self._store = SignedStore(
            node, metrics_key(run_id), identity, expiration=expiration, token=token
        )
        self.session = secrets.token_hex(8)
        self._record = ContributionRecord(
            peer_id=PeerID.from_public_key(identity.public_key).to_bytes(),
            session=self.session,
            username=username,
            token=None,
            epoch=0,
            loss=None,
            samples_total=0,
            compute_seconds=0.0,
            samples_per_second=0.0,
            time=get_dht_time(),
            client_mode=client_mode,
            auxiliary=auxiliary,
            device=device,
        )
        # What this peer saw the members of its rounds contribute (kit.metrics.attestations):
        # the coordinator credits the others with it, and this peer with theirs.
        self.attestor = RoundAttestor(node, run_id, identity, token=token)
        self._last_store = -float("inf")  # get_dht_time() of the last successful store
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def stores(self) -> int:
        """Successful stores (diagnostics, tests)."""
        return self._store.stores

    @property
    def key(self) -> str:
        return self._store.key

    @property
    def record(self) -> ContributionRecord:
        """The record as last updated (its ``time`` and ``token`` are set when stored)."""
        return self._record

    def start(self) -> None:
        """Start publishing (call on the runtime loop)."""
        if self._task is not None:
            raise KitUsageError("MetricsReporter.start() was called twice - help: call it once")
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._task = self._loop.create_task(self._run(), name="kit-metrics-reporter")
        self.attestor.start()

    def attest_round(self, epoch: int, result: AveragedRound) -> None:
        """Attest a gradient round's members and weights (``Optimizer.add_round_listener``;
        any thread)."""
        self.attestor.record(epoch, result)

    async def shutdown(self, *, final_store: bool = True) -> None:
        """Stop publishing; with ``final_store``, store the last counts first (bounded)."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await self.attestor.shutdown()
        if final_store:
            try:
                await asyncio.wait_for(self.publish(), FINAL_STORE_TIMEOUT)
            except (asyncio.TimeoutError, KitError) as e:
                logger.debug("the last metrics record was not stored: %r", e)

    def update(self, **fields: Any) -> None:
        """Change fields of the record (e.g. ``update(epoch=3, loss=2.1, samples_total=640)``).

        Raises:
            KitUsageError: a field that is not in :data:`UPDATABLE`.
        """
        unknown = set(fields) - UPDATABLE
        if unknown:
            raise KitUsageError(
                f"MetricsReporter.update got unknown fields {sorted(unknown)} - help: use "
                f"{sorted(UPDATABLE)}"
            )
        self._record = dataclasses.replace(self._record, **fields)
        loop, wake = self._loop, self._wake
        if loop is None or wake is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            wake.set()
        else:
            loop.call_soon_threadsafe(wake.set)

    async def publish(self) -> bool:
        """Store the current record now (on the runtime loop); True if a replica accepted it."""
        now = get_dht_time()
        record = dataclasses.replace(self._record, token=self._store.token(), time=now)
        stored = await self._store.store(record.to_dict(), now)
        if stored:
            self._last_store = now
        return stored

    @property
    def refresh_interval(self) -> float:
        """Seconds between stores of an unchanged record: rarer than changes, yet often enough
        for the peer to stay "online" (the book's 60 s window) and its record unexpired."""
        return min(3 * self.period, self.expiration / 3)

    async def _run(self) -> None:
        assert self._wake is not None  # set by start()
        last_attempt = -float("inf")
        published: ContributionRecord | None = None
        while True:
            interval = self.period if self._record is not published else self.refresh_interval
            delay = last_attempt + max(self.period, interval) - get_dht_time()
            if delay > 0:
                try:  # update() wakes us: a change after a quiet spell goes out at once
                    await asyncio.wait_for(self._wake.wait(), delay)
                except asyncio.TimeoutError:
                    pass
                self._wake.clear()
                continue
            last_attempt, published = get_dht_time(), self._record
            try:
                await self.publish()
            except KitError as e:  # the DHT recovers; try again after a period
                logger.debug("storing the metrics record failed: %s", e)
