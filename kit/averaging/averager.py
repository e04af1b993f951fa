"""``DecentralizedAverager``: average tensors with whichever peers are ready (hivemind's API).

Holds the round result (``RoundResult``), the averager on the event loop (``AsyncAverager``:
matchmaking, then one all-reduce under the tensors' lock) and its blocking facade
``DecentralizedAverager`` for training scripts and notebooks. The settings are in ``settings``;
the protocols in ``matchmaking`` / ``matchmaking_driver`` (who averages with whom) and
``allreduce`` (how).

Example::

    dht = kit.dht.DHT(initial_peers=[...])
    averager = DecentralizedAverager([model_weights], dht, prefix="my_run_params",
                                     target_group_size=16, min_matchmaking_time=5)
    result = averager.step(weight=samples_since_last_round, timeout=30)
    if result is not None and not result.is_full:
        print("averaged over", result.report)          # exactly which parts, over whom
    with averager.get_tensors() as tensors:             # the tensors, locked against rounds
        ...
    averager.shutdown()
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import logging
import math
import threading
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch

from kit.averaging.allreduce import AllReduceRunner, Timeouts, cancel_and_wait
from kit.averaging.chunk_stream import RoundBuffers
from kit.averaging.compression import (
    DTYPE_NAMES,
    CompressionBase,
    NoCompression,
    TensorDescriptor,
)
from kit.averaging.group import GroupInfo, schema_hash
from kit.averaging.matchmaking import MemberInfo, Phase
from kit.averaging.matchmaking_driver import AveragingRouter, MatchmakingDriver
from kit.averaging.partition import PartitionPlan, RoundReport
from kit.averaging.settings import AveragerSettings, check_tensors, chunk_elements
from kit.dht.node import DHTNode, get_dht_time
from kit.errors import (
    ConfigError,
    GroupMismatch,
    KitTimeout,
    KitUsageError,
    RemoteProtocolError,
)
from kit.p2p.api import StreamAPI
from kit.p2p.identity import PeerID

logger = logging.getLogger(__name__)

T = TypeVar("T")
BANDWIDTH_EMA_ALPHA = 0.3  # weight of the newest round in the measured bandwidth
MIN_MEASURED_BYTES = 2**20  # smaller rounds are latency-bound: they say nothing of bandwidth
MAX_WAITING_STREAMS = 64  # all-reduce streams that arrived before their round started here
IGNORED_HIVEMIND_OPTIONS = frozenset({"daemon", "shutdown_timeout", "declare_state_period"})
UNSUPPORTED_HIVEMIND_OPTIONS = frozenset(
    {"averaging_alpha", "state_compression", "tensor_infos", "allow_state_sharing"}
)
STAT_KEYS = (  # statistics() counters
    "full_rounds",  # every part averaged over every sender
    "partial_rounds",  # some parts or chunks averaged over fewer peers, or left local (reported)
    "aborted_rounds",  # the group disagreed: nothing written
    "no_group",  # no group formed before the step's timeout
    "bytes_sent",
    "bytes_received",
)
RECENT_ROUNDS = 32  # finished round ids remembered, to refuse their late streams at once


@dataclasses.dataclass(frozen=True)
class RoundResult:
    """What one ``step`` achieved. Iterating or ``len`` gives the group, as hivemind's dict does."""

    group_id: bytes  # the round's number, random per group
    peers: tuple[PeerID, ...]  # the group, in order (peer i aggregated part i)
    report: RoundReport  # per part and chunk: the peers it was averaged over (empty: kept local)
    plan: PartitionPlan  # where each part's chunks are in the tensors (report.parts[i] ~ plan.parts[i])
    matchmaking_time: float  # seconds until the group was known
    allreduce_time: float  # seconds of the all-reduce

    @property
    def is_full(self) -> bool:
        """Every part was averaged over every sender: the exact (weighted) average."""
        return self.report.is_full

    @property
    def unaveraged_parts(self) -> tuple[int, ...]:
        """Parts left at this peer's own values (their aggregator failed, or the deadline)."""
        return tuple(
            p.part_index for p in self.report.parts if p.chunk_peers and not any(p.chunk_peers)
        )

    def __len__(self) -> int:
        return len(self.peers)

    def __iter__(self) -> Iterator[PeerID]:
        return iter(self.peers)


class AsyncAverager:
    """The averager on the event loop (kit's runtime loop, or a test's). Use ``create``."""

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        node: DHTNode,
        settings: AveragerSettings,
        lock: threading.Lock | None = None,
    ) -> None:
        self.tensors = check_tensors(tensors)
        self.node, self.peer, self.settings = node, node.peer, settings
        self.lock = lock or threading.Lock()  # held by a round and by get_tensors()
        self.client_mode = (
            self.peer.client_mode if settings.client_mode is None else settings.client_mode
        )
        if self.peer.client_mode and not self.client_mode:
            raise ConfigError(
                "client_mode=False needs a peer that accepts connections, and the DHT's peer is "
                "in client mode - help: leave client_mode=None"
            )
        self.descriptors = [TensorDescriptor.from_tensor(t) for t in self.tensors]
        self.chunk_elements = chunk_elements(
            self.tensors, settings.compression, settings.part_size_bytes
        )
        self.schema = schema_hash(
            [
                (d.shape, DTYPE_NAMES[d.dtype], c)
                for d, c in zip(self.descriptors, self.chunk_elements, strict=True)
            ]
        )
        self.total_size = sum(t.numel() for t in self.tensors)
        self.bandwidth = settings.bandwidth  # measured when not given
        self.buffers = RoundBuffers()
        self._tasks: set[asyncio.Task[Any]] = set()
        self.matchmaking = MatchmakingDriver(
            node,
            settings.prefix,
            settings.matchmaking,
            self.schema,
            self.total_size,
            group_bits=settings.initial_group_bits,
            min_vector_size=settings.min_vector_size,
            spawn=self._spawn,
        )
        self._step_lock = asyncio.Lock()
        self._runners: dict[bytes, AllReduceRunner] = {}
        self._finished: collections.deque[bytes] = collections.deque(maxlen=RECENT_ROUNDS)
        self._registered = asyncio.Event()
        self._waiting_streams = 0
        self._router: AveragingRouter | None = None
        self.stats: collections.Counter[str] = collections.Counter(dict.fromkeys(STAT_KEYS, 0))
        self.last_round: dict[str, Any] = {}

    @classmethod
    async def create(
        cls,
        tensors: Sequence[torch.Tensor],
        node: DHTNode,
        settings: AveragerSettings,
        lock: threading.Lock | None = None,
    ) -> AsyncAverager:
        """Start serving the averaging protocols for ``settings.prefix`` on the node's peer.

        Raises:
            ConfigError: bad tensors, or another averager with this prefix on the same peer.
        """
        averager = cls(tensors, node, settings, lock)
        router = AveragingRouter.of(averager.peer)
        if settings.prefix in router.averagers:
            raise ConfigError(
                f"this peer already runs an averager with prefix {settings.prefix!r}"
                " - help: shut it down first, or use another prefix"
            )
        router.averagers[settings.prefix] = averager
        averager._router = router
        return averager

    def _spawn(self, work: Awaitable[T]) -> asyncio.Task[T]:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # --- a round ----------------------------------------------------------------------------

    async def step(
        self, weight: float | None = None, timeout: float | None = None
    ) -> RoundResult | None:
        """Find a group and average with it once.

        Args:
            weight: this peer's weight in the average (e.g. samples since the last round);
                default 1. Auxiliary peers have none.
            timeout: seconds to look for a group (default: min_matchmaking_time + 10 x
                request_timeout); the all-reduce is bounded by the settings' timeouts.

        Returns:
            What was averaged, or None if no group formed in time or the group disagreed.

        Raises:
            ConfigError: a weight that is not positive and finite.
        """
        if self.settings.auxiliary:
            weight = 0.0
        elif weight is None:
            weight = 1.0
        elif not (isinstance(weight, int | float) and 0 < weight < math.inf):
            raise ConfigError(f"weight={weight!r} must be positive - help: pass a sample count")
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            async with self._step_lock:
                return await self._step(float(weight), timeout)
        finally:
            if task is not None:
                self._tasks.discard(task)

    async def _step(self, weight: float, timeout: float | None) -> RoundResult | None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        me = MemberInfo(
            self.peer.peer_id,
            self.client_mode,
            self.settings.auxiliary,
            weight,
            self.bandwidth,
            () if self.client_mode else tuple(self.peer.get_visible_addresses()),
        )
        window = self.settings.default_step_timeout if timeout is None else timeout
        group = await self.matchmaking.find_group(me, get_dht_time() + window)
        matchmaking_time = loop.time() - started
        if group is None:
            self.stats["no_group"] += 1
            return None
        try:
            plan = PartitionPlan.build(self.descriptors, group.part_sizes, self.chunk_elements)
            report, runner = await self._run_allreduce(group, plan)
        finally:
            self.matchmaking.withdraw_after_round()  # not during it: see find_group
        allreduce_time = loop.time() - started - matchmaking_time
        if report is None:
            self.stats["aborted_rounds"] += 1
            return None
        self._measure(runner, allreduce_time)
        self.stats["full_rounds" if report.is_full else "partial_rounds"] += 1
        self.last_round = {
            "group_size": len(group),
            "is_full": report.is_full,
            "matchmaking_time": matchmaking_time,
            "allreduce_time": allreduce_time,
            "bytes_sent": runner.bytes_sent,
            "bytes_received": runner.bytes_received,
        }
        return RoundResult(
            group.group_id, group.peers, report, plan, matchmaking_time, allreduce_time
        )

    async def _run_allreduce(
        self, group: GroupInfo, plan: PartitionPlan
    ) -> tuple[RoundReport | None, AllReduceRunner]:
        for peer_id, addresses in zip(group.peers, group.addresses, strict=True):
            for address in addresses if peer_id != self.peer.peer_id else ():
                self.peer.add_address(peer_id, address)
        loop = asyncio.get_running_loop()
        deadline = None
        if self.settings.allreduce_timeout is not None:
            deadline = loop.time() + self.settings.allreduce_timeout
        timeouts = Timeouts(
            self.settings.request_timeout,
            self.settings.sender_timeout,
            self.settings.aggregator_timeout,
            deadline,
        )
        await self._acquire_tensors(self.settings.sender_timeout)
        try:
            runner = AllReduceRunner(
                self.peer,
                self.settings.prefix,
                group,
                self.tensors,
                plan,
                self.settings.compression,
                timeouts,
                self.buffers,
                self.settings.aggregation,
            )
            self._runners[group.group_id] = runner
            registered, self._registered = self._registered, asyncio.Event()
            registered.set()
            try:
                return await runner.run(), runner
            except GroupMismatch as e:
                logger.warning("%s: %s", self.settings.prefix, e)
                return None, runner
            finally:
                del self._runners[group.group_id]
                self._finished.append(group.group_id)
        finally:
            self.lock.release()

    async def _acquire_tensors(self, timeout: float) -> None:
        """Take the tensors' lock (a thread lock: user code holds it in get_tensors)."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + timeout
        while not self.lock.acquire(blocking=False):
            if loop.time() > give_up:
                raise KitTimeout(
                    f"the averaged tensors stayed locked for {timeout} s - help: do not hold "
                    "get_tensors() across a step()"
                )
            await asyncio.sleep(0.001)

    def _measure(self, runner: AllReduceRunner, seconds: float) -> None:
        moved = runner.bytes_sent + runner.bytes_received
        self.stats["bytes_sent"] += runner.bytes_sent
        self.stats["bytes_received"] += runner.bytes_received
        if self.settings.bandwidth is not None or moved < MIN_MEASURED_BYTES or seconds <= 0:
            return
        measured = moved / seconds
        previous = self.bandwidth
        self.bandwidth = (
            measured
            if previous is None
            else (1 - BANDWIDTH_EMA_ALPHA) * previous + BANDWIDTH_EMA_ALPHA * measured
        )

    async def serve_allreduce(self, stream: StreamAPI, header: dict[str, Any]) -> None:
        """An all-reduce stream of round ``header['group_id']``: hand it to that round's runner."""
        group_id = header["group_id"]
        runner = self._runners.get(group_id)
        if runner is None and group_id not in self._finished:
            if self._waiting_streams >= MAX_WAITING_STREAMS:
                raise RemoteProtocolError("too many all-reduce streams for unknown rounds")
            self._waiting_streams += 1  # the sender got the group a moment before we did
            try:
                give_up = asyncio.get_running_loop().time() + self.settings.request_timeout
                while runner is None:
                    left = give_up - asyncio.get_running_loop().time()
                    if left <= 0:
                        break
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._registered.wait(), left)
                    runner = self._runners.get(group_id)
            finally:
                self._waiting_streams -= 1
        if runner is None:
            raise RemoteProtocolError(f"no round {group_id.hex()[:16]} here (over, or never ours)")
        await runner.serve(stream, header)

    def statistics(self) -> dict[str, Any]:
        """Counters of rounds and bytes, the bandwidth estimate, and the last round's figures."""
        return {**self.stats, "bandwidth": self.bandwidth, "last_round": dict(self.last_round)}

    async def shutdown(self) -> None:
        """Stop serving and cancel every task of this averager (bounded)."""
        if self._router is not None and self._router.averagers.get(self.settings.prefix) is self:
            del self._router.averagers[self.settings.prefix]
        current = asyncio.current_task()
        await cancel_and_wait([task for task in self._tasks if task is not current], 5.0)


# --- the blocking facade ---------------------------------------------------------------------


class DecentralizedAverager:
    """Average ``averaged_tensors`` with peers of the same ``prefix``, in rounds (hivemind's API).

    The averager runs on the DHT's event loop (kit's one runtime loop); these methods block.

    Args:
        averaged_tensors: contiguous floating-point tensors, averaged in place.
        dht: a running ``kit.dht.DHT``; the averager uses its peer.
        start: start serving at once (else call ``run_in_background``).
        prefix, target_group_size, ...: see ``AveragerSettings`` (hivemind's names and meanings).
        compression: codec of every chunk (``kit.averaging.NoCompression`` by default).
        robust_aggregation, clip_tau, clip_iterations: ``"centered_clip"`` makes each peer
            reduce its part with CenteredClip instead of the weighted mean, so that a byzantine
            sender cannot drag the average (``kit.averaging.robust``: what it does not cover).

    Raises:
        ConfigError: bad settings or tensors.
    """

    def __init__(
        self,
        averaged_tensors: Sequence[torch.Tensor],
        dht: Any,
        *,
        start: bool = True,
        prefix: str,
        compression: CompressionBase | None = None,
        **settings: Any,
    ) -> None:
        self._tensors = check_tensors(averaged_tensors)
        self._dht = dht
        for name in IGNORED_HIVEMIND_OPTIONS & set(settings):
            logger.debug("DecentralizedAverager ignores hivemind's %s=%r", name, settings.pop(name))
        if "sender_timeout" in settings:  # hivemind's other name for it
            settings["next_chunk_timeout"] = settings.pop("sender_timeout")
        unsupported = UNSUPPORTED_HIVEMIND_OPTIONS & set(settings)
        if unsupported:
            raise ConfigError(
                f"kit's averager does not support {', '.join(sorted(unsupported))} - help: drop "
                "them (averaging_alpha is always 1; state sharing is kit.optim's job)"
            )
        self.settings = AveragerSettings(
            prefix=prefix, compression=compression or NoCompression(), **settings
        )
        self._lock = threading.Lock()
        self._core: AsyncAverager | None = None
        if start:
            self.run_in_background()

    def _submit(self, make: Callable[[DHTNode], Awaitable[T]]) -> concurrent.futures.Future[T]:
        async def run(dht: Any, node: DHTNode) -> T:
            return await make(node)

        future: concurrent.futures.Future[T] = self._dht.run_coroutine(run, return_future=True)
        return future

    def _wait(self, future: concurrent.futures.Future[T], timeout: float | None) -> T:
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise KitTimeout(f"the averager did not answer within {timeout} s") from None

    def run_in_background(self, await_ready: bool = True, timeout: float | None = 30.0) -> None:
        """Start serving (hivemind's name)."""
        if self._core is None:
            self._core = self._wait(
                self._submit(
                    lambda node: AsyncAverager.create(
                        self._tensors, node, self.settings, self._lock
                    )
                ),
                timeout,
            )

    def step(
        self, weight: float | None = None, timeout: float | None = None, wait: bool = True
    ) -> RoundResult | None | concurrent.futures.Future[RoundResult | None]:
        """Average once with a group (see ``AsyncAverager.step``); ``wait=False``: a Future."""
        core = self._require()
        future = self._submit(lambda node: core.step(weight, timeout))
        if not wait:
            return future
        bound = (self.settings.default_step_timeout if timeout is None else timeout) + (
            self.settings.allreduce_timeout or 600.0
        )
        return self._wait(future, bound + 30.0)

    def get_group_bits(self) -> str:
        """The group key suffix of the next rounds (hivemind's name)."""
        return self._require().matchmaking.group_bits

    def set_target_group_size(self, size: int | None) -> None:
        """Begin the next rounds as soon as ``size`` peers joined (None: wait min_matchmaking_time).

        The collaborative optimizer sets it to the number of peers it expects at its epoch, so a
        round does not idle for the whole matchmaking time once everyone is there. The
        ``target_group_size`` this averager was created with stays the largest group: more
        peers than that split into several groups.
        """
        cap = self.settings.target_group_size
        if cap is not None:
            size = cap if size is None else min(size, cap)
        matchmaking = self._require().matchmaking
        matchmaking.settings = dataclasses.replace(matchmaking.settings, target_group_size=size)

    def set_group_bits(self, group_bits: str) -> None:
        """Only averagers with the same group bits average together (e.g. the same epoch)."""
        if set(group_bits) - {"0", "1"}:
            raise ConfigError("group bits hold only 0 and 1 - help: e.g. format(epoch, '020b')")
        self._require().matchmaking.group_bits = group_bits

    @contextlib.contextmanager
    def get_tensors(self) -> Iterator[list[torch.Tensor]]:
        """The averaged tensors, locked: no round reads or writes them inside this block."""
        with self._lock:
            yield self._tensors

    def statistics(self) -> dict[str, Any]:
        return self._require().statistics()

    @property
    def bandwidth(self) -> float | None:
        """Measured (or given) bandwidth in bytes per second, used for load balancing."""
        return self._require().bandwidth

    @property
    def is_looking_for_group(self) -> bool:
        """A round is still forming its group (cancelling it now breaks nobody's all-reduce)."""
        core = self._core
        return core is not None and core.matchmaking.phase in (
            Phase.LOOKING,
            Phase.JOINING,
            Phase.LEADING,
        )

    def _require(self) -> AsyncAverager:
        if self._core is None:
            raise KitUsageError(
                "the averager is not running - help: create it with start=True, or call "
                "run_in_background()"
            )
        return self._core

    def shutdown(self) -> None:
        """Stop the averager (safe to call twice)."""
        core, self._core = self._core, None
        if core is not None and self._dht.is_alive():
            self._wait(self._submit(lambda node: core.shutdown()), 30.0)

    def __enter__(self) -> DecentralizedAverager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()
