"""Collaboration-wide training progress: who is at which epoch with how many samples, and when
the next global step (an "epoch") will happen.

Every peer publishes an owner-signed record under ``{run_id}_progress`` (subkey: its
``[owner:...]`` marker, so nobody can forge another peer's progress): its epoch, the samples it
accumulated toward the current global batch, its samples/s, and whether it is a client or an
auxiliary peer. Every peer reads all records and reduces them (:func:`aggregate`, pure) to a
:class:`GlobalProgress`: the global epoch, the samples accumulated toward ``target_batch_size``,
peer counts, and the ETA of the next step (DeDLOC §3.1: each device accumulates at its own pace
until the collaboration reaches the target batch).

The ETA extrapolates each peer's samples at its measured rate since its last report, as
hivemind's ProgressTracker does. Records refresh faster as the step approaches (the fetch period
is a fraction of the ETA, clipped to ``[min_refresh_period, max_refresh_period]``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any

from kit.averaging.allreduce import cancel_and_wait
from kit.dht.node import DHTNode, get_dht_time
from kit.dht.validation import Ed25519SignatureValidator
from kit.errors import ConfigError, KitError, TransientError
from kit.optim.splits import ROUND_HISTORY, RoundTag

logger = logging.getLogger(__name__)

#: hivemind ProgressTracker options that tune its own refresh heuristics: accepted, unused.
IGNORED_HIVEMIND_OPTIONS = frozenset(
    {"default_refresh_period", "expected_drift_peers", "expected_drift_rate", "status_loglevel"}
)


@dataclass(frozen=True)
class LocalProgress:
    """What one peer reports (hivemind's LocalTrainingProgress, plus ``auxiliary``)."""

    peer_id: bytes
    epoch: int
    samples_accumulated: int
    samples_per_second: float
    time: float
    client_mode: bool
    auxiliary: bool = False
    drifted: bool = False  # its parameters may differ from the others': it asks for state averaging
    rounds: tuple[RoundTag, ...] = ()  # its last gradient rounds (kit.optim.splits)

    def to_dict(self) -> dict[str, Any]:
        return {
            "peer_id": self.peer_id,
            "epoch": self.epoch,
            "samples_accumulated": self.samples_accumulated,
            "samples_per_second": self.samples_per_second,
            "time": self.time,
            "client_mode": self.client_mode,
            "auxiliary": self.auxiliary,
            "drifted": self.drifted,
            "rounds": [tag.to_wire() for tag in self.rounds],
        }

    @classmethod
    def from_dict(cls, body: Any) -> LocalProgress | None:
        """Parse a record from the DHT; None (and a debug line) for anything malformed."""
        try:
            record = cls(
                peer_id=bytes(body["peer_id"]),
                epoch=int(body["epoch"]),
                samples_accumulated=int(body["samples_accumulated"]),
                samples_per_second=float(body["samples_per_second"]),
                time=float(body["time"]),
                client_mode=bool(body["client_mode"]),
                auxiliary=bool(body.get("auxiliary", False)),
                drifted=bool(body.get("drifted", False)),
                rounds=_round_tags(body.get("rounds", [])),
            )
        except (KeyError, TypeError, ValueError):
            logger.debug("ignoring a malformed progress record: %.200r", body)
            return None
        numbers_ok = all(math.isfinite(x) for x in (record.samples_per_second, record.time))
        if (
            record.epoch < 0
            or record.samples_accumulated < 0
            or record.samples_per_second < 0
            or not numbers_ok
        ):
            return None
        return record


def _round_tags(body: Any) -> tuple[RoundTag, ...]:
    if not isinstance(body, list | tuple) or len(body) > ROUND_HISTORY:
        raise ValueError(f"rounds: a list of at most {ROUND_HISTORY} tags")
    return tuple(RoundTag.from_wire(tag) for tag in body)


@dataclass(frozen=True)
class GlobalProgress:
    """The collaboration as this peer sees it (hivemind's GlobalTrainingProgress)."""

    epoch: int  # the highest epoch any peer reports
    samples_accumulated: int  # reported toward the current epoch's target batch
    target_batch_size: int
    num_peers: int  # peers seen (all epochs)
    num_clients: int  # of which in client mode
    eta_next_epoch: float  # seconds until the target is reached, extrapolated
    next_fetch_time: float  # when to read the records again (absolute DHT time)

    @property
    def ready(self) -> bool:
        return self.samples_accumulated >= self.target_batch_size


def aggregate(
    records: list[LocalProgress],
    target_batch_size: int,
    now: float,
    *,
    min_refresh_period: float = 0.5,
    max_refresh_period: float = 10.0,
) -> GlobalProgress:
    """Reduce peers' records to the global progress (pure: ``now`` is given).

    Samples count only from peers at the global epoch: a peer still at an older epoch is about
    to catch up (download state) and its samples belong to a batch that was already applied.
    """
    if not records:
        return GlobalProgress(0, 0, target_batch_size, 0, 0, math.inf, now + min_refresh_period)
    epoch = max(record.epoch for record in records)
    current = [record for record in records if record.epoch == epoch]
    reported = sum(record.samples_accumulated for record in current)
    extrapolated = sum(
        record.samples_accumulated + record.samples_per_second * max(0.0, now - record.time)
        for record in current
    )
    rate = sum(record.samples_per_second for record in records if not record.auxiliary)
    remaining = max(0.0, target_batch_size - extrapolated)
    eta = remaining / rate if rate > 0 else (0.0 if remaining == 0 else math.inf)
    refresh = min(
        max_refresh_period,
        max(min_refresh_period, eta / 2 if math.isfinite(eta) else max_refresh_period),
    )
    return GlobalProgress(
        epoch=epoch,
        samples_accumulated=reported,
        target_batch_size=target_batch_size,
        num_peers=len(records),
        num_clients=sum(record.client_mode for record in records),
        eta_next_epoch=eta,
        next_fetch_time=now + refresh,
    )


class PerformanceEMA:
    """This peer's samples per second, smoothed (hivemind's ``tracker.performance_ema``).

    An exponential moving average of the rate between consecutive reports of one epoch; the
    time of a global step (between epochs) is not counted, as hivemind pauses it then.
    """

    def __init__(self, alpha: float = 0.1) -> None:
        self.alpha = alpha
        self.samples_per_second = 0.0

    def update(self, samples: int, seconds: float) -> float:
        """``samples`` were processed in ``seconds``; returns the new estimate."""
        if samples > 0 and seconds > 0:
            instant = samples / seconds
            previous = self.samples_per_second
            alpha = self.alpha
            self.samples_per_second = (
                instant if previous == 0 else (1 - alpha) * previous + alpha * instant
            )
        return self.samples_per_second

    def __repr__(self) -> str:
        return f"PerformanceEMA({self.samples_per_second:.3f} samples/s)"


class ProgressTracker:
    """Publishes this peer's progress and keeps the global view fresh (a task on the runtime loop).

    Args:
        node: the running DHT node.
        prefix: the run id; records live under ``f"{prefix}_progress"``.
        target_batch_size: samples per global step.
        identity: this peer's key (signs its records).
        client_mode, auxiliary: what this peer reports about itself.
        min_refresh_period, max_refresh_period: bounds of the fetch period. Lower the minimum
            if peers enter averaging late on a fast local swarm; raise the maximum on big swarms.
        metadata_expiration: lifetime of a record; a peer silent for longer is forgotten.
        performance_ema_alpha: smoothing of the samples/s estimate.
        private_key: hivemind's name for ``identity`` (overrides it): the key signing records.
        measure_reports: update ``performance_ema`` from the reports' sample counts (False:
            the caller measures, as kit.Optimizer does per step).
        **hivemind_options: hivemind's tuning knobs with no meaning here
            (``default_refresh_period``, ``expected_drift_peers``, ``expected_drift_rate``,
            ``status_loglevel``) are accepted and ignored; others raise ConfigError.
    """

    def __init__(
        self,
        node: DHTNode,
        prefix: str,
        target_batch_size: int,
        *,
        identity: Any,
        client_mode: bool,
        auxiliary: bool = False,
        min_refresh_period: float = 0.5,
        max_refresh_period: float = 10.0,
        metadata_expiration: float = 60.0,
        performance_ema_alpha: float = 0.1,
        private_key: Any = None,
        measure_reports: bool = True,
        **hivemind_options: Any,
    ) -> None:
        unknown = set(hivemind_options) - IGNORED_HIVEMIND_OPTIONS
        if unknown:
            raise ConfigError(
                f"ProgressTracker got unknown options {sorted(unknown)} - help: see "
                "help(kit.optim.ProgressTracker)"
            )
        identity = private_key if private_key is not None else identity
        self.node = node
        self.key = f"{prefix}_progress"
        self.target_batch_size = target_batch_size
        self.client_mode = client_mode
        self.auxiliary = auxiliary
        self.min_refresh_period = min_refresh_period
        self.max_refresh_period = max_refresh_period
        self.metadata_expiration = metadata_expiration
        self.performance_ema = PerformanceEMA(performance_ema_alpha)
        self.measure_reports = measure_reports
        self._validator = Ed25519SignatureValidator(identity)
        node.add_validators([self._validator])
        self._subkey = self._validator.local_owner
        self._peer_id = node.peer_id.to_bytes()
        self.drifted = False
        self.round_tags: tuple[RoundTag, ...] = ()  # our last gradient rounds, published
        self.local = LocalProgress(self._peer_id, 0, 0, 0.0, get_dht_time(), client_mode, auxiliary)
        self._others: list[LocalProgress] = []  # other peers' records, as last fetched
        self._others_samples: dict[int, int] = {}  # their reported samples, by epoch
        self._last_report_time: float | None = None
        self.fetched_at: float | None = None  # DHT time of the last fetch of the others' records
        self.saw_others = False  # some fetch found another peer's record (since start)
        self._wake = asyncio.Event()
        self._fetched = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake_requested = False  # a wake-up is on its way to the loop
        self._publish_due = False  # a changed record waits for the next periodic publish

    def start(self) -> None:
        """Start publishing and fetching (call it on the runtime loop)."""
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.ensure_future(self._run())

    async def shutdown(self) -> None:
        if self._task is not None:  # cancelled again until it ends (CPython gh-86296)
            await cancel_and_wait([self._task], 5.0)

    # --- local progress ------------------------------------------------------------------

    def report_local_progress(self, epoch: int, samples_accumulated: int) -> None:
        """Record progress (called from the training thread, at every step).

        Published at once when it matters to the others (a new epoch; the collaboration reaching
        the target batch with these samples, as far as this peer can tell), else with the next
        periodic publish, at most ``min_refresh_period`` later: a DHT store costs ~2 ms of CPU
        over both peers, too much for every 15 ms step, and the others extrapolate our samples
        from our rate meanwhile (``aggregate``).
        """
        now = get_dht_time()
        previous = self.local
        added = samples_accumulated - previous.samples_accumulated
        if self.measure_reports and epoch == previous.epoch and added > 0:
            self.performance_ema.update(added, now - (self._last_report_time or now))
        rate = self.performance_ema.samples_per_second
        self._last_report_time = now
        self.local = LocalProgress(
            self._peer_id,
            epoch,
            samples_accumulated,
            rate,
            now,
            self.client_mode,
            self.auxiliary,
            self.drifted,
            self.round_tags,
        )
        others = self._others_samples.get(epoch, 0)
        reaches_target = (
            previous.samples_accumulated + others
            < self.target_batch_size
            <= samples_accumulated + others
        )
        if epoch != previous.epoch or reaches_target:
            self._wake_soon()
        elif not self._publish_due:
            self._publish_due = True
            self._wake_soon(delay=self.min_refresh_period)

    def set_drifted(self, drifted: bool) -> None:
        """Tell the others whether this peer's parameters may differ from theirs (published now)."""
        if drifted != self.drifted:
            self.drifted = drifted
            self.local = dataclasses.replace(self.local, drifted=drifted)
            self._wake_soon()

    def add_round(self, tag: RoundTag) -> None:
        """Tell the others which group our last gradient round had (published now)."""
        self.round_tags = (*self.round_tags, tag)[-ROUND_HISTORY:]
        self.local = dataclasses.replace(self.local, rounds=self.round_tags)
        self._wake_soon()

    def others_round_tags(self) -> list[tuple[bytes, tuple[RoundTag, ...]]]:
        """The other peers' last gradient rounds, as last fetched: (peer id, tags)."""
        return [(r.peer_id, r.rounds) for r in self._others if r.rounds]

    def _wake_soon(self, delay: float = 0.0) -> None:
        """Wake the publishing task (now, or after ``delay`` s) from any thread.

        ``asyncio.Event`` is not thread-safe (setting it from the training thread raced with the
        loop: "deque mutated during iteration", and the loop slept on): the wake-up goes
        through ``call_soon_threadsafe``, at most one at a time.
        """
        loop = self._loop
        if loop is None or (self._wake_requested and delay == 0.0):
            return  # not started yet (the task publishes first thing), or a wake-up is coming
        if delay == 0.0:
            self._wake_requested = True
        try:
            loop.call_soon_threadsafe(self._on_wake_request, delay)
        except RuntimeError:  # the loop is closed: shutting down
            pass

    def _on_wake_request(self, delay: float) -> None:
        if delay > 0.0:
            assert self._loop is not None
            self._loop.call_later(delay, self._on_wake_request, 0.0)
            return
        self._wake_requested = False
        self._wake.set()

    def others_drifted(self, epoch: int) -> bool:
        """Some other peer at ``epoch`` or one behind reports drifted parameters."""
        return any(r.drifted and r.epoch >= epoch - 1 for r in self._others)

    @property
    def global_progress(self) -> GlobalProgress:
        """The others' last fetched records with this peer's current one."""
        return aggregate(
            [self.local, *self._others],
            self.target_batch_size,
            get_dht_time(),
            min_refresh_period=self.min_refresh_period,
            max_refresh_period=self.max_refresh_period,
        )

    def peers_at_epoch(self, epoch: int, *, with_samples: bool = False) -> int:
        """Peers (this one included) whose last record is at ``epoch`` or, for auxiliary peers, any.

        ``with_samples``: only those that reported samples at ``epoch`` (and auxiliary peers):
        the ones that will join its gradient round. A peer that just downloaded the state has
        none yet; waiting for it would cost a whole matchmaking_time.
        """

        def counts(record: LocalProgress) -> bool:
            if record.auxiliary:
                return True
            return record.epoch == epoch and (record.samples_accumulated > 0 or not with_samples)

        return sum(1 for r in self._others if counts(r)) + (1 if counts(self.local) else 0)

    def samples_at_epoch(self, epoch: int) -> int:
        """Samples the peers at ``epoch`` reported (this one included): the global batch."""
        records = [self.local, *self._others]
        return sum(r.samples_accumulated for r in records if r.epoch == epoch)

    def others_at_epoch(self, epoch: int) -> int:
        """Other training peers (not auxiliary) whose last record is at ``epoch``."""
        return sum(1 for r in self._others if r.epoch == epoch and not r.auxiliary)

    @property
    def global_epoch(self) -> int:
        """The collaboration's epoch as this peer sees it (hivemind's name)."""
        return self.global_progress.epoch

    def is_alive(self) -> bool:
        """Publishing and fetching (False once shut down)."""
        return self._task is not None and not self._task.done()

    @property
    def ready_to_update_epoch(self) -> bool:
        """The collaboration has the target batch for our epoch, or has moved past it."""
        progress = self.global_progress
        return progress.epoch > self.local.epoch or (
            progress.epoch == self.local.epoch and progress.ready
        )

    async def wait_for_update(self, timeout: float) -> GlobalProgress:
        """Fetch the global progress now (at most ``timeout`` seconds)."""
        self._fetched.clear()
        self._wake.set()
        try:
            await asyncio.wait_for(self._fetched.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        return self.global_progress

    # --- the background loop -------------------------------------------------------------

    async def _run(self) -> None:
        published: LocalProgress | None = None
        while True:
            self._wake.clear()  # a wake-up while we publish and fetch runs the loop once more
            try:
                if self.local != published:
                    published = self.local
                    self._publish_due = False
                    await self.node.store(
                        self.key,
                        published.to_dict(),
                        get_dht_time() + self.metadata_expiration,
                        subkey=self._subkey,
                    )
                others = await self._fetch()
                samples: dict[int, int] = {}
                for record in others:
                    samples[record.epoch] = (
                        samples.get(record.epoch, 0) + record.samples_accumulated
                    )
                self._others, self._others_samples = others, samples
                self.saw_others = self.saw_others or bool(others)
                if self.fetched_at is None:
                    logger.debug(
                        "first look at the collaboration: %d other peers, epoch %d",
                        len(others),
                        max((r.epoch for r in others), default=0),
                    )
                self.fetched_at = get_dht_time()
                self._fetched.set()
            except (TransientError, KitError) as e:  # keep tracking: the DHT recovers
                logger.debug("progress update failed: %s", e)
            delay = max(0.0, self.global_progress.next_fetch_time - get_dht_time())
            try:
                await asyncio.wait_for(self._wake.wait(), min(delay, self.max_refresh_period))
            except asyncio.TimeoutError:
                pass

    async def _fetch(self) -> list[LocalProgress]:
        result = await self.node.get(self.key, latest=True)
        records = []
        if result is not None and isinstance(result.value, dict):
            for subkey, entry in result.value.items():
                if subkey == self._subkey:
                    continue
                record = LocalProgress.from_dict(getattr(entry, "value", None))
                if record is not None and record.peer_id != self._peer_id:
                    records.append(record)
        return records
