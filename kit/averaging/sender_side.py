"""A sender's side of one all-reduce round: its parts out, the averages back, staged.

Holds ``SenderSide``: for each other aggregator of the group, this peer opens one stream
(``chunk_stream.PROTOCOL``), sends the round's header and then that part's chunks of its own
vector in order, compressed (raw values unchecked: the aggregator checks what it sums), while it
reads the averages coming back on the same stream. Each average is checked (the chunk expected,
a peer set within the group's senders, finite values) and kept, staged, as the values the round
writes into the tensors only when it ends
(``AllReduceRunner._commit``: all or nothing per part): raw values in the very frame they
arrived in (no copy before the commit), as are float16 values (the commit widens them as it
writes), others as decoded. With a lossy codec the aggregator sends ``delta`` (the compressed
difference between the average and what this peer sent), added to this peer's exact values
(a float16 difference as it arrived, by the commit): one rounding of a small difference instead
of a second rounding of the whole average (``kit.averaging.averages``).

Separate from ``allreduce`` (the round: which parts, the aggregator's side, the report and the
commit) because a sender's streams are a concern of their own: they meet the round only where a
part is dropped (its aggregator unreachable, or seeing another group: the callbacks) and where
the staged averages are written back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from kit.averaging.averages import UNCHECKED_RAW
from kit.averaging.chunk_stream import (
    PROTOCOL,
    RoundBuffers,
    arrived_values,
    chunk_head,
    decode_chunk,
    decode_peer_set,
    payload_bound,
    payload_of,
    receive_chunk,
    send_chunk,
    tensor_header,
)
from kit.averaging.compression import CompressionBase, NoCompression, is_finite, reused_empty
from kit.averaging.group import GroupInfo
from kit.averaging.partition import ChunkSpec, PartitionPlan, PartReport
from kit.averaging.round_tasks import RoundTasks
from kit.averaging.widening import WIDE_FLOATS, add_widened
from kit.errors import (
    InvalidTensor,
    KitTimeout,
    NonFiniteLocalTensor,
    PeerError,
    PeerUnavailable,
    RemoteError,
    RemoteProtocolError,
)
from kit.p2p import wire
from kit.p2p.api import PeerAPI, StreamAPI
from kit.p2p.identity import PeerID

logger = logging.getLogger("kit.averaging.allreduce")  # the round's log, as before the split


class SenderSide:
    """This peer's streams to the other aggregators of one round (it sends a vector)."""

    def __init__(
        self,
        peer: PeerAPI,
        prefix: str,
        group: GroupInfo,
        tensors: Sequence[torch.Tensor],
        plan: PartitionPlan,
        compression: CompressionBase,
        buffers: RoundBuffers,
        tasks: RoundTasks,
        sender_bits: Mapping[PeerID, int],
        unreachable: Callable[[PeerID], None],
        abort: Callable[[str], None],
    ) -> None:
        """``sender_bits``: each sender's bit in an average's peer set; ``unreachable(member)``:
        a member's connection is gone; ``abort(reason)``: an aggregator sees another group."""
        self.peer, self.prefix, self.group = peer, prefix, group
        self.tensors, self.plan, self.compression = tensors, plan, compression
        self.buffers, self.tasks, self.timeouts = buffers, tasks, tasks.timeouts
        self.sender_bits, self._unreachable, self._abort = sender_bits, unreachable, abort
        self.averages: dict[tuple[int, int], torch.Tensor] = {}  # (part, chunk): staged values
        self._differences: set[tuple[int, int]] = set()  # staged: a float16 difference to ours
        self._raw = type(compression) is NoCompression  # (not a subclass, not adaptive)
        self.bytes_sent = 0
        self.bytes_received = 0

    def commit(self, target: torch.Tensor, spec: ChunkSpec) -> None:
        """Write the received average of chunk ``spec`` into ``target`` (its view of the
        tensors): copied (float16 values widened as they are written), or, for a staged
        difference, added to our values in place (one pass: ours + difference is never staged)."""
        staged = self.averages[(spec.part_index, spec.chunk_index)]
        if (spec.part_index, spec.chunk_index) not in self._differences:
            target.copy_(staged)
        elif target.device.type == "cpu":
            add_widened(target, target, staged)
        else:
            target.add_(staged.to(target.device))

    def release(self) -> None:
        """The round is over: let go of the staged frames (their buffers are then reused)."""
        self.averages.clear()
        self._differences.clear()

    async def exchange_part(self, k: int) -> PartReport:
        """Send part ``k`` to its aggregator and stage the averages it sends back.

        Raises:
            PeerError, KitTimeout, asyncio.TimeoutError: the part is dropped (left local).
        """
        aggregator = self.group.peers[k]
        try:
            stream = await self.peer.open_stream(
                aggregator, PROTOCOL, timeout=self.timeouts.connect
            )
        except PeerUnavailable:
            self._unreachable(aggregator)
            raise
        sending: asyncio.Task[None] | None = None
        try:
            header = {
                "prefix": self.prefix,
                "group_id": self.group.group_id,
                "group_hash": self.group.hash,
                "part": k,
            }
            await stream.send_message(
                wire.packb(header), timeout=self.tasks.remaining(self.timeouts.connect)
            )
            sending = self.tasks.spawn(self._send_part(stream, k))
            chunk_peers = await self._receive_averages(stream, k)
            await asyncio.wait_for(sending, self.tasks.remaining(self.timeouts.reducer))
        except BaseException as e:
            if sending is not None:
                sending.cancel()
            stream.reset("cancelled", type(e).__name__)
            if isinstance(e, PeerUnavailable):  # its connection is gone: it will not send either
                self._unreachable(aggregator)
            if isinstance(e, RemoteError) and "GroupMismatch" in e.message:
                self._abort(f"aggregator {aggregator.short()} sees another group: {e.message}")
            elif isinstance(e, PeerError | KitTimeout | asyncio.TimeoutError):
                logger.info("part %d from %s dropped: %s", k, aggregator.short(), e)
            raise
        senders = frozenset(self.group.peers[i] for i in self.group.senders)
        return PartReport(k, senders, chunk_peers)

    async def _send_part(self, stream: StreamAPI, k: int) -> None:
        try:
            await self._send_chunks(stream, k)
        except BaseException as e:  # the aggregator must not wait for the rest
            stream.reset("cancelled", type(e).__name__)
            if isinstance(e, NonFiniteLocalTensor):
                logger.warning("part %d not sent: this peer's tensors hold NaN or inf", k)
            raise

    async def _send_chunks(self, stream: StreamAPI, k: int) -> None:
        for spec, view in self.plan.iter_part(self.tensors, k):
            info = self.plan.compression_info(spec)
            # Raw values go unchecked: the aggregator checks what it sums (kit.averaging.reducer),
            # and a pass here would only repeat that (a NaN chunk of ours is left out there).
            # Only for a plain NoCompression: any other codec sees every chunk, as in hivemind.
            codec = UNCHECKED_RAW if self._raw else self.compression
            serialized = codec.compress(view, info)
            payload = memoryview(serialized.buffer).cast("B")
            head = chunk_head({"chunk": spec.chunk_index, **serialized.header()})
            await send_chunk(stream, head, payload, self.tasks.remaining(self.timeouts.reducer))
            self.bytes_sent += len(payload)
        self.tasks.mark(f"queued_part{k}")  # all handed to the connection (not yet on the wire)
        await stream.close()

    async def _receive_averages(self, stream: StreamAPI, k: int) -> tuple[frozenset[PeerID], ...]:
        chunk_peers = []
        allowed = sum(self.sender_bits.values())
        for spec in self.plan.parts[k]:
            timeout = self.tasks.remaining(self.timeouts.reducer)
            bound = payload_bound(spec, self.plan.tensors[spec.tensor_index].dtype.itemsize)
            received = await receive_chunk(stream, bound, timeout)
            if received is None or received[0]["chunk"] != spec.chunk_index:
                raise RemoteProtocolError(f"expected the average of chunk {spec.chunk_index}")
            header, payload = received
            mask = decode_peer_set(header.get("peers"))
            if mask is None or mask & ~allowed:
                raise RemoteProtocolError(f"chunk {spec.chunk_index}: bad peer set {mask!r:.40}")
            if mask:
                self._stage_average(header, payload, spec)
            elif len(payload):
                raise RemoteProtocolError(f"chunk {spec.chunk_index}: a payload, yet no peers")
            chunk_peers.append(frozenset(p for p, bit in self.sender_bits.items() if mask & bit))
            if len(chunk_peers) == 1:
                self.tasks.mark(f"first_average_of_part{k}")
        self.tasks.mark(f"got_part{k}")
        return tuple(chunk_peers)

    def _stage_average(self, header: dict[str, Any], payload: memoryview, spec: ChunkSpec) -> None:
        """Check a received average (or this peer's difference to it) and stage it."""
        dtype = self.plan.tensors[spec.tensor_index].dtype
        delta = header.get("delta", False)
        if not isinstance(delta, bool):
            raise RemoteProtocolError(f"chunk {spec.chunk_index}: delta must be true or false")
        codec_header = tensor_header(header, spec, payload_bound(spec, dtype.itemsize))
        payload = payload_of(codec_header, payload)
        self.bytes_received += len(payload)
        arrived = arrived_values(codec_header, payload, spec, dtype)  # the frame's buffer is ours
        if not delta and arrived is not None:  # staged in the frame (float16: the commit's copy
            # widens it, one pass where decoding first wrote, and faulted in, a float32 copy)
            values = arrived
        elif (
            delta
            and arrived is not None
            and arrived.dtype == torch.float16
            and dtype in WIDE_FLOATS
        ):
            # A float16 difference, staged as it arrived and added to our values at the commit
            # (the tensors are locked for the round: ours do not change meanwhile). Checking it
            # checks the sum: finite float32 values plus a finite float16 difference (at most
            # 65504) are finite unless ours are within 65504 of float32's largest, 3.4e38.
            values = arrived
            self._differences.add((spec.part_index, spec.chunk_index))
        elif delta and arrived is not None and dtype in WIDE_FLOATS:
            # our exact values plus the raw difference, into a reused buffer (no decoded copy)
            values = reused_empty(spec.size, dtype)
            add_widened(values, self.plan.chunk_view(self.tensors, spec).cpu(), arrived)
        else:  # decoded into a new tensor (checked below, a difference once added to ours)
            values = decode_chunk(codec_header, payload, spec, dtype, check_finite=False)
            if delta:  # our exact values plus the compressed difference to the average
                values.add_(self.plan.chunk_view(self.tensors, spec))
        if not is_finite(values):
            raise InvalidTensor(f"the average of chunk {spec.chunk_index} holds NaN or inf")
        self.averages[(spec.part_index, spec.chunk_index)] = values
