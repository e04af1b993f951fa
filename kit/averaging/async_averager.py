"""The averager on the event loop: matchmaking, then one all-reduce under the tensors' lock.

Holds ``RoundResult`` (what one step achieved) and ``AsyncAverager`` (one averager's steps,
their retries within the deadline, the all-reduce streams it serves, its state sharing). The
blocking facade for scripts and notebooks is ``DecentralizedAverager`` (``kit.averaging.averager``);
a step's stage and trigger are in ``kit.averaging.control``; the protocols in ``matchmaking`` /
``matchmaking_driver`` (who averages with whom), ``allreduce`` (how) and ``state_sharing``.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import math
import threading
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch

from kit.averaging.allreduce import AllReduceRunner, AveragingMode, Timeouts, cancel_and_wait
from kit.averaging.balancing import BandwidthEstimate
from kit.averaging.chunk_stream import RoundBuffers
from kit.averaging.compression import DTYPE_NAMES, TensorDescriptor
from kit.averaging.control import AveragingStage, StepControl
from kit.averaging.declarations import MemberInfo
from kit.averaging.group import GroupInfo, schema_hash
from kit.averaging.matchmaking_driver import MatchmakingDriver
from kit.averaging.partition import PartitionPlan, RoundReport, chunk_scale
from kit.averaging.router import AveragingRouter
from kit.averaging.served_rounds import ServedRounds
from kit.averaging.settings import (
    AveragerSettings,
    check_infos,
    check_tensors,
    chunk_elements,
)
from kit.averaging.state_sharing import StateSharing
from kit.dht.node import DHTNode, get_dht_time
from kit.errors import AveragingFailed, ConfigError, GroupMismatch, KitTimeout
from kit.p2p.api import StreamAPI
from kit.p2p.identity import PeerID

logger = logging.getLogger(__name__)

T = TypeVar("T")
RETRY_PAUSE = 0.1  # s between a failed round and the next search (a group failing at once)
STAT_KEYS = (  # statistics() counters
    "full_rounds",  # every part averaged over every sender
    "partial_rounds",  # some parts or chunks averaged over fewer peers, or left local (reported)
    "aborted_rounds",  # the group disagreed: nothing written
    "no_group",  # no group formed before the step's timeout
    "bytes_sent",
    "bytes_received",
)


@dataclasses.dataclass(frozen=True)
class RoundResult:
    """What one ``step`` achieved. Iterating or ``len`` gives the group, as hivemind's dict does."""

    group_id: bytes  # the round's number, random per group
    peers: tuple[PeerID, ...]  # the group, in order (peer i aggregated part i)
    report: RoundReport  # per part and chunk: the peers it was averaged over (empty: kept local)
    plan: PartitionPlan  # where each part's chunks are in the tensors (report.parts[i] ~ plan.parts[i])
    matchmaking_time: float  # seconds until the group was known
    allreduce_time: float  # seconds of the all-reduce
    weights: tuple[float, ...] = ()  # each member's weight in the average, as the group agreed

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

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self.peers


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
        # The averaging role (hivemind's client_mode): True aggregates nothing and never leads.
        # Explicit in the settings, else decided by whether others can connect to this peer
        # directly (``PeerAPI.can_accept``), not by whether it listens (``client_mode``): a
        # client-mode peer behind a NAT it can punch through aggregates like a public one. This
        # is the role at creation (state sharing, ``mode``); each round asks again (``_member``).
        self.client_mode = (
            not self.peer.can_accept if settings.client_mode is None else settings.client_mode
        )
        if not self.peer.can_accept and not self.client_mode:
            raise ConfigError(
                "client_mode=False needs a peer that others can connect to (it listens, or can "
                "punch through its NAT), and the DHT's peer cannot accept connections - help: "
                "leave client_mode=None"
            )
        self.descriptors = [TensorDescriptor.from_tensor(t) for t in self.tensors]
        self.infos = check_infos(settings.tensor_infos, self.tensors)  # what codecs see
        self.chunk_elements = chunk_elements(
            self.tensors, settings.compression, settings.part_size_bytes, self.infos
        )
        self.schema = schema_hash(
            [
                (d.shape, DTYPE_NAMES[d.dtype], c)
                for d, c in zip(self.descriptors, self.chunk_elements, strict=True)
            ]
        )
        self.total_size = sum(t.numel() for t in self.tensors)
        self.measured = BandwidthEstimate()  # from its rounds (``bandwidth``)
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
            chunk_scale=lambda bandwidths, part_sizes: chunk_scale(
                bandwidths, part_sizes, self.chunk_elements, settings.part_size_bytes
            ),
        )
        self.sharing: StateSharing | None = None  # serves get_current_state() (not clients)
        self._step_lock = asyncio.Lock()
        self.rounds = ServedRounds(settings.request_timeout)  # whom all-reduce streams reach
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
        *,
        get_state: Callable[[], Sequence[Any]] | None = None,
        share_state: bool = False,
        state_priority: float = 0.0,
    ) -> AsyncAverager:
        """Start serving the averaging protocols for ``settings.prefix`` on the node's peer.

        ``get_state`` (unless in client mode): what ``state_sharing.StateSharing`` serves to
        peers that load the state; ``share_state`` and ``state_priority`` its initial settings.

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
        if get_state is not None and not averager.client_mode:
            averager.sharing = StateSharing(
                node,
                settings.prefix,
                get_state,
                allow=share_state,
                priority=state_priority,
                declare_period=settings.declare_state_period,
                answer_timeout=max(settings.request_timeout, settings.sender_timeout),
            )
            averager.sharing.start()
        return averager

    @property
    def mode(self) -> AveragingMode:
        """This peer's role in its rounds (hivemind's ``averager.mode``)."""
        if self.client_mode:
            return AveragingMode.CLIENT
        return AveragingMode.AUX if self.settings.auxiliary else AveragingMode.NODE

    def _spawn(self, work: Awaitable[T]) -> asyncio.Task[T]:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # --- a step -------------------------------------------------------------------------------

    def make_control(
        self,
        *,
        weight: float | None = None,
        timeout: float | None = None,
        scheduled_time: float | None = None,
        allow_retries: bool = True,
    ) -> StepControl:
        """A new step's control (not started: see ``run_step``).

        Args:
            weight: this peer's weight in the average (e.g. samples since the last round);
                default 1. Auxiliary peers have none.
            timeout: seconds to look for a group (default: until scheduled_time, then 10 x
                request_timeout); the all-reduce is bounded by the settings' timeouts.
            scheduled_time: DHT time at which to begin the round (default: now +
                min_matchmaking_time); a leader waits for followers until then.
            allow_retries: after a failed search or round, try again until the deadline.

        Raises:
            ConfigError: a weight that is not positive and finite, or a scheduled_time that is
                not before the deadline.
        """
        if self.settings.auxiliary:
            if weight is not None:
                logger.debug("%s: an auxiliary averager has no weight", self.settings.prefix)
            weight = 0.0
        elif weight is None:
            weight = 1.0
        elif not (isinstance(weight, int | float) and 0 < weight < math.inf):
            raise ConfigError(f"weight={weight!r} must be positive - help: pass a sample count")
        now = get_dht_time()
        scheduled = now + self.settings.min_matchmaking_time
        if scheduled_time is not None:
            scheduled = scheduled_time
        if timeout is None:
            deadline = max(scheduled, now) + 10 * self.settings.request_timeout
        else:
            deadline = now + timeout
        if scheduled_time is None:
            scheduled = min(scheduled, deadline)
        elif not scheduled < deadline:
            raise ConfigError(
                f"scheduled_time is {scheduled - now:.2f} s from now, not before the step's "
                f"timeout ({deadline - now:.2f} s) - help: pass a longer timeout"
            )
        return StepControl(scheduled, deadline, allow_retries, float(weight))

    async def step(
        self,
        weight: float | None = None,
        timeout: float | None = None,
        scheduled_time: float | None = None,
    ) -> RoundResult | None:
        """Find a group and average with it once (one try: kit's asynchronous API).

        ``scheduled_time``: as in :meth:`make_control` (a leader waits for followers until then).

        Returns:
            What was averaged, or None if no group formed in time or the group disagreed.

        Raises:
            ConfigError: a weight that is not positive and finite.
        """
        control = self.make_control(
            weight=weight, timeout=timeout, scheduled_time=scheduled_time, allow_retries=False
        )
        control.allow_allreduce()
        try:
            return await self.run_step(control)
        except AveragingFailed as e:
            logger.info("%s: %s", self.settings.prefix, e)
            return None

    async def run_step(self, control: StepControl) -> RoundResult:
        """Run the step of ``control``: search, wait for its trigger, all-reduce; retried after a
        failure until its deadline if it allows retries. Its result is set on ``control`` too.

        Raises:
            AveragingFailed: no group before the deadline, or every round failed.
            asyncio.CancelledError: the caller cancelled ``control`` (before the all-reduce).
        """
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)

        def cancel_task() -> None:  # called by control.cancel(), from any thread
            if task is not None and not loop.is_closed():
                loop.call_soon_threadsafe(task.cancel)

        control.attach(cancel_task)
        try:
            async with self._step_lock:
                result = await self._attempts(control)
        except asyncio.CancelledError:
            control.finish(
                error=AveragingFailed("the step was cancelled (or the averager shut down)")
            )
            raise
        except BaseException as e:
            control.finish(error=e)
            raise
        else:
            control.finish(result)
            return result
        finally:
            if task is not None:
                self._tasks.discard(task)

    async def _attempts(self, control: StepControl) -> RoundResult:
        while True:
            control.advance(AveragingStage.LOOKING_FOR_GROUP)
            try:
                return await self._attempt(control)
            except AveragingFailed as e:
                if not control.allow_retries or get_dht_time() + RETRY_PAUSE >= control.deadline:
                    raise
                logger.info("%s: %s; looking for a group again", self.settings.prefix, e)
                await asyncio.sleep(RETRY_PAUSE)

    def _member(self, weight: float) -> MemberInfo:
        """What this peer brings to its next group. Unless told, it aggregates if others can
        connect to it now (``can_accept`` may change: a peer whose punches keep failing stops);
        an aggregator declares the addresses others reach it at (a client-mode peer's relayed
        ones: dials there are hole punched), and one that has none yet (not registered with a
        relay) is a client this round."""
        client = self.settings.client_mode
        if client is None:
            client = not self.peer.can_accept
        addresses = () if client else tuple(self.peer.get_visible_addresses())
        client = client or (not addresses and not self.settings.auxiliary)
        return MemberInfo(
            self.peer.peer_id,
            client,
            self.settings.auxiliary,
            weight,
            self.bandwidth,
            () if client else addresses,
        )

    async def _attempt(self, control: StepControl) -> RoundResult:
        loop = asyncio.get_running_loop()
        started = loop.time()
        me = self._member(control.weight)
        group = await self.matchmaking.find_group(me, control.deadline, control.scheduled_time)
        matchmaking_time = loop.time() - started
        if group is None:
            self.stats["no_group"] += 1
            raise AveragingFailed(
                f"no group of at least {self.settings.min_group_size} peers formed in time - "
                "help: check that other peers run with this prefix, or raise the timeout"
            )
        try:
            if not control.triggered:
                await self._await_trigger(control, group)
            control.advance(AveragingStage.RUNNING_ALLREDUCE)
            scaled = [elements * group.chunk_scale for elements in self.chunk_elements]
            plan = PartitionPlan.build(self.descriptors, group.part_sizes, scaled, self.infos)
            report, runner = await self._run_allreduce(group, plan)
        finally:
            self.matchmaking.withdraw_after_round()  # not during it: see find_group
        allreduce_time = loop.time() - started - matchmaking_time
        if report is None:
            self.stats["aborted_rounds"] += 1
            raise AveragingFailed("the group disagreed about itself: nothing was averaged")
        self._measure(runner, group, allreduce_time)
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
            group.group_id,
            group.peers,
            report,
            plan,
            matchmaking_time,
            allreduce_time,
            group.weights,
        )

    async def _await_trigger(self, control: StepControl, group: GroupInfo) -> None:
        """The group is known: wait for ``allow_allreduce()``. The others' streams of this
        round wait for it meanwhile (``serve_allreduce``); past ``sender_timeout`` they go on
        without this peer, so waiting longer than that (or the deadline) is of no use."""
        control.advance(AveragingStage.AWAITING_TRIGGER)
        with self.rounds.awaiting_trigger(group.group_id):
            patience = max(control.deadline - get_dht_time(), self.settings.sender_timeout)
            if not await control.wait_for_trigger(patience):
                raise AveragingFailed(
                    f"allow_allreduce() was not called within {patience:.1f} s of the group "
                    "forming - help: trigger the step sooner, or use require_trigger=False"
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
                self.settings.lossy_deltas,
            )
            with self.rounds.running(group.group_id, runner):
                try:
                    return await runner.run(), runner
                except GroupMismatch as e:
                    logger.warning("%s: %s", self.settings.prefix, e)
                    return None, runner
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

    @property
    def bandwidth(self) -> float | None:
        """What this peer tells the LP: the bandwidth it was given, else the measured one."""
        given = self.settings.bandwidth
        return given if given is not None else self.measured.bytes_per_s

    def _measure(self, runner: AllReduceRunner, group: GroupInfo, seconds: float) -> None:
        moved = runner.bytes_sent + runner.bytes_received
        self.stats["bytes_sent"] += runner.bytes_sent
        self.stats["bytes_received"] += runner.bytes_received
        me = runner.me
        self.measured = self.measured.after_round(
            moved,
            seconds,
            could_aggregate=not group.client_mode[me],
            aggregated=group.part_sizes[me] > 0,
        )

    async def serve_allreduce(self, stream: StreamAPI, header: dict[str, Any]) -> None:
        """An all-reduce stream of round ``header['group_id']``: hand it to that round's runner
        (``ServedRounds.runner_for``: it may wait, bounded, for the round to begin here)."""
        runner = await self.rounds.runner_for(header["group_id"])
        await runner.serve(stream, header)

    def statistics(self) -> dict[str, Any]:
        """Counters of rounds and bytes, the bandwidth estimate, and the last round's figures."""
        return {**self.stats, "bandwidth": self.bandwidth, "last_round": dict(self.last_round)}

    async def shutdown(self) -> None:
        """Stop serving and cancel every task of this averager (bounded)."""
        if self._router is not None and self._router.averagers.get(self.settings.prefix) is self:
            del self._router.averagers[self.settings.prefix]
        if self.sharing is not None:
            await self.sharing.shutdown()
        current = asyncio.current_task()
        await cancel_and_wait([task for task in self._tasks if task is not current], 5.0)
