"""Load balancing: the LP against its time model, the integer split, and bad inputs."""

from __future__ import annotations

import math
import subprocess
import sys
import threading

import numpy as np
import pytest

from kit.averaging import balancing
from kit.averaging.balancing import load_balance_peers, optimize_fractions, split_sizes
from kit.errors import ConfigError, InvalidBandwidth, NoAggregators, TransientError

M = 18_000_000  # one 72 MB float32 part


def round_time(fractions: list[float], bandwidths: list[float], aux: list[bool]) -> float:
    """The module's time model, written out independently: max over peers of load / bandwidth."""
    senders = sum(not a for a in aux)
    times = []
    for w, b, a in zip(fractions, bandwidths, aux, strict=True):
        own = 0.0 if a else (1 - w)  # pieces of its own vector it sends away (and gets back)
        others = (senders - (0 if a else 1)) * w  # pieces it receives, then returns averaged
        times.append((own + others) / b)
    return max(times)


@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_equal_bandwidths_split_evenly(n: int) -> None:
    sizes = load_balance_peers(M + 3, [100.0] * n)
    assert sum(sizes) == M + 3 and max(sizes) - min(sizes) <= 1


def test_a_fast_server_with_slow_peers_becomes_a_parameter_server() -> None:
    assert load_balance_peers(M, [1000.0, 10.0, 10.0, 10.0]) == (M, 0, 0, 0)
    assert load_balance_peers(M, [10.0, 10.0, 1000.0], client_mode=[True, True, False]) == (0, 0, M)


def test_faster_peers_get_bigger_parts() -> None:
    bandwidths = [30.0, 100.0, 50.0, 80.0, 60.0]
    sizes = load_balance_peers(M, bandwidths)
    by_bandwidth = [size for _, size in sorted(zip(bandwidths, sizes, strict=True))]
    assert by_bandwidth == sorted(by_bandwidth) and by_bandwidth[-1] > by_bandwidth[1]


def test_share_grows_with_own_bandwidth() -> None:
    shares = [optimize_fractions([b, 20.0, 35.0, 50.0]).shares[0] for b in np.linspace(1, 200, 40)]
    assert shares == sorted(shares) and shares[0] == 0 and shares[-1] > 500_000


@pytest.mark.parametrize(
    "bandwidths, aux",
    [
        ([10.0, 20.0, 30.0], [False] * 3),
        ([5.0, 100.0, 40.0, 40.0, 7.0], [False] * 5),
        ([50.0, 10.0, 10.0, 20.0], [True, False, False, False]),
        ([8.0, 30.0, 30.0], [False, True, True]),
    ],
)
def test_lp_beats_every_random_split(bandwidths: list[float], aux: list[bool]) -> None:
    plan = optimize_fractions(bandwidths, auxiliary=aux)
    best = round_time(list(plan.fractions), bandwidths, aux)
    assert math.isclose(plan.bottleneck, best, rel_tol=1e-9)
    rng = np.random.default_rng(0)
    for candidate in rng.dirichlet(np.ones(len(bandwidths)), size=2000):
        assert best <= round_time(list(candidate), bandwidths, aux) * (1 + 1e-5)


def test_auxiliary_peer_takes_the_solved_share() -> None:
    """Aux peer: 3 w0 (3 senders, no own vector); others: 1 + w. Equal times give w0 = 0.4."""
    plan = optimize_fractions([1.0] * 4, auxiliary=[True, False, False, False])
    assert plan.shares == (400_000, 200_000, 200_000, 200_000)
    assert math.isclose(plan.bottleneck, 1.2, rel_tol=1e-6)


def test_punchable_nat_peers_take_the_parts_off_the_auxiliary_peer() -> None:
    """A coordinator's auxiliary peer, 3 public volunteers and 28 behind NATs, all at the same
    bandwidth. If only public peers aggregate, the four of them carry every part (about a
    quarter each). If the 20 behind punchable NATs aggregate too (``can_accept``), the parts
    spread over all 24 by bandwidth and the round is about 3.7x shorter."""
    aux = [True] + [False] * 31
    public_only = optimize_fractions(
        [100.0] * 32, client_mode=[False] * 4 + [True] * 28, auxiliary=aux
    )
    spread = optimize_fractions([100.0] * 32, client_mode=[False] * 24 + [True] * 8, auxiliary=aux)
    assert public_only.fractions[0] > 0.25 and all(f > 0.24 for f in public_only.fractions[1:4])
    assert spread.fractions[0] < 0.08 and spread.shares[24:] == (0,) * 8
    assert max(spread.fractions[1:24]) - min(spread.fractions[1:24]) < 1e-6
    assert public_only.bottleneck > 3.5 * spread.bottleneck


def test_client_time_counts_in_the_bottleneck() -> None:
    plan = optimize_fractions([1.0, 100.0, 100.0], client_mode=[True, False, False])
    assert plan.shares[0] == 0 and math.isclose(plan.bottleneck, 1.0)  # the client's vector


def test_identical_on_every_call_and_permutation() -> None:
    bandwidths = [13.7, 42.1, 99.9, 7.3, 55.5, 23.4]
    first = load_balance_peers(M, bandwidths)
    assert all(load_balance_peers(M, list(bandwidths)) == first for _ in range(20))
    order = [3, 0, 5, 1, 4, 2]
    permuted = optimize_fractions([bandwidths[i] for i in order]).shares
    assert permuted == tuple(optimize_fractions(bandwidths).shares[i] for i in order)


def test_unknown_bandwidth_is_the_mean_of_known_ones() -> None:
    assert (
        optimize_fractions([None, 10.0, 30.0]).shares
        == optimize_fractions([20.0, 10.0, 30.0]).shares
    )
    assert load_balance_peers(10, [None, None]) == (5, 5)
    assert load_balance_peers(10, [None, 0, 5.0])[1] == 0  # 0 is client-mode (hivemind's rule)


def test_largest_remainder_split_is_exact() -> None:
    assert split_sizes(10, [1, 1, 1]) == (4, 3, 3)
    assert split_sizes(10, [0, 1, 1, 1]) == (0, 4, 3, 3)
    assert split_sizes(7, [5, 3]) == (4, 3)  # quotas 4.375 and 2.625: the larger remainder wins
    big = split_sizes(10**12 + 1, [333_333, 333_333, 333_334])
    assert sum(big) == 10**12 + 1 and big[2] > big[0]
    assert split_sizes(0, [1, 2]) == (0, 0)


def test_tiny_shares_are_reassigned() -> None:
    assert split_sizes(1000, [999_000, 1_000]) == (999, 1)
    assert split_sizes(1000, [999_000, 1_000], min_size=10) == (1000, 0)
    assert split_sizes(1000, [500_000, 499_000, 1_000], min_size=10) == (501, 499, 0)
    assert split_sizes(5, [1, 1], min_size=10) == (3, 2)  # everyone is tiny: nobody is dropped


def test_all_clients_is_a_transient_typed_error() -> None:
    with pytest.raises(NoAggregators, match="help:") as error:
        load_balance_peers(M, [0, 0, 0])
    assert isinstance(error.value, TransientError)
    with pytest.raises(NoAggregators):
        load_balance_peers(M, [10.0, 20.0], client_mode=[True, True])


@pytest.mark.parametrize("bad", [math.nan, -1.0, math.inf, "fast", True])
def test_bad_bandwidths_are_refused(bad: object) -> None:
    with pytest.raises(InvalidBandwidth, match="help:"):
        load_balance_peers(M, [10.0, bad])  # type: ignore[list-item]


def test_inconsistent_flags_are_refused() -> None:
    with pytest.raises(InvalidBandwidth, match="help:"):  # says it aggregates, cannot send
        load_balance_peers(M, [10.0, 0.0], client_mode=[False, False])
    with pytest.raises(ConfigError, match="help:"):
        load_balance_peers(M, [10.0, 10.0], client_mode=[False])
    with pytest.raises(ConfigError, match="help:"):
        load_balance_peers(M, [10.0, 10.0], client_mode=[True, False], auxiliary=[True, False])
    with pytest.raises(ConfigError, match="help:"):
        split_sizes(10, [0, 0])


PRELOAD = (  # a fresh interpreter: here scipy.optimize may be imported already
    "import sys, threading\n"
    "from kit.averaging import balancing\n"
    "assert 'scipy.optimize' not in sys.modules, 'imported with kit.averaging'\n"
    "before = threading.active_count()\n"
    "balancing.preload_solver(); balancing.preload_solver()\n"
    "assert threading.active_count() <= before + 1, 'one import thread at most'\n"
    "thread = balancing._solver_import\n"
    "assert thread is not None; thread.join(60.0)\n"
    "assert 'scipy.optimize' in sys.modules\n"
    "print(balancing.load_balance_peers(8, [1.0, 1.0]))\n"
)


@pytest.mark.processes
def test_the_solver_is_imported_ahead_in_the_background_once() -> None:
    # A new leader's first LP must not wait for scipy's import (matchmaking took 0.3-0.45 s
    # in every round with a new leader), and importing kit.averaging must stay free of it.
    done = subprocess.run(
        [sys.executable, "-c", PRELOAD], capture_output=True, text=True, timeout=120.0
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "(4, 4)"


def test_a_leader_whose_solver_import_still_runs_splits_by_bandwidth(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # It must not block its event loop on the import (its followers would time out).
    release = threading.Event()
    loading = threading.Thread(target=release.wait, args=(10.0,))
    loading.start()
    monkeypatch.setattr(balancing, "_solver_import", loading)
    try:
        # (The LP would give the fast peer everything: (0, 0, 0, 1300).)
        assert load_balance_peers(1300, [1.0, 1.0, 1.0, 10.0]) == (100, 100, 100, 1000)
    finally:
        release.set()
        loading.join(10.0)


MB = 2**20


def test_measured_bandwidth_learns_from_rounds_with_a_part() -> None:
    estimate = balancing.BandwidthEstimate()
    estimate = estimate.after_round(10 * MB, 1.0, could_aggregate=True, aggregated=True)
    assert estimate.bytes_per_s == 10 * MB
    estimate = estimate.after_round(20 * MB, 1.0, could_aggregate=True, aggregated=True)
    alpha = balancing.BANDWIDTH_EMA_ALPHA
    assert estimate.bytes_per_s == pytest.approx((1 - alpha) * 10 * MB + alpha * 20 * MB)
    small = estimate.after_round(MB // 2, 0.01, could_aggregate=True, aggregated=True)
    assert small.bytes_per_s == estimate.bytes_per_s  # latency-bound: says nothing
    # a client's rounds never have a part: measured all the same (a lower bound, for chunks)
    client = balancing.BandwidthEstimate().after_round(
        4 * MB, 2.0, could_aggregate=False, aggregated=False
    )
    assert client == balancing.BandwidthEstimate(2 * MB, 0)


def test_rounds_without_a_part_leave_the_estimate_then_forget_it() -> None:
    estimate = balancing.BandwidthEstimate(8 * MB, 0)
    for idle in range(1, balancing.REPROBE_AFTER):
        estimate = estimate.after_round(MB * 3, 1.0, could_aggregate=True, aggregated=False)
        assert estimate == balancing.BandwidthEstimate(8 * MB, idle)  # not lowered
    estimate = estimate.after_round(MB * 3, 1.0, could_aggregate=True, aggregated=False)
    assert estimate == balancing.BandwidthEstimate(None, 0)  # the LP gives it the mean share
    estimate = estimate.after_round(12 * MB, 2.0, could_aggregate=True, aggregated=True)
    assert estimate == balancing.BandwidthEstimate(6 * MB, 0)  # measured afresh


def simulate_rounds(true_speeds: list[float], first: list[float], rounds: int) -> list[list[int]]:
    """Rounds of a group whose peers tell the LP their estimates and measure what a round lets
    them: every peer moves its load (DeDLOC's model, both directions) at its own speed, and
    the round lasts as long as the busiest one needs; everyone measures its bytes over that."""
    size = 10**6
    estimates = [balancing.BandwidthEstimate(b, 0) for b in first]
    senders = len(true_speeds)
    history = []
    for _ in range(rounds):
        sizes = load_balance_peers(size, [e.bytes_per_s for e in estimates])
        history.append(list(sizes))
        moved = [2 * 4 * ((size - w) + (senders - 1) * w) for w in sizes]  # bytes, out + in
        seconds = max(m / speed for m, speed in zip(moved, true_speeds, strict=True))
        estimates = [
            e.after_round(m, seconds, could_aggregate=True, aggregated=w > 0)
            for e, m, w in zip(estimates, moved, sizes, strict=True)
        ]
    return history


def test_a_peer_measured_low_once_gets_parts_again() -> None:
    """A peer whose estimate fell below the others' (a busy relay, a long pause) got no part,
    then measured only its own vector, and never got a part again. Now it is measured afresh
    after REPROBE_AFTER rounds without one, and keeps its share once its speed shows."""
    history = simulate_rounds([50e6] * 5, [5e6] + [50e6] * 4, rounds=12)
    assert history[0][0] == 0  # excluded by its low estimate
    back = next(r for r, sizes in enumerate(history) if sizes[0] > 0)
    assert back == balancing.REPROBE_AFTER
    assert all(sizes[0] > 0 for sizes in history[back:])
