"""Bookkeeping of one butterfly all-reduce round: tensors -> parts -> chunks, and back.

Holds ``PartitionPlan`` (which slice of which tensor each streamed chunk is),
``PartReport``/``RoundReport`` (exactly which chunks were averaged over which peers) and
``apply_averaged`` (the sender side: the average back into the local tensors). It does not hold
the aggregator's running average of its part (``kit.averaging.reducer``). It is pure: no clocks,
no networking, no codecs; the all-reduce drives it and decides deadlines and bans.

The averaged tensors are read as one flat vector (their concatenation, never materialised).
Peer p aggregates the contiguous range ``part_sizes[p]`` of it (``kit.averaging.balancing``).
A part streams as chunks that never cross a tensor boundary, so each chunk is compressed with
its own tensor's codec (as hivemind's ``TensorPartContainer``), and holds at most about
``part_size_bytes`` on the wire.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterator, Sequence

import torch

from kit.averaging.compression import CompressionBase, CompressionInfo, TensorDescriptor
from kit.errors import ConfigError, KitUsageError

DEFAULT_PART_SIZE_BYTES = 2**19  # hivemind's default: a chunk's size on the wire
MAX_CHUNK_SCALE = 8  # a round's chunks hold at most this many times part_size_bytes
CHUNK_SECONDS = 0.02  # a scaled chunk crosses the slowest member's measured bandwidth this fast
MIN_CHUNKS_PER_PART = 4  # the largest part still streams as this many chunks (the pipeline)


def chunk_scale(
    bandwidths: Sequence[float | None],
    part_sizes: Sequence[int],
    chunk_elements: Sequence[int],
    part_size_bytes: int,
) -> int:
    """How many times larger than ``part_size_bytes`` a round's chunks are (a power of two).

    Each chunk is a message, and each message costs the same work whatever its size (a
    header, a frame, a few wakeups on both ends): on a fast link that work, not the bytes, is
    what a round waits for with 512 KiB chunks (``benchmarks/allreduce.py``). A larger chunk
    takes longer to arrive, though, and the first averages wait for it: on a slow link (50
    Mbit/s, ``benchmarks/wan.py``) 512 KiB already takes ~0.1 s. So the leader scales the
    chunks up only as far as the slowest member's measured bandwidth (bytes/s of its past
    rounds; None: not measured yet, scale 1) moves one in ``CHUNK_SECONDS``, and keeps at
    least ``MIN_CHUNKS_PER_PART`` chunks in the largest part. Measured (4 peers x 72 MB on
    loopback, this 2-core VM): 4 chunks a part instead of 8 cut the round's CPU from ~0.63 to
    ~0.55 s, the pipeline still overlapping sends, sums and averages.
    """
    known = [b for b in bandwidths if b is not None and b > 0]
    if len(known) < len(bandwidths) or not known or not part_sizes or not chunk_elements:
        return 1
    by_time = CHUNK_SECONDS * min(known) / part_size_bytes
    by_pipeline = max(part_sizes) / (MIN_CHUNKS_PER_PART * max(chunk_elements))
    limit = min(float(MAX_CHUNK_SCALE), by_time, by_pipeline)
    scale = 1
    while scale * 2 <= limit:
        scale *= 2
    return scale


@dataclasses.dataclass(frozen=True)
class ChunkSpec:
    """One streamed chunk: a slice of one tensor inside one peer's part."""

    part_index: int  # whose part (the index of the aggregating peer in the group)
    chunk_index: int  # position in that part's stream
    tensor_index: int  # which averaged tensor the values come from
    tensor_offset: int  # first element, in the flattened tensor
    part_offset: int  # first element, in the part
    size: int  # number of elements
    tensor_chunk: int = 0  # its place among its tensor's chunks (hivemind's part_index)


def max_chunk_elements(
    descriptor: TensorDescriptor,
    compression: CompressionBase | None = None,
    part_size_bytes: int = DEFAULT_PART_SIZE_BYTES,
) -> int:
    """Elements per chunk of this tensor so a compressed chunk is about ``part_size_bytes``."""
    ratio = (
        1.0
        if compression is None
        else compression.estimate_compression_ratio(CompressionInfo(None, descriptor))
    )
    return max(1, int(part_size_bytes / (descriptor.dtype.itemsize * ratio)))


@dataclasses.dataclass(frozen=True)
class PartitionPlan:
    """Where every chunk of every part lives in the averaged tensors. Build with ``build``."""

    tensors: tuple[TensorDescriptor, ...]  # the averaged tensors, in order
    part_sizes: tuple[int, ...]  # elements of the flat vector per peer, in group order
    parts: tuple[tuple[ChunkSpec, ...], ...]  # the chunks of each part, in streaming order
    chunk_limits: tuple[int, ...] = ()  # per tensor: the most elements of one chunk
    infos: tuple[CompressionInfo, ...] = ()  # per tensor, what codecs see (keys, roles)

    @classmethod
    def build(
        cls,
        tensors: Sequence[TensorDescriptor],
        part_sizes: Sequence[int],
        chunk_elements: int | Sequence[int],
        infos: Sequence[CompressionInfo] | None = None,
    ) -> PartitionPlan:
        """Cut each part into chunks of at most ``chunk_elements`` (one value or per tensor).
        ``infos``: each tensor's CompressionInfo (hivemind's ``tensor_infos``: its key and role,
        which adaptive codecs choose by); None: keyed by index, role unspecified.

        Raises:
            ConfigError: part sizes negative or not summing to the tensors' total size, or a
                chunk limit below 1.
        """
        numels = [descriptor.numel() for descriptor in tensors]
        limits = (
            [chunk_elements] * len(numels)
            if isinstance(chunk_elements, int)
            else list(chunk_elements)
        )
        if len(limits) != len(numels) or min(limits, default=1) < 1:
            raise ConfigError(
                f"chunk_elements {chunk_elements!r} must be >= 1, one per tensor"
                " - help: see max_chunk_elements"
            )
        if min(part_sizes, default=0) < 0 or sum(part_sizes) != sum(numels):
            raise ConfigError(
                f"part sizes {list(part_sizes)} must be >= 0 and sum to {sum(numels)}"
                " - help: split the tensors' total size with load_balance_peers"
            )
        if infos is not None and len(infos) != len(numels):
            raise ConfigError(f"{len(infos)} tensor infos for {len(numels)} tensors")
        parts, tensor, tensor_start, position = [], 0, 0, 0
        tensor_chunks = [0] * len(numels)
        for part_index, part_size in enumerate(part_sizes):
            chunks: list[ChunkSpec] = []
            part_start = position
            while position < part_start + part_size:
                while tensor_start + numels[tensor] <= position:  # skip finished (or empty) tensors
                    tensor_start += numels[tensor]
                    tensor += 1
                end = min(
                    part_start + part_size, tensor_start + numels[tensor], position + limits[tensor]
                )
                chunks.append(
                    ChunkSpec(
                        part_index,
                        len(chunks),
                        tensor,
                        position - tensor_start,
                        position - part_start,
                        end - position,
                        tensor_chunks[tensor],
                    )
                )
                tensor_chunks[tensor] += 1
                position = end
            parts.append(tuple(chunks))
        return cls(
            tuple(tensors), tuple(part_sizes), tuple(parts), tuple(limits), tuple(infos or ())
        )

    @property
    def total_size(self) -> int:
        return sum(self.part_sizes)

    def chunk_view(self, tensors: Sequence[torch.Tensor], spec: ChunkSpec) -> torch.Tensor:
        """The chunk's values as a 1-D view of ``tensors`` (no copy; writes go through)."""
        return _flat(tensors[spec.tensor_index])[
            spec.tensor_offset : spec.tensor_offset + spec.size
        ]

    def iter_part(
        self, tensors: Sequence[torch.Tensor], part_index: int
    ) -> Iterator[tuple[ChunkSpec, torch.Tensor]]:
        """(spec, view) for each chunk of one part, in streaming order."""
        self.check_tensors(tensors)
        for spec in self.parts[part_index]:
            yield spec, self.chunk_view(tensors, spec)

    def compression_info(self, spec: ChunkSpec) -> CompressionInfo:
        """The CompressionInfo of a chunk, as hivemind's codecs see one: its whole tensor (its
        info from ``build``, else keyed by its index), ``part_index`` its place among that
        tensor's chunks and ``part_size`` the most elements a chunk of that tensor holds."""
        index = spec.tensor_index
        info = self.infos[index] if self.infos else CompressionInfo(index, self.tensors[index])
        limit = self.chunk_limits[index] if self.chunk_limits else spec.size
        return info.get_part(spec.tensor_chunk, limit)

    def check_tensors(self, tensors: Sequence[torch.Tensor]) -> None:
        """Raise KitUsageError unless ``tensors`` match the plan's shapes and dtypes."""
        got = tuple(TensorDescriptor.from_tensor(tensor) for tensor in tensors)
        if got != self.tensors:
            raise KitUsageError(
                f"tensors {got} do not match the plan {self.tensors}"
                " - help: build the plan from these tensors"
            )


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    if not tensor.is_contiguous():
        raise KitUsageError(
            "averaged tensors must be contiguous"
            " - help: average tensor.contiguous() and keep using that tensor"
        )
    return tensor.view(-1)


@dataclasses.dataclass(frozen=True)
class PartReport:
    """Which peers each chunk of one part was averaged over."""

    part_index: int  # whose part
    senders: frozenset[Hashable]  # every peer expected to contribute
    chunk_peers: tuple[frozenset[Hashable], ...]  # per chunk: the peers it was averaged over

    @classmethod
    def missing(cls, part_index: int, senders: frozenset[Hashable], n_chunks: int) -> PartReport:
        """A part that never came back (its aggregator failed): averaged over nobody."""
        return cls(part_index, senders, (frozenset(),) * n_chunks)

    @property
    def complete(self) -> bool:
        """Every chunk was averaged over every sender."""
        return all(peers == self.senders for peers in self.chunk_peers)

    @property
    def peers(self) -> frozenset[Hashable]:
        """The peers that made it into every chunk of the part."""
        return frozenset.intersection(self.senders, *self.chunk_peers)


@dataclasses.dataclass(frozen=True)
class RoundReport:
    """What one round achieved, part by part."""

    parts: tuple[PartReport, ...]  # one per part, in group order

    @property
    def is_full(self) -> bool:
        """Every part got every sender: the result is the exact weighted average."""
        return all(part.complete for part in self.parts)


def apply_averaged(
    target: torch.Tensor,
    averaged: torch.Tensor,
    *,
    alpha: float = 1.0,
    sent: torch.Tensor | None = None,
) -> None:
    """Write an averaged chunk back into the local chunk ``target`` (a view), in place.

    Without ``sent``: ``target += alpha * (averaged - target)`` (alpha = 1 overwrites exactly).
    With ``sent`` (what this peer contributed): ``target += alpha * (averaged - sent)``, which
    keeps local updates made during the round (hivemind's delta rule for averaging_alpha).
    """
    averaged = averaged.to(device=target.device, dtype=target.dtype)
    if sent is None:
        target.lerp_(averaged, alpha)
    else:
        target.add_(averaged - sent.to(device=target.device, dtype=target.dtype), alpha=alpha)
