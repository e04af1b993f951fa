"""Load balancing: how much of the averaged vector each peer of a group aggregates.

Holds the time model of one butterfly all-reduce round, the linear program that minimises it
(DeDLOC's, solved with HiGHS), the exact integer split of a vector into per-peer parts, and how
a peer measures the bandwidth it tells the LP (``BandwidthEstimate``). It does not hold the
parts' bookkeeping (``kit.averaging.partition``) or any networking.

Time model (after DeDLOC, Diskin et al. 2021, appendix on load balancing). A group averages a
vector of M values. *Senders* (every peer but auxiliary ones) contribute a vector; *aggregators*
(every peer but client-mode ones, which cannot accept connections) each own a fraction w_i of
the vector, with sum(w) = 1 and w_i = 0 for clients. Let S be the number of senders. Counting the
bytes each peer pushes through its link in one direction (the other direction carries the same):

* a sender sends the pieces it does not own to their owners: (1 - w_i) M, and gets them back
  averaged: the same amount inbound;
* an aggregator receives its piece from every *other* sender: (S - 1) w_i M if it is a sender
  itself, S w_i M if it is auxiliary, and sends the average back: the same amount outbound.

So with bandwidth b_i, peer i is busy for t_i = L_i / b_i where, in units of M:

    sender-aggregator    L_i = (1 - w_i) + (S - 1) w_i = 1 + (S - 2) w_i
    auxiliary            L_i = S w_i
    client               L_i = 1                  (its whole vector out, the average back)

The round lasts max_i t_i. Minimising it is the LP: minimise xi subject to sum(w) = 1, w >= 0,
((S - 2) / b_i) w_i - xi <= -1 / b_i for sender-aggregators and (S / b_i) w_i - xi <= 0 for
auxiliary peers. Client rows are constants (they bound xi but cannot move w), so they are left
out of the LP and only reported in ``LoadPlan.bottleneck``. hivemind writes N (the group size)
where S stands; the two agree when nobody is auxiliary.

When S = 2 every split takes the same time (each peer moves exactly one vector), and in general
peers whose base load already dominates leave the others' split free. A second LP picks, among
the fastest splits, the one closest to proportional to bandwidth (minimise max_i w_i / b_i), so
the answer is unique: all peers of a group must compute the same split from the same inputs.
Fractions are then snapped to a grid of 1e-6 and split with integer arithmetic (largest
remainder, ties to the lower index), so the integer part sizes are bit-identical everywhere the
LP agrees to within the grid.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import sys
import threading
from collections.abc import Sequence

import numpy as np

from kit.errors import ConfigError, InvalidBandwidth, NoAggregators

logger = logging.getLogger(__name__)

GRID = 10**6  # fractions are snapped to multiples of 1/GRID before the integer split
OPTIMUM_SLACK = 1e-7  # relative slack on the best round time when breaking ties (LP tolerance)
BANDWIDTH_EMA_ALPHA = 0.3  # weight of the newest round in a measured bandwidth
MIN_MEASURED_BYTES = 2**20  # smaller rounds are latency-bound: they say nothing of bandwidth
REPROBE_AFTER = 4  # rounds in a row without a part, then a peer's bandwidth is measured afresh


@dataclasses.dataclass(frozen=True)
class LoadPlan:
    """The solution for one group: integer shares of a grid, and the predicted round time."""

    shares: tuple[int, ...]  # peer i aggregates shares[i] / sum(shares) of the vector
    bottleneck: float  # max_i L_i / b_i: seconds per vector-unit when b is in units per second

    @property
    def fractions(self) -> tuple[float, ...]:
        total = sum(self.shares)
        return tuple(share / total for share in self.shares)


def optimize_fractions(
    bandwidths: Sequence[float | None],
    *,
    client_mode: Sequence[bool] | None = None,
    auxiliary: Sequence[bool] | None = None,
) -> LoadPlan:
    """Solve the load-balancing LP for one group (see the module docstring for the model).

    Args:
        bandwidths: per peer, in any one unit; 0 marks a client-mode peer (hivemind's
            convention) and None "unknown" (the mean of the known aggregators' bandwidths).
        client_mode: per peer, True if it cannot accept connections (aggregates nothing).
        auxiliary: per peer, True if it aggregates but sends no vector of its own.

    Returns:
        The plan; clients and peers left without work get share 0.

    Raises:
        InvalidBandwidth: a bandwidth is negative, NaN or infinite, or 0 for a peer flagged
            ``client_mode=False``.
        ConfigError: the flags do not match ``bandwidths`` in length, or a peer is both
            auxiliary and client-mode.
        NoAggregators: every peer is client-mode, so nobody can aggregate.
    """
    n = len(bandwidths)
    clients = _flags(client_mode, n, "client_mode")
    aux = _flags(auxiliary, n, "auxiliary")
    for i, b in enumerate(bandwidths):
        if b is not None and not (_is_real(b) and math.isfinite(b) and b >= 0):
            raise InvalidBandwidth(
                f"peer {i} has bandwidth {b!r} - help: give a finite value >= 0 (0 = client-mode)"
            )
        if b == 0 and client_mode is not None and not clients[i]:
            raise InvalidBandwidth(
                f"peer {i} is not client-mode but has bandwidth 0 - help: measure its bandwidth, "
                "or mark it client_mode=True"
            )
        clients[i] = clients[i] or b == 0
        if clients[i] and aux[i]:
            raise ConfigError(
                f"peer {i} is both auxiliary and client-mode"
                " - help: an auxiliary peer must accept connections (client_mode=False)"
            )
    aggregators = [i for i in range(n) if not clients[i]]
    if not aggregators:
        raise NoAggregators(
            f"all {n} peers of the group are client-mode, so nobody can aggregate - help: at least "
            "one peer must accept incoming connections (client_mode=False, a public or relayed "
            "address); the next round may find one"
        )
    known = [b for i, b in enumerate(bandwidths) if b is not None and not clients[i]]
    default = sum(known) / len(known) if known else 1.0
    resolved = [default if b is None else float(b) for b in bandwidths]
    speeds = np.array([resolved[i] for i in aggregators])
    senders = n - sum(aux)
    base = np.array([0.0 if aux[i] else 1.0 for i in aggregators])  # L_i = base + slope * w_i
    slope = np.array([senders if aux[i] else senders - 2.0 for i in aggregators])
    # The LP sees bandwidths scaled into (0, 1]: better conditioned, same solution.
    fractions = _solve(base, slope, speeds / speeds.max())
    shares = [0] * n
    for i, fraction in zip(aggregators, fractions, strict=True):
        shares[i] = int(round(fraction * GRID))
    if sum(shares) == 0:  # cannot happen for a solution summing to 1; keep the split defined
        shares[aggregators[0]] = GRID
    total = sum(shares)
    times = [
        (base[k] + slope[k] * shares[i] / total) / speeds[k] for k, i in enumerate(aggregators)
    ]
    times += [1.0 / resolved[i] for i in range(n) if clients[i] and resolved[i] > 0]
    return LoadPlan(tuple(shares), float(max(times)))


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _flags(flags: Sequence[bool] | None, n: int, name: str) -> list[bool]:
    if flags is None:
        return [False] * n
    if len(flags) != n:
        raise ConfigError(
            f"{name} has {len(flags)} entries for {n} peers - help: give one per peer"
        )
    return [bool(flag) for flag in flags]


_solver_import: threading.Thread | None = None


def preload_solver() -> None:
    """Start importing the LP solver in a background thread (once per process; never raises).

    A peer that may lead calls this when it first looks for a group. Imported only on first use,
    scipy.optimize (~0.3-0.5 s) held up every round whose leader had not led before: its last
    follower's "accepted" waited for the import (measured, 4 peers at 100 Mbit/s: matchmaking
    0.29-0.45 s in such rounds, 0.02-0.04 s in the others). In a thread, the import neither
    blocks the event loop nor delays a late joiner's first step; a leader whose import is still
    running splits by bandwidth for that round instead of waiting (see ``_solve``).
    """
    global _solver_import
    if _solver_import is None and "scipy.optimize" not in sys.modules:
        _solver_import = threading.Thread(target=_import_solver, name="kit-lp-import", daemon=True)
        _solver_import.start()


def _import_solver() -> None:
    try:
        import scipy.optimize  # noqa: F401
    except Exception as e:  # the LP's own import raises it where it matters
        logger.debug("preloading scipy.optimize failed: %r", e)


def _solve(base: np.ndarray, slope: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Fractions minimising max_i (base_i + slope_i w_i) / b_i, ties broken toward w ∝ b.

    Both LPs have the variables [w_1 .. w_k, z] and minimise z: first z = xi (the round
    time), then z = eta (the largest w_i / b_i) among splits within the best time.
    """
    k = len(b)
    if k == 1:
        return np.ones(1)
    # Imported here, not at module level: scipy.optimize costs ~0.5 s of import, which a late
    # joiner would otherwise pay before its first step (kit.Optimizer imports kit.averaging);
    # only a leader of a group with several aggregators ever solves the LP. Peers that may lead
    # import it ahead, in the background (preload_solver); until that is done, a leader splits
    # by bandwidth rather than block its event loop on the import (its followers would time out).
    loading = _solver_import
    if loading is not None and loading.is_alive():
        logger.debug("the LP solver is still being imported: splitting by bandwidth this round")
        return b / b.sum()
    import scipy.optimize

    minimise_z = np.zeros(k + 1)
    minimise_z[-1] = 1.0
    weights_sum_to_one = {"A_eq": np.ones((1, k + 1)), "b_eq": np.ones(1)}
    weights_sum_to_one["A_eq"][0, -1] = 0.0
    bounds = [(0.0, None)] * k + [(None, None)]
    time_rows = np.hstack([np.diag(slope / b), np.zeros((k, 1))])  # t_i - base_i / b_i
    z_column = np.hstack([np.zeros((k, k)), np.ones((k, 1))])
    first = scipy.optimize.linprog(
        minimise_z,
        A_ub=time_rows - z_column,
        b_ub=-base / b,
        bounds=bounds,
        method="highs",
        **weights_sum_to_one,
    )
    if first.status != 0:
        logger.warning("load-balancing LP failed (%s); splitting by bandwidth", first.message)
        return b / b.sum()
    limit = first.x[-1] + OPTIMUM_SLACK * max(abs(first.x[-1]), 1.0)
    proportional_rows = np.hstack([np.diag(1 / b), np.zeros((k, 1))]) - z_column
    second = scipy.optimize.linprog(
        minimise_z,
        A_ub=np.vstack([time_rows, proportional_rows]),
        b_ub=np.concatenate([limit - base / b, np.zeros(k)]),
        bounds=bounds,
        method="highs",
        **weights_sum_to_one,
    )
    fractions = second.x[:k] if second.status == 0 else first.x[:k]
    return np.maximum(fractions, 0.0)  # HiGHS may return -1e-17 for a zero


def split_sizes(total_size: int, shares: Sequence[int], *, min_size: int = 0) -> tuple[int, ...]:
    """Split ``total_size`` elements in proportion to integer ``shares``, exactly.

    Largest remainder (Hagenbach-Bischoff quotas): each peer gets floor(total * share / sum),
    and the few leftover elements go to the largest remainders, ties to the lower index. Only
    integers are involved, so every peer computes the same sizes.

    Args:
        total_size: elements in the averaged vector.
        shares: non-negative integers, not all zero (``LoadPlan.shares``).
        min_size: peers whose part would hold fewer elements get none; their share goes to
            the others (a tiny part costs a round trip and saves nothing).

    Raises:
        ConfigError: negative sizes or shares, or all shares zero.
    """
    if total_size < 0 or min_size < 0 or any(share < 0 for share in shares) or not any(shares):
        raise ConfigError(
            f"cannot split {total_size} elements by shares {list(shares)}"
            " - help: use non-negative sizes and at least one positive share"
        )
    shares = list(shares)
    total_share = sum(shares)
    small = [
        i
        for i, share in enumerate(shares)
        if share > 0 and total_size * share < min_size * total_share
    ]
    if len(small) < sum(1 for share in shares if share > 0):  # someone is left to take over
        for i in small:
            shares[i] = 0
        total_share = sum(shares)
    sizes = [total_size * share // total_share for share in shares]
    remainders = [total_size * share % total_share for share in shares]
    leftover = total_size - sum(sizes)
    for i in sorted(range(len(shares)), key=lambda i: (-remainders[i], i))[:leftover]:
        sizes[i] += 1
    return tuple(sizes)


def load_balance_peers(
    vector_size: int,
    bandwidths: Sequence[float | None],
    min_size: int = 0,
    *,
    client_mode: Sequence[bool] | None = None,
    auxiliary: Sequence[bool] | None = None,
) -> tuple[int, ...]:
    """Elements of the vector each peer aggregates (hivemind's function, same arguments).

    See ``optimize_fractions`` for the arguments and errors and ``split_sizes`` for
    ``min_size``. The sizes sum to ``vector_size``; client-mode peers get 0.
    """
    plan = optimize_fractions(bandwidths, client_mode=client_mode, auxiliary=auxiliary)
    return split_sizes(vector_size, plan.shares, min_size=min_size)


@dataclasses.dataclass(frozen=True)
class BandwidthEstimate:
    """A peer's bandwidth as the LP above is told it: measured from its own rounds.

    ``bytes_per_s`` is None until measured (the LP then uses the group's mean, and chunks stay
    unscaled: ``partition.chunk_scale``); ``idle_rounds`` counts the rounds in a row that gave
    this peer, which could aggregate, no part.
    """

    bytes_per_s: float | None = None
    idle_rounds: int = 0

    def after_round(
        self, moved: int, seconds: float, *, could_aggregate: bool, aggregated: bool
    ) -> BandwidthEstimate:
        """The estimate after a round in which this peer moved ``moved`` bytes (sent and
        received) in ``seconds``; ``could_aggregate``: it was no client in that group;
        ``aggregated``: the LP gave it a part.

        A round without a part, for a peer that could have had one, leaves the estimate as it
        is: the peer sent its vector and waited for the aggregators, so its bytes over the time
        are a fraction of what it could move. Learning from such rounds locked a peer out for
        good (without a part it measured less, so it got none again: the relay of
        ``tests/netsim/test_hole_punch.py``, busy for a few rounds). After ``REPROBE_AFTER`` of
        them in a row the estimate is forgotten: the LP gives the peer the mean share and it is
        measured afresh (that round's chunks are unscaled). A client's rounds are all without a
        part: measured as they are (the LP gives clients nothing; chunks follow the slowest
        member, and a low figure only keeps them small).

        What this cannot do: tell a slow member from the others. Every member measures its
        bytes over about the same time, the slowest member's, so the estimates follow the loads
        the LP gave more than the links (a link's speed would need the time it was busy).
        """
        if could_aggregate and not aggregated:
            idle = self.idle_rounds + 1
            if idle >= REPROBE_AFTER:
                return BandwidthEstimate(None, 0)
            return BandwidthEstimate(self.bytes_per_s, idle)
        if moved < MIN_MEASURED_BYTES or seconds <= 0:
            return BandwidthEstimate(self.bytes_per_s, 0)  # latency-bound: says nothing
        measured = moved / seconds
        previous = self.bytes_per_s
        if previous is None:
            return BandwidthEstimate(measured, 0)
        ema = (1 - BANDWIDTH_EMA_ALPHA) * previous + BANDWIDTH_EMA_ALPHA * measured
        return BandwidthEstimate(ema, 0)
