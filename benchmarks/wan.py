"""kit over shaped "Internet" links (network namespaces, ``tc tbf``): goodput against the line rate.

Needs root, iproute2 and nftables (see kit.testing.netsim). Every host gets a ``--rate-mbit``
link up and down. Measured, each as the median of ``--rounds`` transfers of ``--size-mib`` MiB
(after a warm-up), sender to receiver, acknowledged with a SHA-256 of what arrived:

* ``tcp_mbit_s``: plain TCP between two public hosts (what the link gives any program);
* ``direct_mbit_s``: kit between two public hosts;
* ``relayed_mbit_s``: kit between two NAT'd hosts (client mode) through a public relay host.

Averaging (issue 10; real ``DecentralizedAverager`` peers, ``tests/netsim/averaging_peer.py``;
every figure is the median of the steady rounds 1..``--avg-rounds``-1 of the slowest peer's
``step()``, matchmaking included):

* scenario 1, four peers on ``--rate-mbit`` links, a ``--avg-size-mb`` MB float32 tensor:
  ``allreduce_vs_lower_bound`` = round time over 2(N-1)/N * M / B, every peer declaring the line
  rate (even split), with its matchmaking and all-reduce parts (``allreduce_matchmaking_s``,
  ``allreduce_phase_s``); ``allreduce_measured_bw_vs_lower_bound``: the same with the averager
  measuring bandwidth itself;
* the same hosts, links and tensor with hivemind's ``DecentralizedAverager``
  (``--hivemind-python``: a Python with hivemind installed, which runs
  ``benchmarks/hivemind_allreduce.py`` in each namespace): ``allreduce_vs_hivemind`` = kit's round
  time over hivemind's (null, with ``hivemind_note`` saying why, without the option; hivemind's
  median is over its exact rounds: ``hivemind_inexact_rounds`` lists the others);
* scenario 2, one 1 Gbit/s peer and three 50 Mbit/s, a ``--lp-size-mb`` MB tensor:
  ``lp_vs_even_split`` = round time with the LP fed the true rates over the round time with every
  peer declaring the same bandwidth.

    sudo python benchmarks/wan.py --rate-mbit 100 --size-mib 32 --rounds 3 \
        --hivemind-python /tmp/hm/venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

from kit.errors import NetnsUnavailable
from kit.testing.netns import check_available, read_line
from kit.testing.netsim import DEFAULT_CONGESTION_CONTROL, HostSpec, LinkShape, NetSim

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEER = "tests.netsim.peer"
HIVEMIND_PEER = os.path.join(ROOT, "benchmarks", "hivemind_allreduce.py")
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


def steady(table: list[dict[str, object]], key: str = "round_s", only_ok: bool = False) -> float:
    """The median over the steady rounds (round 0 also opens connections) of ``key``.

    ``only_ok``: over the steady rounds that averaged exactly (hivemind's rounds sometimes end
    with a peer missing a few parts and no error: "received 99.3% results"); else any failed
    round is an error.
    """
    rows = [row for row in table[1:] if row["ok"] or not only_ok]
    if not rows or not all(row["ok"] for row in (rows if only_ok else table)):
        raise RuntimeError(f"an averaging round failed: {table}")
    return statistics.median(float(row[key]) for row in rows)  # type: ignore[arg-type]


def run_hivemind_rounds(
    sim: NetSim, hosts: Sequence[str], python: str, size_mb: float, rounds: int
) -> list[dict[str, object]]:
    """hivemind's averager on ``hosts`` (one peer each), rows as ``averaging_peer.run_rounds``."""
    run_dir = tempfile.mkdtemp(prefix="kit-wan-hivemind-")
    processes = []
    for i, host in enumerate(hosts):
        argv = [python, HIVEMIND_PEER, f"--index={i}", f"--peers={len(hosts)}"]
        argv += [f"--run-dir={run_dir}", f"--host={sim.host(host).address}"]
        processes.append(sim.popen(host, [*argv, f"--size-mb={size_mb}", f"--rounds={rounds}"]))
    give_up = time.monotonic() + 60.0 + rounds * 60.0
    results = []
    for host, process in zip(hosts, processes, strict=True):
        try:
            out, _ = process.communicate(timeout=max(1.0, give_up - time.monotonic()))
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"hivemind peer in {host} did not finish") from e
        lines = out.decode().strip().splitlines()
        if process.returncode != 0 or not lines:
            raise RuntimeError(f"hivemind peer in {host} failed ({process.returncode})")
        results.append(json.loads(lines[-1])["rounds"])
    shutil.rmtree(run_dir, ignore_errors=True)  # barrier files only
    table: list[dict[str, object]] = []
    for r in range(rounds):
        records = [next(x for x in peer if x["round"] == r) for peer in results]
        row: dict[str, object] = {"round": r, "ok": all(x["ok"] for x in records)}
        row["round_s"] = max(x["total_s"] for x in records)
        if row["ok"]:
            row["matchmaking_s"] = max(x["matchmaking_s"] for x in records)
            row["allreduce_s"] = max(x["allreduce_s"] for x in records)
        table.append(row)
    return table


def measure_averaging(
    rate_mbit: float,
    size_mb: float,
    lp_size_mb: float,
    rounds: int,
    hivemind_python: str | None,
    only_scenario_1: bool = False,
    congestion_control: str | None = DEFAULT_CONGESTION_CONTROL,
) -> dict[str, object]:
    """Issue 10's scenarios 1 (equal links, and hivemind on them) and 2 (one fast peer)."""
    sys.path.insert(0, ROOT)  # the peer helper lives in the checkout's tests/, next to benchmarks/
    from tests.netsim.averaging_peer import run_rounds

    peers = [f"p{i}" for i in range(4)]
    result: dict[str, object] = {"avg_size_mb": size_mb, "avg_rounds": rounds}
    hivemind: list[dict[str, object]] | None = None
    specs = [HostSpec(h, shape=LinkShape(rate_mbit=rate_mbit)) for h in peers]
    with NetSim(specs, congestion_control=congestion_control) as sim:
        declared = run_rounds(
            sim, peers, size_mb=size_mb, rounds=rounds, bandwidths=[rate_mbit * MBIT] * 4
        )
        measured = run_rounds(sim, peers, size_mb=size_mb, rounds=rounds)
        if hivemind_python:  # the same namespaces, links and tensor, right after kit's rounds
            hivemind = run_hivemind_rounds(sim, peers, hivemind_python, size_mb, rounds)
    bound = 2 * (4 - 1) / 4 * size_mb * 1e6 / (rate_mbit * MBIT)
    result["allreduce_lower_bound_s"] = round(bound, 3)
    result["allreduce_round_s"] = round(steady(declared), 3)
    result["allreduce_matchmaking_s"] = round(steady(declared, "matchmaking_s"), 3)
    result["allreduce_phase_s"] = round(steady(declared, "allreduce_s"), 3)
    result["allreduce_rounds_s"] = [round(float(r["round_s"]), 3) for r in declared]  # type: ignore[arg-type]
    result["allreduce_vs_lower_bound"] = round(steady(declared) / bound, 3)
    result["allreduce_measured_bw_vs_lower_bound"] = round(steady(measured) / bound, 3)
    if hivemind is None:
        result["allreduce_vs_hivemind"] = None
        result["hivemind_note"] = "not run: pass --hivemind-python (a Python with hivemind)"
    else:
        hivemind_s = steady(hivemind, only_ok=True)
        result["hivemind_round_s"] = round(hivemind_s, 3)
        result["hivemind_matchmaking_s"] = round(steady(hivemind, "matchmaking_s", True), 3)
        result["hivemind_phase_s"] = round(steady(hivemind, "allreduce_s", True), 3)
        result["hivemind_rounds_s"] = [round(float(r["round_s"]), 3) for r in hivemind]  # type: ignore[arg-type]
        result["hivemind_inexact_rounds"] = [r["round"] for r in hivemind if not r["ok"]]
        result["hivemind_vs_lower_bound"] = round(hivemind_s / bound, 3)
        result["allreduce_vs_hivemind"] = round(steady(declared) / hivemind_s, 3)
    if only_scenario_1:
        return result
    hosts, rates = ["fast", "slow1", "slow2", "slow3"], [1000.0, 50.0, 50.0, 50.0]
    specs = [HostSpec(h, shape=LinkShape(rate_mbit=r)) for h, r in zip(hosts, rates, strict=True)]
    with NetSim(specs, congestion_control=congestion_control) as sim:
        even = run_rounds(sim, hosts, size_mb=lp_size_mb, rounds=rounds, bandwidths=[1.0] * 4)
        lp = run_rounds(
            sim, hosts, size_mb=lp_size_mb, rounds=rounds, bandwidths=[r * MBIT for r in rates]
        )
    result["lp_size_mb"] = lp_size_mb
    result["lp_round_s"] = round(steady(lp), 3)
    result["even_split_round_s"] = round(steady(even), 3)
    result["lp_vs_even_split"] = round(steady(lp) / steady(even), 3)
    result["lp_part_sizes"] = lp[-1]["part_sizes"]
    return result


def measure_links(
    rate_mbit: float,
    size_mib: int,
    rounds: int,
    congestion_control: str | None = DEFAULT_CONGESTION_CONTROL,
) -> dict[str, object]:
    """Plain TCP, kit direct and kit relayed goodput between hosts on ``rate_mbit`` links."""
    shape = LinkShape(rate_mbit=rate_mbit)
    hosts = [HostSpec(name, shape=shape) for name in ("a", "b", "relay")]
    hosts += [HostSpec(name, nat=True, shape=shape) for name in ("alice", "bob")]
    with NetSim(hosts, congestion_control=congestion_control) as sim:
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
    result: dict[str, object] = {"size_mib": size_mib, "rounds": rounds}
    for name, median in medians.items():
        result[f"{name}_mbit_s"] = round(median, 1)
        result[f"{name}_vs_link"] = round(median / rate_mbit, 3)
    result["direct_vs_tcp"] = round(medians["direct"] / medians["tcp"], 3)
    result["relayed_vs_tcp"] = round(medians["relayed"] / medians["tcp"], 3)
    return result


def run_benchmark(args: argparse.Namespace) -> dict[str, object]:
    congestion_control = None if args.congestion_control == "inherit" else args.congestion_control
    result: dict[str, object] = {"rate_mbit": args.rate_mbit}
    result["congestion_control"] = args.congestion_control
    if not args.allreduce_only:
        result.update(measure_links(args.rate_mbit, args.size_mib, args.rounds, congestion_control))
    result.update(
        measure_averaging(
            args.rate_mbit,
            args.avg_size_mb,
            args.lp_size_mb,
            args.avg_rounds,
            args.hivemind_python,
            only_scenario_1=args.allreduce_only,
            congestion_control=congestion_control,
        )
    )
    result["load_average"] = [round(x, 2) for x in os.getloadavg()]  # others share the cores
    result["note"] = "no added delay (kernel without sch_netem): bandwidth from tc tbf only"
    return result


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rate-mbit", type=float, default=100.0)
    parser.add_argument("--size-mib", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--avg-size-mb", type=float, default=72.0, help="scenario 1, 1e6 B")
    parser.add_argument("--lp-size-mb", type=float, default=16.0, help="scenario 2, 1e6 B")
    parser.add_argument("--avg-rounds", type=int, default=5, help="averaging rounds (1st skipped)")
    parser.add_argument(
        "--hivemind-python",
        default=None,
        help="a Python with hivemind (e.g. /tmp/hm/venv/bin/python): run hivemind's averager on "
        "scenario 1's hosts too, for allreduce_vs_hivemind",
    )
    parser.add_argument(
        "--allreduce-only", action="store_true", help="scenario 1 only (no link goodput, no LP)"
    )
    parser.add_argument(
        "--congestion-control",
        default=DEFAULT_CONGESTION_CONTROL,
        help="every host's TCP congestion control (default: %(default)s, see "
        "kit.testing.netsim.DEFAULT_CONGESTION_CONTROL); 'inherit': this machine's default",
    )
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
    figures = run_benchmark(args)
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
