"""What an averager is configured with, and what it checks before its first round.

Holds ``AveragerSettings`` (every argument of ``DecentralizedAverager``, hivemind's names, one
commented line each), ``chunk_elements`` (how a tensor is cut into streamed chunks) and
``check_tensors``. It does not hold the averager (``kit.averaging.averager``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from kit.averaging.compression import (
    CompressionBase,
    CompressionInfo,
    NoCompression,
    TensorDescriptor,
)
from kit.averaging.declarations import MatchmakingSettings
from kit.averaging.partition import DEFAULT_PART_SIZE_BYTES
from kit.averaging.robust import Aggregation
from kit.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class AveragerSettings:
    """The arguments of one ``DecentralizedAverager`` (hivemind's names and meanings)."""

    # fmt: off
    prefix: str  # DHT namespace: averagers with the same prefix (and tensor schema) average together
    target_group_size: int | None = None  # a group this large begins at once; None: as many as are ready
    min_group_size: int = 2  # smaller groups never average; raise it if tiny groups waste rounds
    initial_group_bits: str = ""  # hivemind's Moshpit group bits ("" = one group key for everyone)
    min_matchmaking_time: float = 5.0  # a leader waits this long for followers; increase on the internet (10-15)
    request_timeout: float = 3.0  # peers must answer join requests and open streams within this
    allreduce_timeout: float | None = None  # nothing in a round waits past this; None: per-chunk timeouts only
    next_chunk_timeout: float | None = None  # an aggregator excludes a sender silent this long (None: 5 x request_timeout)
    reducer_timeout: float | None = None  # a sender drops a part whose aggregator is silent this long (None: 2 x the above)
    part_size_bytes: int = DEFAULT_PART_SIZE_BYTES  # bytes of one streamed chunk on the wire
    min_vector_size: int = 0  # a peer whose share would be smaller aggregates nothing
    bandwidth: float | None = None  # bytes/s for load balancing; None: measured from past rounds
    client_mode: bool | None = None  # True: aggregates nothing, never leads; None: True unless others can connect to the DHT's peer directly (PeerAPI.can_accept: it listens, or punches through its NAT)
    auxiliary: bool = False  # aggregates for others but contributes no tensors (a helper with bandwidth)
    compression: CompressionBase = dataclasses.field(default_factory=NoCompression)  # codec of every chunk
    tensor_infos: Sequence[CompressionInfo] | None = None  # per tensor: the key and role adaptive codecs see (hivemind's); None: by index
    lossy_deltas: bool = True  # lossy codec: each sender gets its compressed difference to the average (hivemind); False: one shared average
    robust_aggregation: str = "mean"  # "centered_clip" if peers may send garbage (kit.averaging.robust); costs senders x part memory
    clip_tau: float | None = None  # CenteredClip radius; None: median distance per round. Lower it if bad peers still move the loss
    clip_iterations: int = 20  # CenteredClip steps at most; lower it if reducing a big part is slow, raise it if tau is tiny
    declare_state_period: float = 30.0  # a state donor re-declares itself in the DHT this often (hivemind's)
    # fmt: on

    def __post_init__(self) -> None:
        if not isinstance(self.prefix, str) or not 0 < len(self.prefix) <= 256:
            raise ConfigError(
                f"prefix {self.prefix!r:.40} must be a non-empty string of at most 256 characters"
                " - help: e.g. prefix=f'{run_id}_grad_averager'"
            )
        if set(self.initial_group_bits) - {"0", "1"}:
            raise ConfigError("initial_group_bits must hold only 0 and 1 - help: leave it ''")
        for name in ("allreduce_timeout", "next_chunk_timeout", "reducer_timeout", "bandwidth"):
            value = getattr(self, name)
            if value is not None and not (0 < value < math.inf):
                raise ConfigError(f"{name}={value!r} must be positive - help: or leave it None")
        if not (0 < self.declare_state_period < math.inf):
            raise ConfigError(
                f"declare_state_period={self.declare_state_period!r} must be positive - help: "
                "keep 30 (seconds)"
            )
        if self.part_size_bytes < 1024 or self.min_vector_size < 0:
            raise ConfigError(
                "part_size_bytes must be >= 1024 and min_vector_size >= 0"
                " - help: keep part_size_bytes=2**19 (hivemind's default)"
            )
        if self.auxiliary and self.client_mode:
            raise ConfigError(
                "an auxiliary averager aggregates for others, so it must accept connections"
                " - help: use client_mode=False (or None) with auxiliary=True"
            )
        _ = self.matchmaking  # validates the group settings
        _ = self.aggregation  # validates the robust aggregation settings

    @property
    def aggregation(self) -> Aggregation:
        """How this peer reduces its own part (the plain mean, or CenteredClip)."""
        return Aggregation(self.robust_aggregation, self.clip_tau, self.clip_iterations)

    @property
    def matchmaking(self) -> MatchmakingSettings:
        return MatchmakingSettings(
            self.target_group_size,
            self.min_group_size,
            self.min_matchmaking_time,
            self.request_timeout,
        )

    @property
    def sender_timeout(self) -> float:
        return self.next_chunk_timeout or 5 * self.request_timeout

    @property
    def aggregator_timeout(self) -> float:
        return self.reducer_timeout or 2 * self.sender_timeout

    @property
    def default_step_timeout(self) -> float:
        return self.min_matchmaking_time + 10 * self.request_timeout


def chunk_elements(
    tensors: Sequence[torch.Tensor],
    compression: CompressionBase,
    part_size_bytes: int,
    infos: Sequence[CompressionInfo] | None = None,
) -> list[int]:
    """Elements per streamed chunk of each tensor, so a compressed chunk is ~part_size_bytes."""
    sizes = []
    for index, tensor in enumerate(tensors):
        info = (
            infos[index] if infos else CompressionInfo(index, TensorDescriptor.from_tensor(tensor))
        )
        ratio = compression.estimate_compression_ratio(info)
        sizes.append(max(1, int(part_size_bytes / (tensor.element_size() * ratio))))
    return sizes


def check_infos(
    infos: Sequence[CompressionInfo] | None, tensors: Sequence[torch.Tensor]
) -> tuple[CompressionInfo, ...] | None:
    """``tensor_infos`` as a tuple, if there is one CompressionInfo per tensor, of its shape.

    Raises:
        ConfigError: another number of infos, or an info that describes another tensor.
    """
    if infos is None:
        return None
    infos = tuple(infos)
    if len(infos) != len(tensors) or not all(isinstance(i, CompressionInfo) for i in infos):
        raise ConfigError(
            f"tensor_infos must be one CompressionInfo per averaged tensor ({len(tensors)}) - "
            "help: CompressionInfo.from_tensor(tensor, key=..., role=...) for each"
        )
    for index, (info, tensor) in enumerate(zip(infos, tensors, strict=True)):
        if tuple(info.descriptor.shape) != tuple(tensor.shape):
            raise ConfigError(
                f"tensor_infos[{index}] describes a {list(info.descriptor.shape)} tensor, the "
                f"averaged tensor is {list(tensor.shape)} - help: build it from that tensor"
            )
    return infos


def check_tensors(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors as a list, if they can be averaged in place.

    Raises:
        ConfigError: no tensors, a non-float tensor, or a non-contiguous one.
    """
    tensors = list(tensors)
    if not tensors:
        raise ConfigError("averaged_tensors is empty - help: pass the tensors to average")
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            raise ConfigError(
                f"can only average floating-point tensors, got {getattr(tensor, 'dtype', tensor)!r:.40}"
                " - help: convert counters to float, or keep them out of the averaged tensors"
            )
        if not tensor.is_contiguous():
            raise ConfigError(
                "averaged tensors must be contiguous - help: pass tensor.contiguous() and keep "
                "using that tensor"
            )
    return tensors
