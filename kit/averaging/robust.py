"""Robust aggregation of an all-reduce part: CenteredClip instead of the weighted mean.

Holds the pure math (``centered_clip``, its starting point ``weighted_coordinate_median``, and
``choose_tau``, the clipping radius when none is set), the settings of one aggregation rule
(``Aggregation``) and ``ClippedPartReducer``, a ``PartReducer`` that keeps every sender's part
and reduces it with CenteredClip once the whole part is in. It holds no networking: the
all-reduce (``kit.averaging.allreduce``) feeds the reducer exactly as it feeds the plain one.

Why: the weighted mean has breakdown point 0. One peer of eight that sends its gradient scaled
by -100 moves the mean by ~12 gradient norms, and training diverges. CenteredClip (Karimireddy,
He & Jaggi 2021, "Learning from History for Byzantine Robust Optimization", Alg. 2; used per
part by Gorbunov et al. 2022, "Secure Distributed Training at Scale" (BTARD) §3) iterates

    v <- v + sum_i w_i (x_i - v) min(1, tau / ||x_i - v||) / sum_i w_i

so that no vector pulls the result by more than ``tau`` per iteration: a fraction delta of bad
weight biases the fixed point by at most ~delta * tau, however large the bad vectors are.

What this does NOT protect against (say it plainly):

* **A byzantine aggregator.** In the butterfly all-reduce, part i is reduced by peer i alone.
  Clipping protects every honest owner's part from bad senders, but a byzantine owner can send
  back anything for its own part (1/N of the vector per bad peer). BTARD adds verification for
  this (random checks, accusations, bans); kit does not. Honest peers do reject NaN/inf
  averages (``allreduce``), nothing more.
* **Lies about weights.** The weights are the members' self-declared sample counts. A peer that
  claims a huge weight dominates CenteredClip's steps as it dominates the mean (only more slowly:
  each step still moves v by at most ``tau``). Robust runs should use equal weights or a
  trusted sample count (e.g. the signed progress records of ``kit.optim.progress``).
* **Many bad peers.** The guarantee needs the bad weight below ~1/2 (and clearly below it for a
  useful bias bound); the coordinate-wise median start needs the same.

Memory: the plain reducer streams, summing each chunk as it arrives (one float32 part). This one
keeps every sender's part until the last chunk is in: (number of senders) x (part size) x 4
bytes, e.g. 8 peers averaging a 110M-parameter model hold ~8 x 110M / 8 x 4 B = 440 MB each. The
averages go back only once the whole part is reduced, so the round no longer overlaps receiving
and sending; raise ``reducer_timeout`` if senders drop parts while the owner is still receiving.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import torch

from kit.averaging.partition import PartitionPlan
from kit.averaging.reducer import PartReducer
from kit.errors import ConfigError, KitUsageError, NothingToAggregate

logger = logging.getLogger(__name__)

AGGREGATIONS = ("mean", "centered_clip")  # the values of AveragerSettings.robust_aggregation
MEDIAN_BLOCK = 2**16  # columns sorted at once by the median (bounds its n x block index memory)


@dataclasses.dataclass(frozen=True)
class Aggregation:
    """How an aggregator reduces its part (built from ``AveragerSettings``)."""

    # fmt: off
    method: str = "mean"  # "mean" (streamed weighted mean) or "centered_clip" (robust, see module docstring)
    tau: float | None = None  # clipping radius in L2 over a part; None: choose_tau per part and round
    iterations: int = 20  # CenteredClip iterations at most (it stops earlier once converged)
    tolerance: float = 1e-5  # stop once a step moves the result by less than tolerance * tau
    # fmt: on

    def __post_init__(self) -> None:
        if self.method not in AGGREGATIONS:
            raise ConfigError(
                f"robust_aggregation={self.method!r} is not one of {AGGREGATIONS}"
                " - help: use 'centered_clip' against byzantine peers, else 'mean'"
            )
        _check_clip_arguments(self.tau, self.iterations, self.tolerance)


def _check_clip_arguments(tau: float | None, iterations: int, tolerance: float) -> None:
    if tau is not None and not (isinstance(tau, int | float) and not math.isnan(tau) and tau > 0):
        raise ConfigError(
            f"clip_tau={tau!r} must be a positive number (or None to choose it per round)"
            " - help: leave it None, or set about the spread of honest vectors (see choose_tau)"
        )
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise ConfigError(f"clip_iterations={iterations!r} must be an int >= 1 - help: e.g. 20")
    if not (isinstance(tolerance, int | float) and 0 <= tolerance < 1):
        raise ConfigError(f"tolerance={tolerance!r} must be in [0, 1) - help: e.g. 1e-5")


def _usable_rows(vectors: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked inputs, without rows of zero weight or with NaN/inf (those are dropped, warned)."""
    if vectors.dim() != 2 or weights.dim() != 1 or len(weights) != len(vectors):
        raise ConfigError(
            f"expected vectors [n, d] and weights [n], got {list(vectors.shape)} and "
            f"{list(weights.shape)} - help: stack one flat vector per peer"
        )
    if not vectors.is_floating_point():
        raise ConfigError(f"vectors must be floating point, not {vectors.dtype} - help: .float()")
    weights = weights.to(device=vectors.device, dtype=torch.float64)
    if bool((~torch.isfinite(weights)).any()) or bool((weights < 0).any()):
        raise ConfigError("weights must be finite and >= 0 - help: weigh peers by sample counts")
    finite = torch.isfinite(vectors).all(dim=1)
    if not bool(finite.all()):
        logger.warning(
            "robust aggregation: dropping %d of %d vectors that hold NaN or inf",
            int((~finite).sum()),
            len(vectors),
        )
    keep = finite & (weights > 0)
    if not bool(keep.any()):
        raise NothingToAggregate(
            "no vector is finite with a positive weight - help: check that some peer's values "
            "are finite (training diverged?) and that weights are sample counts > 0"
        )
    if bool(keep.all()):
        return vectors, weights
    return vectors[keep], weights[keep]


def weighted_coordinate_median(vectors: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Per coordinate, the weighted median of the rows (midpoint of the lower and upper one).

    Robust to any set of rows holding less than half of the weight. Rows with NaN/inf or zero
    weight are dropped. Memory: the rows' sort runs over ``MEDIAN_BLOCK`` columns at a time.

    Args:
        vectors: ``[n, d]`` floating-point rows.
        weights: ``[n]`` non-negative weights.

    Returns:
        ``[d]`` tensor of ``vectors``' dtype.

    Raises:
        ConfigError: bad shapes or weights. NothingToAggregate: no usable row.
    """
    vectors, weights = _usable_rows(vectors, weights)
    if len(vectors) == 1:
        return vectors[0].clone()
    half = float(weights.sum()) / 2
    out = torch.empty(vectors.shape[1], dtype=vectors.dtype, device=vectors.device)
    for start in range(0, vectors.shape[1], MEDIAN_BLOCK):
        block = vectors[:, start : start + MEDIAN_BLOCK]
        values, order = torch.sort(block, dim=0)
        cumulative = torch.cumsum(weights[order], dim=0)
        # The lower median is the first row whose cumulative weight reaches half; the upper is
        # the first to pass it (they differ only on an exact tie, e.g. two equal weights).
        lower = torch.argmax((cumulative >= half * (1 - 1e-12)).to(torch.uint8), dim=0)
        upper = torch.argmax((cumulative > half * (1 + 1e-12)).to(torch.uint8), dim=0)
        pick = torch.stack([lower, upper])
        chosen = torch.gather(values, 0, pick)
        out[start : start + MEDIAN_BLOCK] = chosen.mean(dim=0, dtype=torch.float64).to(out.dtype)
    return out


def choose_tau(
    vectors: torch.Tensor, weights: torch.Tensor, center: torch.Tensor | None = None
) -> float:
    """A clipping radius from the data: the weighted median distance of the rows to ``center``.

    With bad peers holding less than half of the weight, the median distance is an honest one,
    so honest vectors are clipped little and bad ones are cut to the honest spread, whatever
    their norm. It follows the gradients' scale as training goes (a fixed tau does not).

    Args:
        vectors: ``[n, d]`` rows (NaN/inf rows dropped).
        weights: ``[n]`` non-negative weights.
        center: where distances are measured from; None: the weighted coordinate-wise median.

    Returns:
        A positive radius (a tiny one when all usable rows coincide).
    """
    vectors, weights = _usable_rows(vectors, weights)
    if center is None:
        center = weighted_coordinate_median(vectors, weights)
    distances = torch.stack([torch.linalg.vector_norm(row - center).double() for row in vectors])
    order = torch.argsort(distances)
    cumulative = torch.cumsum(weights[order], dim=0)
    median = distances[order][int(torch.argmax((cumulative >= cumulative[-1] / 2).to(torch.uint8)))]
    return max(float(median), torch.finfo(vectors.dtype).tiny)


def centered_clip(
    vectors: torch.Tensor,
    weights: torch.Tensor,
    *,
    tau: float,
    iterations: int = 20,
    center: torch.Tensor | None = None,
    tolerance: float = 1e-5,
) -> torch.Tensor:
    """CenteredClip (Karimireddy et al. 2021, Alg. 2): a weighted mean that bad rows cannot drag.

    Iterates ``v <- v + sum_i w_i (x_i - v) min(1, tau / ||x_i - v||) / sum_i w_i`` at most
    ``iterations`` times, stopping once a step moves ``v`` by less than ``tolerance * tau``.

    The start is the weighted coordinate-wise median, not the mean: the mean is already dragged
    arbitrarily far by one bad row, and the iteration then needs ~distance/tau steps to come
    back, while the median starts within the honest spread (with bad weight below 1/2).

    Choosing ``tau`` (BTARD §3 ties it to the honest vectors' spread): the bias a fraction
    delta of bad weight can cause is at most ~delta * tau per step, and honest rows farther than
    tau are also shortened. Lower it if one bad peer still visibly moves the result (loss
    spikes when a bad peer is in the group); raise it if training with only honest peers is
    slower than with the plain mean (honest spread clipped: the result is pulled toward the
    median). ``choose_tau`` gives the median honest distance; ``math.inf`` gives the plain
    weighted mean (one step).

    Args:
        vectors: ``[n, d]`` floating-point rows, one per peer. Rows holding NaN/inf are dropped
            with a warning, as are rows of zero weight.
        weights: ``[n]`` non-negative weights (e.g. sample counts).
        tau: clipping radius (> 0; ``math.inf`` allowed).
        iterations: at most this many steps (>= 1).
        center: the starting point ``[d]``; None: the weighted coordinate-wise median.
        tolerance: relative stopping threshold, in units of ``tau`` (0: run every iteration).

    Returns:
        ``[d]`` tensor of ``vectors``' dtype (float16/bfloat16 are computed in float32).

    Raises:
        ConfigError: bad shapes, weights, tau, iterations or center.
        NothingToAggregate: no finite row with a positive weight.
    """
    _check_clip_arguments(tau, iterations, tolerance)
    vectors, weights = _usable_rows(vectors, weights)
    dtype = vectors.dtype
    if vectors.element_size() < 4:
        vectors = vectors.float()
    if center is not None:
        if center.shape != vectors.shape[1:] or not bool(torch.isfinite(center).all()):
            raise ConfigError(
                f"center must be a finite [{vectors.shape[1]}] vector - help: pass None to "
                "start at the coordinate-wise median"
            )
        v = center.to(device=vectors.device, dtype=vectors.dtype).clone()
    elif len(vectors) == 1:
        return vectors[0].to(dtype).clone()
    else:
        v = weighted_coordinate_median(vectors, weights)
    share = (weights / weights.sum()).tolist()
    step = torch.empty_like(v)
    difference = torch.empty_like(v)
    for _ in range(iterations):
        step.zero_()
        # One row at a time: a d-sized temporary instead of an n x d one (parts are large).
        for row, p in zip(vectors, share, strict=True):
            torch.sub(row, v, out=difference)
            norm = float(torch.linalg.vector_norm(difference))
            scale = 1.0 if norm <= tau else tau / norm
            step.add_(difference, alpha=p * scale)
        v.add_(step)
        moved = float(torch.linalg.vector_norm(step))
        if not math.isfinite(moved):
            raise NothingToAggregate(
                "CenteredClip overflowed - help: the vectors are too large for their dtype; "
                "send float32"
            )
        if moved <= tolerance * tau:
            break
    return v.to(dtype)


class ClippedPartReducer(PartReducer):
    """A ``PartReducer`` whose average is CenteredClip over whole parts, not a streamed mean.

    Every accepted chunk is also kept in a ``[senders, part size]`` float32 buffer. Completed
    chunks are held back until the whole part is complete; ``compute`` then reduces, for each
    set of senders that delivered the same chunks (usually one set: everybody, over the whole
    part), those chunks together, so norms and the clipping radius are over the largest span
    with the same participants. ``accept``/``exclude``/``reject`` return every chunk at once,
    when the last one completes.
    """

    checks_averages = False  # CenteredClip's result is encoded with the codec's own check

    def __init__(
        self,
        plan: PartitionPlan,
        part_index: int,
        senders: Mapping[Any, float],
        round_id: Hashable,
        aggregation: Aggregation,
        on_non_finite: Callable[[Any, int], None] | None = None,
    ) -> None:
        """Args: as ``PartReducer`` (a fresh accumulator: it may be written from a thread), and
        ``aggregation``: tau, iterations and tolerance of CenteredClip. Every chunk is checked
        as it arrives (it is kept in the rows, which must hold finite values only).
        """
        super().__init__(
            plan, part_index, senders, round_id, on_non_finite=on_non_finite, max_kept_bytes=0
        )
        self.aggregation = aggregation
        self.rows = torch.zeros(len(self.weights), plan.part_sizes[part_index])
        self.row_of = {sender: row for row, sender in enumerate(self.weights)}
        self.computed = False
        self._released = False
        self.taus: list[float] = []  # the radius used for each span (for logs and tests)

    def accept(
        self,
        sender: Hashable,
        round_id: Hashable,
        part_index: int,
        chunk_index: int,
        values: torch.Tensor,
    ) -> tuple[int, ...]:
        completed = super().accept(sender, round_id, part_index, chunk_index, values)
        if sender in self.delivered[chunk_index]:  # checked by super(): size, dtype, finite
            spec = self.chunks[chunk_index]
            self.rows[self.row_of[sender], spec.part_offset : spec.part_offset + spec.size] = values
        return completed

    def _resolve(self, chunk_index: int) -> tuple[int, ...]:
        super()._resolve(chunk_index)
        if self._released or not all(self.is_complete(c) for c in range(len(self.chunks))):
            return ()
        self._released = True
        return tuple(range(len(self.chunks)))

    def _settle(self, chunk_index: int) -> None:
        pass  # the averages are CenteredClip's, computed once the whole part is in

    def compute(self) -> None:
        """Reduce every complete part with CenteredClip into the accumulator (call once)."""
        if self.computed:
            return
        if not all(self.is_complete(c) for c in range(len(self.chunks))):
            raise KitUsageError(
                "the part is not complete yet - help: compute once accept/exclude returned chunks"
            )
        spans: dict[frozenset[Hashable], list[int]] = {}
        for chunk, delivered in enumerate(self.delivered):
            if delivered:
                spans.setdefault(frozenset(delivered), []).append(chunk)
        for senders, chunks in spans.items():
            self._reduce_span(sorted(senders, key=self.row_of.__getitem__), chunks)
        self.computed = True

    def _reduce_span(self, senders: list[Hashable], chunks: list[int]) -> None:
        slices = [
            slice(self.chunks[c].part_offset, self.chunks[c].part_offset + self.chunks[c].size)
            for c in chunks
        ]
        rows = [self.row_of[s] for s in senders]
        if len(rows) == len(self.weights) and len(chunks) == len(self.chunks):
            vectors = self.rows  # the usual case: everybody, the whole part (no copy)
        else:
            vectors = torch.cat([self.rows[rows, s] for s in slices], dim=1)
        weights = torch.tensor([self.weights[s] for s in senders], dtype=torch.float64)
        center = weighted_coordinate_median(vectors, weights)
        tau = self.aggregation.tau or choose_tau(vectors, weights, center)
        self.taus.append(tau)
        result = centered_clip(
            vectors,
            weights,
            tau=tau,
            iterations=self.aggregation.iterations,
            center=center,
            tolerance=self.aggregation.tolerance,
        )
        position = 0
        for s in slices:
            size = s.stop - s.start
            self.accumulator[s] = result[position : position + size]
            position += size

    def averaged(self, chunk_index: int) -> torch.Tensor | None:
        """The clipped average of a chunk (float32), or None if nobody delivered it."""
        if not self.is_complete(chunk_index):
            return super().averaged(chunk_index)  # raises KitUsageError
        self.compute()
        return super().averaged(chunk_index)
