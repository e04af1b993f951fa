"""kit DHT store/get latency in an N-node loopback swarm, with the same fields as hivemind's anchor
(``shared/anchors/hivemind/dht_latency.py``), so the two compare in one session as ratios.

    python benchmarks/dht.py --nodes 16 --ops 100

One JSON line: ``{"bench": "dht", "impl": "kit", "nodes", "ops", "startup_s",
"store_ms": {p50, p99}, "get_ms": {p50, p99}, "found"}``. Everything on 127.0.0.1; every node is a
real peer with its own listening socket (one process, as hivemind's anchor drives its DHTs from
one process too).
"""

from __future__ import annotations

import argparse
import json
import time
import uuid


def percentile_ms(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 2)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--ops", type=int, default=100)
    args = parser.parse_args()
    from kit.dht import DHT

    started = time.time()
    first = DHT(host="127.0.0.1", port=0, client_mode=False)
    initial = first.get_visible_maddrs()
    nodes = [first] + [
        DHT(initial_peers=initial, host="127.0.0.1", port=0) for _ in range(args.nodes - 1)
    ]
    startup = time.time() - started
    writer, reader = nodes[-1], nodes[len(nodes) // 2]
    keys = [f"k-{uuid.uuid4().hex}" for _ in range(args.ops)]
    store_times, get_times, found = [], [], 0
    for key in keys:
        begin = time.perf_counter()
        writer.store(key, {"v": key}, time.time() + 120)
        store_times.append(time.perf_counter() - begin)
    for key in keys:
        begin = time.perf_counter()
        result = reader.get(key, latest=True)
        get_times.append(time.perf_counter() - begin)
        found += result is not None and result.value == {"v": key}
    for node in nodes:
        node.shutdown()
    print(
        json.dumps(
            {
                "bench": "dht",
                "impl": "kit",
                "nodes": args.nodes,
                "ops": args.ops,
                "startup_s": round(startup, 2),
                "store_ms": {
                    "p50": percentile_ms(store_times, 0.5),
                    "p99": percentile_ms(store_times, 0.99),
                },
                "get_ms": {
                    "p50": percentile_ms(get_times, 0.5),
                    "p99": percentile_ms(get_times, 0.99),
                },
                "found": found,
            }
        )
    )


if __name__ == "__main__":
    main()
