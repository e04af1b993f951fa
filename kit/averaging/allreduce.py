"""One butterfly all-reduce round of one peer in an assembled group, over ``kit.p2p`` streams.

Holds ``AllReduceRunner`` (this peer's side of one round: it streams its vector's parts to their
aggregators, aggregates its own part from everyone, and writes the averages back). It does not
hold group assembly (``matchmaking``), the bookkeeping of chunks (``partition``), how a chunk
travels and is checked (``chunk_stream``), how the round's tasks and deadline are owned
(``round_tasks``, whose ``Timeouts`` are importable from here too) or the sender's streams to the
other aggregators (``sender_side``: its parts out, the averages back, staged).

Butterfly all-reduce (DeDLOC §3.2, hivemind's ``AllReduceRunner``): peer i of the group owns part
i of the flat vector. Every sender opens one stream to each other aggregator and sends that
part's chunks in order; the aggregator adds each chunk, weighted, to a float32 accumulator, and as
soon as a chunk has been received from every sender, streams its average back on every sender's
stream. Sending, summing and receiving overlap (except with ``robust_aggregation="centered_clip"``:
the aggregator then keeps every sender's part and sends the averages once the part is complete,
``kit.averaging.robust``). A client-mode peer dials aggregators (through a
relay if need be) and aggregates nothing; an auxiliary peer aggregates and sends nothing.

Stream ``kit/averaging/allreduce/2`` (sender -> aggregator, both ways on one stream)::

    sender:     {prefix, group_id, group_hash, part}   then per chunk: {chunk, tensor header} payload
    aggregator: per chunk: {chunk, peers (bit i = member i is in this average), delta, tensor
                header} payload (none when peers = 0)

With a lossless codec every sender gets the average itself, the same bytes for all (so a full
round leaves every member bit-identical). With a lossy one (fp16, 8-bit) each sender gets
``delta``: the compressed difference between the average and what it sent, which it adds to its
own exact values, as hivemind does: its result then carries one rounding of a small difference
instead of a second rounding of the whole average (hivemind's fp16 test bound, 1e-5 MSE, holds).

What is honest here: a sender that stops is excluded from the chunks it had not delivered (the
others' weights renormalised, ``PartReducer``); a part whose aggregator fails before its last
chunk is left at the local values (all or nothing, so no peer holds a half-averaged part);
a part the aggregator cannot finish before the deadline is left local everywhere too; averages
are written into the tensors only when the round ends, so an aborted round changes nothing; and
the ``RoundReport`` lists, per chunk, exactly whom it was averaged over.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Sequence
from typing import Any

import torch

from kit.averaging.averages import OutgoingAverages
from kit.averaging.background_threads import limit_torch_threads, with_limited_torch_threads
from kit.averaging.chunk_stream import (
    RoundBuffers,
    arrived_values,
    decode_chunk,
    payload_bound,
    payload_of,
    receive_chunk,
    send_chunk,
    tensor_header,
)
from kit.averaging.compression import CompressionBase
from kit.averaging.group import GroupInfo
from kit.averaging.partition import ChunkSpec, PartitionPlan, PartReport, RoundReport
from kit.averaging.reducer import PartReducer
from kit.averaging.robust import Aggregation, ClippedPartReducer
from kit.averaging.round_tasks import RoundTasks, Timeouts
from kit.averaging.sender_side import SenderSide
from kit.errors import (
    GroupMismatch,
    InvalidChunk,
    InvalidTensor,
    KitTimeout,
    NothingToAggregate,
    PeerError,
    RemoteProtocolError,
)
from kit.p2p.api import PeerAPI, StreamAPI
from kit.p2p.identity import PeerID
from kit.runtime import cancel_and_wait

logger = logging.getLogger(__name__)

# cancel_and_wait and Timeouts: importable from here, where the averaging modules took them from.
__all__ = ["AllReduceRunner", "AveragingMode", "Timeouts", "cancel_and_wait"]


class AveragingMode(enum.Enum):
    """A member's role in a round (hivemind's names and values)."""

    NODE = 0  # sends its vector and aggregates a part
    CLIENT = 1  # accepts no connections: sends its vector, aggregates nothing
    AUX = 2  # aggregates a part, sends no vector of its own (weight 0)


class AllReduceRunner:
    """This peer's side of one round. Create it, register it for incoming streams, ``run`` it."""

    def __init__(
        self,
        peer: PeerAPI,
        prefix: str,
        group: GroupInfo,
        tensors: Sequence[torch.Tensor],
        plan: PartitionPlan,
        compression: CompressionBase,
        timeouts: Timeouts,
        buffers: RoundBuffers,
        aggregation: Aggregation | None = None,
        lossy_deltas: bool = True,
    ) -> None:
        """``aggregation``: how this peer reduces its own part; None or "mean": the streamed
        weighted mean; "centered_clip": ``kit.averaging.robust`` (the whole part is gathered
        first, so its averages go back only once every sender's part is in). ``lossy_deltas``:
        see ``OutgoingAverages``."""
        me = group.index(peer.peer_id)
        assert me is not None, "the runner's peer must be a member of the group"
        self.peer, self.prefix, self.group, self.me = peer, prefix, group, me
        self.tensors, self.plan, self.compression = list(tensors), plan, compression
        self.timeouts, self.buffers = timeouts, buffers
        self.tasks = RoundTasks(timeouts)  # every task of the round, its deadline and timeline
        self.sends = not group.auxiliary[me]
        self.reducer: PartReducer | None = None
        if plan.part_sizes[me] > 0:
            senders = {group.peers[i]: group.weights[i] for i in group.senders}
            if aggregation is not None and aggregation.method == "centered_clip":
                self.reducer = ClippedPartReducer(
                    plan, me, senders, group.group_id, aggregation, self._non_finite
                )
            else:
                self.reducer = PartReducer(
                    plan,
                    me,
                    senders,
                    group.group_id,
                    buffers.accumulator_for(plan.part_sizes[me]),
                    on_non_finite=self._non_finite,
                    local_sender=peer.peer_id,
                )
        self.sender_bits = {group.peers[i]: 1 << i for i in group.senders}
        self.sender: SenderSide | None = None  # our vector's parts out, the averages staged
        if self.sends:
            self.sender = SenderSide(
                peer,
                prefix,
                group,
                self.tensors,
                plan,
                compression,
                buffers,
                self.tasks,
                self.sender_bits,
                unreachable=self._unreachable,
                abort=self._abort,
            )
        self._averages = (  # what each sender's stream gets for each chunk of our part
            None
            if self.reducer is None
            else OutgoingAverages(
                plan, self.reducer, compression, self.sender_bits, deltas=lossy_deltas
            )
        )
        self._ready = 0  # chunks 0.._ready-1 of our part are averaged and encoded
        self._progress = asyncio.Event()
        self._connected: set[PeerID] = set()  # senders that opened a stream (or were excluded)
        self._writers: set[asyncio.Task[None]] = set()
        self._bytes_out = 0  # averages sent on the streams this peer serves as an aggregator
        self._bytes_in = 0  # chunks received on them

    @property
    def bytes_sent(self) -> int:
        """Payload bytes this peer sent in the round: its chunks, and the averages of its part."""
        return self._bytes_out + (self.sender.bytes_sent if self.sender is not None else 0)

    @property
    def bytes_received(self) -> int:
        """Payload bytes this peer received in the round: averages, and chunks of its part."""
        return self._bytes_in + (self.sender.bytes_received if self.sender is not None else 0)

    # --- the round ----------------------------------------------------------------------------

    async def run(self) -> RoundReport:
        """Run the round until every part is done or the deadline; return what was averaged.

        Raises:
            GroupMismatch: a member disagreed about the group; nothing was written.
        """
        limit_torch_threads()  # the training thread owns the cores (background_threads says why)
        self.tasks.mark("start")
        try:
            sender = self.sender
            exchanges = {
                k: self.tasks.spawn(sender.exchange_part(k))
                for k in range(len(self.group))
                if k != self.me and self.plan.part_sizes[k] > 0 and sender is not None
            }
            reducing = self.tasks.spawn(self._reduce()) if self.reducer is not None else None
            waiting = set(exchanges.values()) | ({reducing} if reducing is not None else set())
            if waiting:
                await asyncio.wait(waiting, timeout=self.tasks.remaining())
            if self.tasks.bug is not None:
                raise self.tasks.bug
            if self.tasks.aborted is not None:
                raise GroupMismatch(f"round aborted: {self.tasks.aborted}")
            parts = [self._report(k, exchanges.get(k)) for k in range(len(self.group))]
            self._commit(parts)
            self.tasks.mark("committed")
            self._log_timeline()
            return RoundReport(tuple(parts))
        finally:
            await self.tasks.close()
            self._release()

    def _release(self) -> None:
        """Let go of the round's received frames now: a runner sits in reference cycles (its
        tasks, their callbacks) that only the cyclic GC frees, seldom, and the averages it
        staged are as large as the vector (measured: +40 MB a round per peer until a GC)."""
        if self.sender is not None:
            self.sender.release()
        if self._averages is not None:
            self._averages.release()

    def _log_timeline(self) -> None:
        """One debug line: when each phase of this peer's round ended, from the round's start
        (where a round's time goes: sending, the last input, the last average out and in)."""
        if logger.isEnabledFor(logging.DEBUG):
            timeline = self.tasks.timeline()
            logger.debug("round %s timeline: %s", self.group.group_id.hex()[:8], timeline)

    def _abort(self, reason: str) -> None:
        logger.warning("averaging round %s aborted: %s", self.group.group_id.hex()[:8], reason)
        self.tasks.abort(reason)

    def _fail(self, bug: Exception) -> None:
        """A bug of ours broke the round: stop now, not at the timeouts (members see our streams
        reset and go on without our part); :meth:`run` raises ``bug``."""
        logger.error("round %s failed on this peer", self.group.group_id.hex()[:8], exc_info=bug)
        self.tasks.fail(bug)
        progress, self._progress = self._progress, asyncio.Event()
        progress.set()  # and whoever waits for averages learns it now

    def _report(self, k: int, exchange: asyncio.Task[Any] | None) -> PartReport:
        senders = frozenset(self.group.peers[i] for i in self.group.senders)
        if k == self.me:
            reducer = self.reducer
            if reducer is None:
                return PartReport(k, senders, ())
            clipping = isinstance(reducer, ClippedPartReducer) and not reducer.computed
            if not clipping and all(reducer.is_complete(c) for c in range(len(reducer.chunks))):
                return reducer.report()
            # Cut off by the deadline: the senders will not get the rest either, so nobody
            # writes this part (all or nothing, as for a part whose aggregator failed).
            return PartReport.missing(k, senders, len(reducer.chunks))
        if exchange is None:  # an empty part, or an auxiliary peer's (it has no values)
            return PartReport(k, senders, ())
        if exchange.done() and not exchange.cancelled() and exchange.exception() is None:
            report: PartReport = exchange.result()
            return report
        return PartReport.missing(k, senders, len(self.plan.parts[k]))

    def _commit(self, parts: Sequence[PartReport]) -> None:
        """Write the averages into the tensors, now that the round is over (all or nothing)."""
        if self.sender is None:
            return  # auxiliary peers hold no values of their own
        for part in parts:
            for spec, peers in zip(self.plan.parts[part.part_index], part.chunk_peers, strict=True):
                if not peers:
                    continue
                target = self.plan.chunk_view(self.tensors, spec)
                if part.part_index == self.me:
                    assert self._averages is not None
                    averaged = self._averages.local_average(spec.chunk_index)
                    if averaged is not None:
                        target.copy_(averaged)
                else:
                    self.sender.commit(target, spec)

    # --- aggregator side -----------------------------------------------------------------------

    def _unreachable(self, member: PeerID) -> None:
        """``member`` cannot be reached: if it has not streamed to us yet, it never will."""
        reducer = self.reducer
        if reducer is not None and member in reducer.weights and member not in self._connected:
            logger.info("excluding %s from part %d: unreachable", member.short(), self.me)
            self._connected.add(member)
            self._completed(reducer.exclude(member))

    async def _reduce(self) -> None:
        """Add this peer's own chunks, exclude senders that never connect, and wait until every
        average has gone out on every sender's stream."""
        reducer = self.reducer
        assert reducer is not None
        me = self.group.peers[self.me]
        gid = self.group.group_id
        # Chunks nobody sends (every member auxiliary) are complete already: with no sender to
        # wait for, the round must not wait at all (allreduce_timeout may be None).
        self._completed([c for c in range(len(reducer.chunks)) if reducer.is_complete(c)])
        if self.sends:
            for spec, view in self.plan.iter_part(self.tensors, self.me):
                self._completed(reducer.accept(me, gid, self.me, spec.chunk_index, view))
                await asyncio.sleep(0)  # let streams in (and parts out) while our part is summed
        while self._ready < self._part_chunks:
            try:
                await self._wait_progress(self._ready, self.tasks.remaining(self.timeouts.sender))
            except asyncio.TimeoutError:
                if self.tasks.remaining() == 0:
                    return
                # Senders that never opened a stream are gone (or never got the group); those
                # that did are timed out by their own readers.
                for sender in [p for p in reducer.weights if p not in self._connected and p != me]:
                    logger.info(
                        "excluding %s from part %d: it sent nothing", sender.short(), self.me
                    )
                    self._connected.add(sender)
                    self._completed(reducer.exclude(sender))
        if self._writers:
            await asyncio.wait(list(self._writers), timeout=self.tasks.remaining())
        self.tasks.mark("own_all_sent")

    def _non_finite(self, sender: PeerID, chunk: int) -> None:
        """``sender``'s chunk of our part held NaN or inf: it was averaged without it."""
        if sender == self.peer.peer_id:
            logger.warning(
                "own chunk %d of part %d not averaged: this peer's tensors hold NaN or inf",
                chunk,
                self.me,
            )
        else:
            logger.info("chunk %d from %s left out: NaN or inf", chunk, sender.short())

    def _completed(self, chunks: Sequence[int]) -> None:
        """These chunks of our part are averaged: encode each once for every sender's stream."""
        if not chunks:
            return
        reducer = self.reducer
        if isinstance(reducer, ClippedPartReducer) and not reducer.computed:
            self.tasks.spawn(self._clip_then_complete(reducer, chunks))
            return
        assert self._averages is not None
        try:
            for chunk in chunks:
                self._averages.complete(chunk)
        except Exception as e:  # our bug (e.g. a codec's encoder): end the round now, loudly
            self._fail(e)
            raise  # and the task that met it (its stream is reset: the sender learns it)
        self._advance()
        if self._ready >= 1:
            self.tasks.mark("own_first_averaged")
        if self._ready == self._part_chunks:
            self.tasks.mark("own_all_averaged")

    async def _clip_then_complete(self, reducer: ClippedPartReducer, chunks: Sequence[int]) -> None:
        # CenteredClip reads senders x part a few dozen times: off the event loop, which also
        # serves the DHT and the other streams. The reducer writes only its own buffers.
        try:
            await asyncio.to_thread(with_limited_torch_threads(reducer.compute))
        except NothingToAggregate as e:  # nobody gets this part: it stays local everywhere
            logger.warning("part %d not averaged: %s", self.me, e)
            assert self._averages is not None
            for chunk in chunks:
                self._averages.nobody(chunk)
            self._advance()
            return
        self._completed(chunks)

    @property
    def _part_chunks(self) -> int:
        return 0 if self._averages is None else len(self._averages)

    def _advance(self) -> None:
        averages = self._averages
        while averages is not None and self._ready < len(averages) and averages.done(self._ready):
            self._ready += 1
        progress, self._progress = self._progress, asyncio.Event()
        progress.set()  # wakes every waiter of this generation; later waiters get the new event

    async def _wait_progress(self, ready: int, timeout: float | None) -> None:
        """Wait until more than ``ready`` chunks are averaged (asyncio.TimeoutError after timeout)."""
        while self._ready <= ready:
            if self.tasks.bug is not None:
                raise self.tasks.bug  # the round is over (a cancellation may be lost, gh-86296)
            await asyncio.wait_for(self._progress.wait(), timeout)

    async def serve(self, stream: StreamAPI, header: dict[str, Any]) -> None:
        """Serve one sender's stream (its header already read by the averager's router).

        Raises:
            GroupMismatch: the sender's group hash differs from ours (this round is aborted).
            RemoteProtocolError: the stream does not belong in this round.
        """
        sender = stream.remote_peer
        reducer = self.reducer
        if header.get("group_hash") != self.group.hash:
            self._abort(f"{sender.short()} sees another group (hash mismatch)")
            raise GroupMismatch(f"{sender.short()} sent another group hash")
        if reducer is None or header.get("part") != self.me or sender not in reducer.weights:
            raise RemoteProtocolError(f"{sender.short()} is not a sender of part {self.me}")
        if sender in self._connected or self.tasks.closed:
            raise RemoteProtocolError(f"{sender.short()} cannot stream part {self.me} now")
        self._connected.add(sender)
        # The work is the runner's task, not this handler's: a connection that drops cancels
        # its handlers, and the sender must still be excluded then.
        serving = self.tasks.spawn(self._serve_sender(stream, sender))
        await asyncio.wait({serving}, timeout=self.tasks.remaining())

    async def _serve_sender(self, stream: StreamAPI, sender: PeerID) -> None:
        reducer = self.reducer
        assert reducer is not None
        writing = self.tasks.spawn(self._write_averages(stream, sender))
        self._writers.add(writing)
        writing.add_done_callback(self._writers.discard)
        try:
            await self._read_sender(stream, sender)
        except (PeerError, KitTimeout, asyncio.TimeoutError) as e:
            logger.info("excluding %s from part %d: %s", sender.short(), self.me, e)
            writing.cancel()
            stream.reset("cancelled", "excluded from the round")
            self._completed(reducer.exclude(sender))
            return
        await asyncio.wait({writing}, timeout=self.tasks.remaining())
        if not writing.done() or writing.cancelled() or writing.exception() is not None:
            writing.cancel()
            stream.reset("cancelled", "the averages could not be sent")

    async def _read_sender(self, stream: StreamAPI, sender: PeerID) -> None:
        reducer = self.reducer
        assert reducer is not None
        for spec in reducer.chunks:
            bound = payload_bound(spec, self.plan.tensors[spec.tensor_index].dtype.itemsize)
            received = await receive_chunk(
                stream, bound, self.tasks.remaining(self.timeouts.sender)
            )
            if received is None:
                raise RemoteProtocolError(f"{sender.short()} ended its part early")
            header, payload = received
            codec_header = tensor_header(header, spec, bound)
            payload = payload_of(codec_header, payload)
            self._bytes_in += len(payload)
            self._completed(self._add_chunk(sender, header["chunk"], codec_header, payload, spec))

    def _add_chunk(
        self,
        sender: PeerID,
        chunk: int,
        header: dict[str, Any],
        payload: memoryview,
        spec: ChunkSpec,
    ) -> tuple[int, ...]:
        """Decode one received chunk and add it; a chunk that fails a check is dropped alone.
        Values that need no decoding are summed from the frame they arrived in."""
        reducer = self.reducer
        assert reducer is not None
        gid, dtype = self.group.group_id, self.plan.tensors[spec.tensor_index].dtype
        values = arrived_values(header, payload, spec, dtype)
        arrived = values is not None
        try:
            if values is None:
                values = decode_chunk(header, payload, spec, dtype, check_finite=False)
        except InvalidTensor as e:
            logger.info("chunk %d from %s rejected: %s", chunk, sender.short(), e)
            return reducer.reject(sender, gid, self.me, chunk)
        try:
            completed = reducer.accept(sender, gid, self.me, chunk, values)
            if self._averages is not None and self._averages.lossy[chunk]:  # for its delta
                # the frame's buffer is ours to keep; decoded values are kept encoded (smaller)
                sent = values if arrived else (header, payload)
                self._averages.keep_sent(sender, chunk, sent)
            return completed
        except InvalidChunk as e:
            if e.reason not in ("size", "dtype"):
                raise  # out of order, or not a sender: the stream is broken
            logger.info("chunk from %s rejected: %s", sender.short(), e.message)
            return e.completed

    async def _write_averages(self, stream: StreamAPI, sender: PeerID) -> None:
        assert self._averages is not None
        for chunk in range(len(self._averages)):
            if chunk >= self._ready:
                try:
                    await self._wait_progress(chunk, self.tasks.remaining(self.timeouts.reducer))
                except asyncio.TimeoutError:
                    raise KitTimeout(f"no average of chunk {chunk} in time") from None
            head, payload = self._averages.for_sender(sender, chunk)
            await send_chunk(stream, head, payload, self.tasks.remaining(self.timeouts.sender))
            self._bytes_out += 0 if payload is None else len(payload)
        await stream.close()
