"""kit over shaped "Internet" links (network namespaces, ``tc tbf``): goodput against the line rate.

Needs root, iproute2 and nftables (see kit.testing.netsim). Every host gets a ``--rate-mbit``
link up and down. Measured, each as the median of ``--rounds`` transfers of ``--size-mib`` MiB
(after a warm-up), sender to receiver, acknowledged with a SHA-256 of what arrived:

* ``tcp_mbit_s``: plain TCP between two public hosts (what the link gives any program);
* ``direct_mbit_s``: kit between two public hosts;
* ``relayed_mbit_s``: kit between two NAT'd hosts (client mode) through a public relay host.

Averaging (issue 10; real ``DecentralizedAverager`` peers, ``tests/netsim/averaging_peer.py``,
a ``--avg-size-mb`` MB float32 tensor, median of the steady rounds 1..``--avg-rounds``-1):

* scenario 1, four peers on ``--rate-mbit`` links: ``allreduce_vs_lower_bound`` = round time over
  2(N-1)/N * M / B, every peer declaring the line rate (even split);
  ``allreduce_measured_bw_vs_lower_bound``: the same with the averager measuring bandwidth itself;
* scenario 2, one 1 Gbit/s peer and three 50 Mbit/s: ``lp_vs_even_split`` = round time with the
  LP fed the true rates over the round time with every peer declaring the same bandwidth.

``allreduce_vs_hivemind`` stays null: hivemind's anchor was not run in these namespaces.

    sudo python benchmarks/wan.py --rate-mbit 100 --size-mib 32 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

from kit.errors import NetnsUnavailable
from kit.testing.netsim import HostSpec, LinkShape, NetSim, check_available, read_line

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEER = "tests.netsim.peer"
TCP_PORT = 7100
TIMEOUT = 120.0
MBIT = 1e6 / 8  # bytes/s per Mbit/s


def tcp_receive(size: int, rounds: int) -> None:
    """Accept one connection; per round read ``size`` bytes and answer one byte."""
    server = socket.create_server(("0.0.0.0", TCP_PORT))
    server.settimeout(TIMEOUT)
    print("ready", flush=True)
    connection, _ = server.accept()
    connection.settimeout(TIMEOUT)
    buffer = bytearray(2**20)
    for _ in range(rounds + 1):
        left = size
        while left:
            got = connection.recv_into(buffer, min(left, len(buffer)))
            if not got:
                return
            left -= got
        connection.sendall(b"k")
    connection.close()


def tcp_send(host: str, size: int, rounds: int) -> None:
    connection = socket.create_connection((host, TCP_PORT), timeout=TIMEOUT)
    payload = bytes(size)
    rates = []
    for _ in range(rounds + 1):
        start = time.perf_counter()
        connection.sendall(payload)
        if connection.recv(1) != b"k":
            raise SystemExit("the TCP receiver hung up")
        rates.append(size * 8 / (time.perf_counter() - start) / 1e6)
    print(json.dumps({"goodput_mbit_s": rates[1:]}), flush=True)


def measure_tcp(sim: NetSim, size_mib: int, rounds: int) -> list[float]:
    common = ["--size-mib", str(size_mib), "--rounds", str(rounds)]
    receiver = sim.popen("b", [sys.executable, __file__, "--role", "tcp-receive", *common])
    read_line(receiver, timeout=30.0)
    target = sim.host("b").address
    done = sim.run(
        "a",
        [sys.executable, __file__, "--role", "tcp-send", "--target", target, *common],
        timeout=TIMEOUT,
    )
    if done.returncode != 0:
        raise RuntimeError(f"TCP sender failed: {done.stderr[-2000:]}")
    return list(json.loads(done.stdout.strip().splitlines()[-1])["goodput_mbit_s"])


def start_peer(sim: NetSim, host: str, *args: str) -> str:
    process = sim.python(host, PEER, "serve", *args)
    return str(json.loads(read_line(process, timeout=30.0))["address"])


def measure_kit(sim: NetSim, host: str, size_mib: int, rounds: int, *args: str) -> list[float]:
    argv = [sys.executable, "-m", PEER, "send", "--size-mib", str(size_mib)]
    done = sim.run(host, [*argv, "--rounds", str(rounds), *args], timeout=TIMEOUT)
    if done.returncode != 0:
        raise RuntimeError(f"kit sender failed: {done.stderr[-2000:]}")
    return list(json.loads(done.stdout.strip().splitlines()[-1])["goodput_mbit_s"])


def steady_round_s(table: list[dict[str, object]]) -> float:
    if not all(row["ok"] for row in table):
        raise RuntimeError(f"an averaging round failed: {table}")
    return statistics.median(float(row["round_s"]) for row in table[1:])  # type: ignore[arg-type]


def measure_averaging(rate_mbit: float, size_mb: float, rounds: int) -> dict[str, object]:
    """Issue 10's scenarios 1 (equal links) and 2 (one fast peer, LP against an even split)."""
    sys.path.insert(0, ROOT)  # the peer helper lives in the checkout's tests/, next to benchmarks/
    from tests.netsim.averaging_peer import run_rounds

    peers = [f"p{i}" for i in range(4)]
    result: dict[str, object] = {"avg_size_mb": size_mb, "avg_rounds": rounds}
    with NetSim([HostSpec(h, shape=LinkShape(rate_mbit=rate_mbit)) for h in peers]) as sim:
        declared = run_rounds(
            sim, peers, size_mb=size_mb, rounds=rounds, bandwidths=[rate_mbit * MBIT] * 4
        )
        measured = run_rounds(sim, peers, size_mb=size_mb, rounds=rounds)
    bound = 2 * (4 - 1) / 4 * size_mb * 1e6 / (rate_mbit * MBIT)
    result["allreduce_lower_bound_s"] = round(bound, 3)
    result["allreduce_round_s"] = round(steady_round_s(declared), 3)
    result["allreduce_vs_lower_bound"] = round(steady_round_s(declared) / bound, 3)
    result["allreduce_measured_bw_vs_lower_bound"] = round(steady_round_s(measured) / bound, 3)
    hosts, rates = ["fast", "slow1", "slow2", "slow3"], [1000.0, 50.0, 50.0, 50.0]
    specs = [HostSpec(h, shape=LinkShape(rate_mbit=r)) for h, r in zip(hosts, rates, strict=True)]
    with NetSim(specs) as sim:
        even = run_rounds(sim, hosts, size_mb=size_mb, rounds=rounds, bandwidths=[1.0] * 4)
        lp = run_rounds(
            sim, hosts, size_mb=size_mb, rounds=rounds, bandwidths=[r * MBIT for r in rates]
        )
    result["lp_round_s"] = round(steady_round_s(lp), 3)
    result["even_split_round_s"] = round(steady_round_s(even), 3)
    result["lp_vs_even_split"] = round(steady_round_s(lp) / steady_round_s(even), 3)
    result["lp_part_sizes"] = lp[-1]["part_sizes"]
    return result


def run_benchmark(
    rate_mbit: float, size_mib: int, rounds: int, avg_size_mb: float, avg_rounds: int
) -> dict[str, object]:
    shape = LinkShape(rate_mbit=rate_mbit)
    hosts = [HostSpec(name, shape=shape) for name in ("a", "b", "relay")]
    hosts += [HostSpec(name, nat=True, shape=shape) for name in ("alice", "bob")]
    with NetSim(hosts) as sim:
        tcp = measure_tcp(sim, size_mib, rounds)
        b_address = start_peer(sim, "b", "--host", sim.host("b").address)
        direct = measure_kit(
            sim, "a", size_mib, rounds, "--host", sim.host("a").address, "--target", b_address
        )
        relay = start_peer(sim, "relay", "--relay", "--host", sim.host("relay").address)
        alice = start_peer(sim, "alice", "--client-mode", "true", "--initial-peer", relay)
        relayed = measure_kit(
            sim, "bob", size_mib, rounds, "--client-mode", "true", "--initial-peer", relay,
            "--target", alice,
        )  # fmt: skip
    medians = {name: statistics.median(rates) for name, rates in
               (("tcp", tcp), ("direct", direct), ("relayed", relayed))}  # fmt: skip
    result: dict[str, object] = {"rate_mbit": rate_mbit, "size_mib": size_mib, "rounds": rounds}
    for name, median in medians.items():
        result[f"{name}_mbit_s"] = round(median, 1)
        result[f"{name}_vs_link"] = round(median / rate_mbit, 3)
    result["direct_vs_tcp"] = round(medians["direct"] / medians["tcp"], 3)
    result["relayed_vs_tcp"] = round(medians["relayed"] / medians["tcp"], 3)
    result.update(measure_averaging(rate_mbit, avg_size_mb, avg_rounds))
    result["allreduce_vs_hivemind"] = None
    result["note"] = (
        "no added delay (kernel without sch_netem); allreduce_vs_hivemind: anchor not run here"
    )
    return result


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rate-mbit", type=float, default=100.0)
    parser.add_argument("--size-mib", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--avg-size-mb", type=float, default=16.0, help="averaged tensor, 1e6 B")
    parser.add_argument("--avg-rounds", type=int, default=5, help="averaging rounds (1st skipped)")
    parser.add_argument("--role", default="main", help=argparse.SUPPRESS)
    parser.add_argument("--target", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    size = args.size_mib * 2**20
    if args.role == "tcp-receive":
        tcp_receive(size, args.rounds)
        return 0
    if args.role == "tcp-send":
        tcp_send(args.target, size, args.rounds)
        return 0
    try:
        check_available()
    except NetnsUnavailable as e:
        print(json.dumps({"error": str(e)}))
        return 2
    figures = run_benchmark(
        args.rate_mbit, args.size_mib, args.rounds, args.avg_size_mb, args.avg_rounds
    )
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
