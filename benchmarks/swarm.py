"""A thousand-peer swarm by simulation: one Moshpit grid average, in simulated time.

    python benchmarks/swarm.py --peers 1024 --group-size 32 --size-mb 1
    python benchmarks/swarm.py --peers 1024 --group-size 32 --nat-fraction 0.9 --punchable 0.7

Every peer runs kit's DHT node, matchmaking and all-reduce in this one process, on
``MemoryNetwork`` with simulated links (``kit.testing.links``: 100 Mbit/s each way, 50 ms round
trip by default) under an event loop on virtual time (``kit.testing.virtual_time``): the times
printed are what the links would give, not what this CPU took (``wall_s`` is that).

One JSON line: ``{"bench": "swarm", "peers", "group_size", "rounds", "group_sizes_min",
"group_sizes_max", "groups_per_round", "failed_per_round", "rounds_to_global_mean",
"max_abs_error_vs_global_mean", "error_per_round", "round_s_simulated", "messages_per_peer",
"mb_sent_per_peer", "dht_lookup_rpcs_per_peer", "wall_s"}``. ``rounds_to_global_mean``: the
first round after which every peer holds the sample-weighted global mean within 1e-5 (null if
none); ``max_abs_error_vs_global_mean``: after the last round; ``round_s_simulated``: per round,
until the last peer finished it; ``dht_lookup_rpcs_per_peer``: FIND requests (one step of a
lookup) served, per peer, during the average.

NAT (``--nat-fraction F``): that share of the peers has no listening socket (client mode,
``kit.p2p.memory_nat.NAT``); ``--punchable P`` of those can be reached directly after a hole
punch (default 0.7: libp2p's DCUtR measurement campaign saw ~70% of punches succeed across real
NATs; 0.3 is a pessimistic setting, 0 means no hole punching) and aggregate; the others are
reached through their relay only and aggregate nothing. ``--no-nat-aggregators``: no peer behind a NAT
aggregates (an explicit ``client_mode=True``: what kit did before hole punching). The line then
adds ``"nat_fraction", "punchable", "nat_counts"`` (peers per kind), ``"aggregators_per_group"``
(members with a part, mean over groups), ``"busiest_peer_vs_median_bytes_per_round"`` (bytes
each peer's links carried, sent + received, all protocols, relayed bytes included, over the
whole average divided by the rounds: the busiest surviving peer over the median one),
``"busiest_peer_mb_per_round", "median_peer_mb_per_round", "busiest_peer_kind"`` (public,
punchable or symmetric) and ``"busiest_peer_relayed_mb_per_round"`` (what it forwarded as a relay).
"""

from __future__ import annotations

import argparse
import json
import logging
import time

TOLERANCE = 1e-5  # an error this small is float32 rounding: the global mean is reached


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--peers", type=int, default=1024)
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--size-mb", type=float, default=1.0, help="MB of float32 averaged")
    parser.add_argument("--bandwidth-mbit", type=float, default=100.0)
    parser.add_argument("--rtt-ms", type=float, default=50.0)
    parser.add_argument("--churn", type=float, default=0.0, help="fraction of peers that crash")
    parser.add_argument("--rounds", type=int, default=None, help="default: ceil(log_G(peers))")
    parser.add_argument("--matchmaking-time", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--nat-fraction", type=float, default=0.0, help="share of peers behind a NAT (client mode)"
    )
    parser.add_argument(
        "--punchable", type=float, default=0.7, help="share of NAT'd peers a hole punch reaches"
    )
    parser.add_argument(
        "--no-nat-aggregators",
        action="store_true",
        help="peers behind a NAT aggregate nothing (only public peers do)",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    import scipy.optimize  # noqa: F401 (the leaders' LP: imported once, not inside a round)

    from kit.testing.swarm import SwarmSpec, simulate_grid_average
    from kit.testing.virtual_time import run_virtual

    spec = SwarmSpec(
        peers=args.peers,
        group_size=args.group_size,
        size=max(1, int(args.size_mb * 2**20 / 4)),
        bandwidth_mbit=args.bandwidth_mbit,
        rtt=args.rtt_ms / 1000,
        churn=args.churn,
        rounds=args.rounds,
        min_matchmaking_time=args.matchmaking_time,
        seed=args.seed,
        nat_fraction=args.nat_fraction,
        punchable=args.punchable,
        natted_aggregate=not args.no_nat_aggregators,
    )
    started = time.perf_counter()
    report = run_virtual(simulate_grid_average(spec))
    sizes = [size for group in report.group_sizes for size in group]
    print(
        json.dumps(
            {
                "bench": "swarm",
                "peers": report.peers,
                "group_size": report.group_size,
                "size_mb": args.size_mb,
                "rounds": report.rounds,
                "group_sizes_min": min(sizes, default=0),
                "group_sizes_max": max(sizes, default=0),
                "groups_per_round": [len(group) for group in report.group_sizes],
                "failed_per_round": list(report.failed),
                "crashed": report.crashed,
                "rounds_to_global_mean": report.rounds_to_global_mean(TOLERANCE),
                "max_abs_error_vs_global_mean": report.max_abs_error[-1],
                "error_per_round": [float(f"{e:.3g}") for e in report.max_abs_error],
                "round_s_simulated": [round(s, 3) for s in report.round_seconds],
                "messages_per_peer": round(report.messages_per_peer, 1),
                "mb_sent_per_peer": round(report.bytes_per_peer / 1e6, 3),
                "dht_lookup_rpcs_per_peer": round(report.dht_finds_per_peer, 1),
                "nat_fraction": args.nat_fraction,
                "punchable": args.punchable,
                "nat_aggregators": not args.no_nat_aggregators,
                "nat_counts": dict(report.nat_counts),
                "aggregators_per_group": round(report.aggregators_per_group, 2),
                "busiest_peer_vs_median_bytes_per_round": round(report.busiest_vs_median, 2),
                "busiest_peer_mb_per_round": round(report.busiest_bytes_per_round / 1e6, 3),
                "median_peer_mb_per_round": round(report.median_bytes_per_round / 1e6, 3),
                "busiest_peer_kind": report.busiest_kind,
                "busiest_peer_relayed_mb_per_round": round(
                    report.busiest_relayed_bytes_per_round / 1e6, 3
                ),
                "wall_s": round(time.perf_counter() - started, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
