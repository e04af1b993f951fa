"""What an aggregator sends back for each chunk of its part: the average, or a sender's difference.

Holds ``OutgoingAverages`` (per chunk of this peer's part, once the reducer completed it: one
encoding of the average for every sender, or, with a lossy codec, each sender's own difference
from what it sent) and ``is_lossless``. It does not reduce anything (``partition``/``robust``)
or touch a stream (``allreduce``).

Why differences (hivemind's ``AllReduceRunner`` returns deltas too): with a lossy codec a sender
that received the compressed average would carry a second rounding of the whole average. It
receives ``compress(average - sent)`` instead and adds it to its own exact values, so only a
small difference is rounded (fp16: mean squared error under hivemind's 1e-5 bound). A lossless
codec sends the average itself, the same bytes for every sender: a full exact round leaves every
member bit-identical, which kit.optim relies on.

Why not always (``deltas=False``, ``AveragerSettings.lossy_deltas``): a difference is as large as
the distance between a sender's values and the average. For parameters (peers close to each
other) that is small and the delta wins; for gradients of different batches it is about as large
as the gradient itself, while the average of N of them is ~sqrt(N) smaller, so one shared
compressed average has the smaller error (measured, ``benchmarks/allreduce.py`` on independent
vectors, 4 peers: fp16 1.5e-3 shared vs 3.2e-3 deltas; uniform 8-bit 1.13 vs 1.87), and every
member gets the same bytes. kit.Optimizer's gradient rounds use the shared average.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any

import torch

from kit.averaging.adaptive_compression import AdaptiveCompressionBase
from kit.averaging.chunk_stream import arrived_values, chunk_head, decode_chunk, encode_peer_set
from kit.averaging.compression import (
    CompressionBase,
    CompressionInfo,
    Float16Compression,
    NoCompression,
    extract,
    reused_empty,
)
from kit.averaging.partition import PartitionPlan
from kit.averaging.reducer import PartReducer
from kit.averaging.widening import add_widened
from kit.errors import NonFiniteLocalTensor

#: Raw values sent unchecked: for values already checked, or checked by whoever sums them
#: (every aggregator checks what it adds, ``kit.averaging.reducer``): the same bytes as
#: NoCompression's, without its pass over them.
UNCHECKED_RAW = NoCompression(allow_non_finite=True)

Encoded = tuple[bytes, memoryview | None]  # a chunk_head, then its payload (None: no payload)
Sent = torch.Tensor | tuple[dict[str, Any], memoryview]  # a sender's chunk: values, or encoded


def leaf_codec(compression: CompressionBase, info: CompressionInfo) -> CompressionBase:
    """The codec ``compression`` encodes this chunk with (adaptive codecs choose one)."""
    codec = compression
    while isinstance(codec, AdaptiveCompressionBase):
        codec = codec.choose_compression(info)
    return codec


def is_lossless(compression: CompressionBase, info: CompressionInfo) -> bool:
    """Whether ``compression`` sends this chunk exactly (NoCompression, possibly adaptively)."""
    return isinstance(leaf_codec(compression, info), NoCompression)


class OutgoingAverages:
    """The averages of one part, as each sender's stream gets them.

    Args:
        plan, reducer: the round's plan and this peer's reducer of its part.
        compression: the codec of the chunks.
        sender_bits: per sender, its bit in a chunk's ``peers`` mask.
        deltas: with a lossy codec, send each sender its own difference (True, hivemind's
            scheme) or one compressed average to everyone (False).
    """

    def __init__(
        self,
        plan: PartitionPlan,
        reducer: PartReducer,
        compression: CompressionBase,
        sender_bits: Mapping[Any, int],
        deltas: bool = True,
    ) -> None:
        self.plan, self.reducer, self.compression = plan, reducer, compression
        self.sender_bits = sender_bits
        rounded = [not is_lossless(compression, plan.compression_info(c)) for c in reducer.chunks]
        # float32 chunks of a plain NoCompression (any other codec sees every chunk, as in
        # hivemind) whose reducer checked the average: sent as they are
        self._checked = [
            reducer.checks_averages
            and type(compression) is NoCompression
            and plan.tensors[c.tensor_index].dtype == torch.float32
            for c in reducer.chunks
        ]
        self.lossy = [deltas and r for r in rounded]  # chunks whose senders get their own delta
        # deltas=False: lossy chunks of the shared average; this peer keeps the decoded bytes
        # too, so every member of the round ends with the same values
        self._rounded: list[torch.Tensor | None] | None = None if deltas else [None] * len(rounded)
        self._shared_lossy = [not deltas and r for r in rounded]
        self._shared: list[Encoded | None] = [None] * len(reducer.chunks)  # lossless, or empty
        self._done = [False] * len(reducer.chunks)
        self._sent: dict[tuple[Hashable, int], Sent] = {}  # lossy chunks: what each sender sent

    def __len__(self) -> int:
        return len(self._done)

    def release(self) -> None:
        """The round is over: drop what senders sent (their frames), the encodings and the rounded
        averages (their buffers are reused once dropped: ``kit.p2p.payload_pool``)."""
        self._sent.clear()
        self._shared = [None] * len(self._shared)
        if self._rounded is not None:
            self._rounded = [None] * len(self._rounded)

    def done(self, chunk: int) -> bool:
        return self._done[chunk]

    def keep_sent(self, sender: Hashable, chunk: int, sent: Sent) -> None:
        """Keep what ``sender`` sent for ``chunk`` (accepted into the average) for its delta."""
        if 0 <= chunk < len(self.lossy) and self.lossy[chunk]:
            self._sent[(sender, chunk)] = sent

    def complete(self, chunk: int) -> None:
        """The reducer completed ``chunk``: encode it now, unless senders get their own deltas."""
        if self.reducer.averaged(chunk) is None:
            self.nobody(chunk)
            return
        if not self.lossy[chunk]:
            self._shared[chunk] = self._encode(chunk, None)
        self._done[chunk] = True

    def local_average(self, chunk: int) -> torch.Tensor | None:
        """What this peer writes for ``chunk`` of its own part: the average, as the senders
        decode it when they all get one lossy encoding of it (None: nobody averaged it). Copy it
        into the tensor: plain float16 values stay float16 here, as the senders stage them."""
        if self._rounded is not None and self._rounded[chunk] is not None:
            return self._rounded[chunk]
        return self.reducer.averaged(chunk)

    def nobody(self, chunk: int) -> None:
        """Nobody gets ``chunk`` (no sender delivered it, or its reduction failed)."""
        self._shared[chunk] = chunk_head({"chunk": chunk, "peers": 0}), None
        self._done[chunk] = True

    def for_sender(self, sender: Hashable, chunk: int) -> Encoded:
        """What ``sender``'s stream gets for a done ``chunk``: the shared encoding, or its own
        difference (the average itself if its chunk did not make it into the average)."""
        shared = self._shared[chunk]
        if shared is not None:
            return shared
        sent = self._sent.pop((sender, chunk), None)
        if sent is None or sender not in self.reducer.delivered[chunk]:  # (NaN: left out)
            return self._encode(chunk, None)
        if not isinstance(sent, torch.Tensor):
            spec = self.reducer.chunks[chunk]
            dtype = self.plan.tensors[spec.tensor_index].dtype
            # (accepted into the average: it decoded and was finite then)
            sent = decode_chunk(sent[0], memoryview(sent[1]), spec, dtype, check_finite=False)
        return self._encode(chunk, sent)

    def _encode(self, chunk: int, sent: torch.Tensor | None) -> Encoded:
        """The average of ``chunk``, minus ``sent`` if given (a sender's delta)."""
        spec = self.reducer.chunks[chunk]
        averaged = self.reducer.averaged(chunk)
        assert averaged is not None, "only chunks someone delivered are encoded"
        mask = 0
        for sender in self.reducer.delivered[chunk]:
            mask |= self.sender_bits[sender]
        dtype = self.plan.tensors[spec.tensor_index].dtype
        info = self.plan.compression_info(spec)
        values = averaged
        codec = UNCHECKED_RAW if sent is None and self._checked[chunk] else self.compression
        serialized = None
        try:
            if sent is not None:  # in float32 (float16 is widened exactly as it is subtracted)
                sent = sent if sent.dtype == torch.float16 else sent.float()
                leaf = leaf_codec(self.compression, info)
                if type(leaf) is Float16Compression and dtype == torch.float32:
                    serialized = leaf.compress_difference(averaged, sent, info)  # (no copy)
                else:
                    values = reused_empty(spec.size, torch.float32)
                    add_widened(values, averaged, sent, alpha=-1.0)
            if serialized is None:
                values = values if dtype == torch.float32 else values.to(dtype)
                serialized = codec.compress(values, info)
        except NonFiniteLocalTensor:  # the weighted sum overflowed: nobody gets this chunk
            return chunk_head({"chunk": chunk, "peers": 0}), None
        header, payload = serialized.header(), memoryview(serialized.buffer).cast("B")
        if self._rounded is not None and self._shared_lossy[chunk]:  # as every sender decodes it
            rounded = arrived_values(header, payload, spec, dtype)  # (the commit widens it)
            self._rounded[chunk] = extract(serialized).view(-1) if rounded is None else rounded
        fields = {"chunk": chunk, "peers": encode_peer_set(mask), "delta": sent is not None}
        return chunk_head({**fields, **header}), payload
