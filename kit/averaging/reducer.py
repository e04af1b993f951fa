"""An aggregator's running weighted average of its own part of a round, chunk by chunk.

Holds ``PartReducer``. It does not hold the plan or the reports (``kit.averaging.partition``),
CenteredClip (``kit.averaging.robust``, a subclass that checks every chunk as it arrives), the
encodings of the averages (``kit.averaging.averages``) or anything on the wire. It is pure: no
clocks, no networking; the all-reduce drives it and decides deadlines and bans.

Why a contribution's NaN/inf is found when its chunk completes, not when it arrives: a NaN or inf
in one sender's chunk (a diverged or hostile peer) must never reach the average, but checking
each contribution costs one pass over every byte the aggregator receives, on top of the pass
that adds it (``benchmarks/allreduce.py``: a fifth of a round's arithmetic here). A weighted sum
of finite values is finite unless it overflows, so contributions are added unchecked, each kept
(a reference to the frame it arrived in, no copy) until its chunk completes, and the chunk's
average is checked once: one pass per chunk instead of one per sender. Only when the average is
not finite are the kept contributions checked one by one: the senders whose values hold NaN/inf
are dropped from that chunk (``on_non_finite``) and the others summed again. Still not finite:
the weighted sum overflowed, and nobody gets that chunk. That one check of the average also
stands for its encoding's (``checks_averages``).

Kept frames cost memory while a chunk waits for its slowest sender. Past ``max_kept_bytes`` (one
part's worth by default; the local sender's values are views of its tensors and cost nothing) a
chunk's kept contributions are checked and let go, and its later ones are checked as they
arrive, as they all were before.

The first contribution of a chunk is kept unwritten and summed together with the second
(``first + alpha * second`` written into the accumulator): one pass less per chunk than writing
it alone first. Float16 values are summed as they arrived, in float32 (``kit.averaging.widening``). The accumulator then holds the weighted sum divided by the first weight
(``_scale``), which the final division takes back.
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Callable, Hashable, Mapping
from typing import Any, ClassVar

import torch

from kit.averaging.compression import is_finite
from kit.averaging.partition import PartitionPlan, PartReport
from kit.averaging.widening import add_widened
from kit.errors import ConfigError, InvalidChunk, KitUsageError

logger = logging.getLogger(__name__)

Contribution = tuple[Hashable, torch.Tensor, float]  # sender, values, weight


class PartReducer:
    """An aggregator's running weighted average of its own part, chunk by chunk.

    Every sender streams the part's chunks in order; ``accept`` checks each chunk's size and
    dtype and adds ``weight * values`` into a float32 accumulator (values of the tensor's dtype,
    or float16 values of a float tensor: the FLOAT16 codec's, summed as they arrived). A chunk is
    complete once every sender delivered it, had it rejected, or was excluded; its average is
    then over the senders that delivered finite values, with their weights renormalised.
    ``accept``, ``reject`` and ``exclude`` return the chunks they completed, so the averages can
    stream back while others are still arriving.
    """

    #: Every average this reducer gives out was checked finite (its encoding need not check it).
    checks_averages: ClassVar[bool] = True

    def __init__(
        self,
        plan: PartitionPlan,
        part_index: int,
        senders: Mapping[Any, float],
        round_id: Hashable,
        accumulator: torch.Tensor | None = None,
        *,
        on_non_finite: Callable[[Any, int], None] | None = None,
        local_sender: Hashable | None = None,
        max_kept_bytes: int | None = None,
    ) -> None:
        """Args:
            plan: the round's plan (the same on every peer).
            part_index: the part this peer aggregates.
            senders: every peer expected to send this part, with its weight (e.g. samples).
            round_id: what every chunk of this round carries (e.g. the group id).
            accumulator: a float32 CPU buffer of at least the part's size to reuse (its
                contents do not matter); None allocates one.
            on_non_finite: called with (sender, chunk index) for each chunk left out of an
                average because its values held NaN or inf.
            local_sender: the sender whose values are views of this peer's tensors (keeping
                them costs no memory).
            max_kept_bytes: the most bytes of unchecked contributions kept at once (see the
                module); None: the part's size in float32; 0: check every chunk on arrival.

        Raises:
            ConfigError: a weight is not a positive finite number.
        """
        for sender, weight in senders.items():
            if not (
                isinstance(weight, numbers.Real)
                and not isinstance(weight, bool)
                and 0 < weight < math.inf
            ):
                raise ConfigError(
                    f"weight {weight!r} of sender {sender!r} must be positive and finite"
                    " - help: weigh senders by their number of samples"
                )
        self.plan, self.part_index, self.round_id = plan, part_index, round_id
        self.chunks = plan.parts[part_index]
        self.weights = dict(senders)
        size = plan.part_sizes[part_index]
        if accumulator is None:
            self.accumulator = torch.zeros(size, dtype=torch.float32)
        elif (
            accumulator.dtype != torch.float32 or accumulator.dim() != 1 or len(accumulator) < size
        ):
            raise KitUsageError(
                "the accumulator must be a 1-D float32 tensor of at least the part's size"
                " - help: pass None to allocate one"
            )
        else:  # not zeroed: a chunk's first contributions are written, not added
            self.accumulator = accumulator[:size]
        n = len(self.chunks)
        self.weight_sums = [0.0] * n
        self.delivered: list[set[Hashable]] = [set() for _ in self.chunks]
        self.resolved = [0] * n  # senders delivered, rejected or excluded
        self.next_chunk = dict.fromkeys(senders, 0)  # per sender: the chunk expected next
        self.excluded: set[Hashable] = set()
        self.on_non_finite, self.local_sender = on_non_finite, local_sender
        self.max_kept_bytes = 4 * size if max_kept_bytes is None else max_kept_bytes
        self._kept: list[list[Contribution]] = [[] for _ in self.chunks]  # unchecked, so far
        self._kept_bytes = 0
        self._eager = [self.max_kept_bytes <= 0] * n  # chunks checked contribution by contribution
        self._first: list[Contribution | None] = [None] * n  # delivered, not yet written
        self._scale = [1.0] * n  # the accumulator holds the weighted sum / _scale

    def accept(
        self,
        sender: Hashable,
        round_id: Hashable,
        part_index: int,
        chunk_index: int,
        values: torch.Tensor,
    ) -> tuple[int, ...]:
        """Add one chunk from ``sender``; return the chunk indices this completed.

        Values holding NaN or inf are left out of the chunk's average (found when it completes,
        or here once kept contributions reach ``max_kept_bytes``; see the module), and
        ``on_non_finite`` is told.

        Raises:
            InvalidChunk: unknown or excluded sender, other round or part, a chunk out of order
                (nothing changes); or wrong size or dtype (the chunk is dropped for this sender
                and the round goes on without it).
        """
        self._take_slot(sender, round_id, part_index, chunk_index)
        spec = self.chunks[chunk_index]
        dtype = self.plan.tensors[spec.tensor_index].dtype
        problem = None
        if not isinstance(values, torch.Tensor) or not (
            values.dtype == dtype or (values.dtype == torch.float16 and dtype.is_floating_point)
        ):
            problem = ("dtype", f"is {getattr(values, 'dtype', type(values))}, not {dtype}")
        elif values.dim() != 1 or values.numel() != spec.size:
            problem = ("size", f"has shape {list(values.shape)}, not [{spec.size}]")
        if problem is not None:  # the slot is used up: the chunk is averaged without this sender
            # (the message is formatted only here: a PeerID's repr costs ~0.1 ms, once per chunk)
            problem = (problem[0], f"chunk {chunk_index} from {sender!r} {problem[1]}")
            logger.debug("part %d: dropping %s", self.part_index, problem[1])
            raise InvalidChunk(*problem, completed=self._resolve(chunk_index))
        values = values.to("cpu")
        weight = self.weights[sender]
        nbytes = 0 if sender == self.local_sender else values.numel() * values.element_size()
        if not self._eager[chunk_index] and self._kept_bytes + nbytes > self.max_kept_bytes:
            self._check_kept(chunk_index)  # memory is short: this chunk is checked eagerly now
        if self._eager[chunk_index]:
            if not is_finite(values):
                self._left_out(sender, chunk_index)
                return self._resolve(chunk_index)
        else:
            self._kept[chunk_index].append((sender, values, weight))
            self._kept_bytes += nbytes
        self._add(chunk_index, (sender, values, weight), defer=not self._eager[chunk_index])
        return self._resolve(chunk_index)

    def reject(
        self, sender: Hashable, round_id: Hashable, part_index: int, chunk_index: int
    ) -> tuple[int, ...]:
        """Drop ``sender``'s chunk (it could not be decoded); return the chunks this completed.

        The chunk is averaged without this sender, as for a chunk ``accept`` refuses.

        Raises:
            InvalidChunk: unknown or excluded sender, other round or part, out of order.
        """
        self._take_slot(sender, round_id, part_index, chunk_index)
        return self._resolve(chunk_index)

    def _take_slot(
        self, sender: Hashable, round_id: Hashable, part_index: int, chunk_index: int
    ) -> None:
        if sender not in self.next_chunk or sender in self.excluded:
            raise InvalidChunk(
                "sender", f"{sender!r} is not an active sender of part {self.part_index}"
            )
        if round_id != self.round_id or part_index != self.part_index:
            raise InvalidChunk(
                "round" if round_id != self.round_id else "part",
                f"{sender!r} sent round {round_id!r} part {part_index}, "
                f"expected round {self.round_id!r} part {self.part_index}",
            )
        expected = self.next_chunk[sender]
        if chunk_index != expected or chunk_index >= len(self.chunks):
            raise InvalidChunk("order", f"{sender!r} sent chunk {chunk_index}, expected {expected}")
        self.next_chunk[sender] += 1

    def exclude(self, sender: Hashable) -> tuple[int, ...]:
        """Stop waiting for ``sender`` (too slow, or banned); return the chunks this completed.

        Chunks it already delivered stay in their averages; the rest are averaged without it.
        """
        if sender not in self.next_chunk or sender in self.excluded:
            return ()
        self.excluded.add(sender)
        pending = range(self.next_chunk[sender], len(self.chunks))
        return tuple(index for chunk in pending for index in self._resolve(chunk))

    def finish(self) -> PartReport:
        """The deadline passed: exclude every sender still owing chunks; report the part."""
        for sender in list(self.next_chunk):
            if self.next_chunk[sender] < len(self.chunks):
                self.exclude(sender)
        return self.report()

    def _resolve(self, chunk_index: int) -> tuple[int, ...]:
        self.resolved[chunk_index] += 1
        if self.resolved[chunk_index] != len(self.weights):
            return ()
        self._settle(chunk_index)
        return (chunk_index,)

    def is_complete(self, chunk_index: int) -> bool:
        return self.resolved[chunk_index] == len(self.weights)

    def averaged(self, chunk_index: int) -> torch.Tensor | None:
        """The weighted average of a complete chunk (float32, finite), or None if nobody
        delivered finite values for it (or their weighted sum overflowed)."""
        if not self.is_complete(chunk_index):
            raise KitUsageError(
                f"chunk {chunk_index} is still waiting for senders"
                " - help: read only the chunks that accept/exclude/finish report complete"
            )
        if not self.delivered[chunk_index]:
            return None
        return self._total(chunk_index)

    def report(self) -> PartReport:
        """Which senders each chunk was averaged over (so far)."""
        return PartReport(
            self.part_index,
            frozenset(self.weights),
            tuple(frozenset(peers) for peers in self.delivered),
        )

    # --- the sums ------------------------------------------------------------------------------

    def _total(self, chunk: int) -> torch.Tensor:
        spec = self.chunks[chunk]
        return self.accumulator[spec.part_offset : spec.part_offset + spec.size]

    def _add(self, chunk: int, contribution: Contribution, defer: bool) -> None:
        """Add one contribution (``defer``: a first one may wait to be summed with the next)."""
        sender, values, weight = contribution
        total = self._total(chunk)
        first = self._first[chunk]
        if first is not None:  # the first two in one pass (floats: in float32 or wider)
            self._first[chunk] = None
            _, earlier, earlier_weight = first
            if earlier.is_floating_point() and values.is_floating_point():
                add_widened(total, earlier, values, alpha=weight / earlier_weight)
                self._scale[chunk] = earlier_weight
            else:
                _write(total, earlier, earlier_weight)
                total.add_(values, alpha=weight)
        elif self.delivered[chunk]:
            add_widened(total, total, values, alpha=weight / self._scale[chunk])
        elif defer:
            self._first[chunk] = contribution
        else:
            _write(total, values, weight)
        self.weight_sums[chunk] += weight
        self.delivered[chunk].add(sender)

    def _settle(self, chunk: int) -> None:
        """The chunk is complete: average it in place and check the average (see the module)."""
        finite = self._average(chunk)
        if not finite and self._leave_out_non_finite(chunk):
            finite = self._average(chunk)
        if not finite:
            logger.warning(
                "part %d: the weighted sum of chunk %d overflowed; nobody gets it",
                self.part_index,
                chunk,
            )
            self.delivered[chunk] = set()
        self._release(chunk)

    def _average(self, chunk: int) -> bool:
        """Turn the chunk's sum into its average, in place; whether it is finite."""
        if not self.delivered[chunk]:
            return True
        self._write_first(chunk)  # the only contribution, if still unwritten
        total = self._total(chunk)
        total.div_(self.weight_sums[chunk] / self._scale[chunk])
        return is_finite(total)

    def _check_kept(self, chunk: int) -> None:
        """Check the chunk's kept contributions now, let them go, and check its later ones as
        they arrive."""
        if not self._leave_out_non_finite(chunk):
            self._write_first(chunk)  # kept no more: it cannot wait for the next one
        self._release(chunk)
        self._eager[chunk] = True

    def _leave_out_non_finite(self, chunk: int) -> bool:
        """Check the chunk's kept contributions one by one; leave out those holding NaN or inf
        and sum the others again. Whether any was left out."""
        kept = self._kept[chunk]
        finite = [is_finite(values) for _, values, _ in kept]
        if all(finite):
            return False
        for (sender, _, _), ok in zip(kept, finite, strict=True):
            if not ok:
                self._left_out(sender, chunk)
        self._rebuild(chunk, [c for c, ok in zip(kept, finite, strict=True) if ok])
        return True

    def _write_first(self, chunk: int) -> None:
        first = self._first[chunk]
        if first is not None:
            self._first[chunk] = None
            _write(self._total(chunk), first[1], first[2])

    def _rebuild(self, chunk: int, contributions: list[Contribution]) -> None:
        """Sum the chunk again from ``contributions`` only."""
        self._first[chunk], self._scale[chunk] = None, 1.0
        self.weight_sums[chunk] = 0.0
        self.delivered[chunk] = set()
        for contribution in contributions:
            self._add(chunk, contribution, defer=False)

    def _release(self, chunk: int) -> None:
        for sender, values, _ in self._kept[chunk]:
            if sender != self.local_sender:
                self._kept_bytes -= values.numel() * values.element_size()
        self._kept[chunk] = []

    def _left_out(self, sender: Hashable, chunk: int) -> None:
        logger.debug("part %d: chunk %d from %r holds NaN or inf", self.part_index, chunk, sender)
        if self.on_non_finite is not None:
            self.on_non_finite(sender, chunk)


def _write(total: torch.Tensor, values: torch.Tensor, weight: float) -> None:
    """``total = weight * values`` in float32."""
    if values.dtype == torch.float32:
        torch.mul(values, weight, out=total)
    else:  # (torch.mul would multiply in float16, then widen: widen first)
        total.copy_(values).mul_(weight)
