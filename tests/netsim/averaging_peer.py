"""One DecentralizedAverager peer per network namespace, and the launcher that times their rounds.

Holds the peer process (``python -m tests.netsim.averaging_peer --index i ...``, run inside a
NetSim host) and :func:`run_rounds`, which starts N of them in a :class:`NetSim` and collects
per-round times and the load-balancing split. It does not build the network (the caller's
NetSim does) or judge the figures (tests/netsim/test_allreduce_wan.py and benchmarks/wan.py do).

Peers meet through files in a shared run directory (namespaces share the file system): peer 0
writes its DHT address, and a file barrier before every round makes all peers call ``step()``
together, so a round's time is the slowest peer's ``step()`` and matchmaking is short.
Each peer prints one JSON line at the end: per round its ``step()`` time, the matchmaking part,
the all-reduce part, its CPU time, the group's part sizes (group order) and its own position.

Diagnosis: ``KIT_NETSIM_LOG=INFO`` makes every peer log to stderr (prefixed ``p<index>``), and
``KIT_NETSIM_DEBUG=kit.averaging.allreduce,kit.dht`` adds those loggers' debug lines (e.g. each
round's per-peer timeline: when the first average of each part came back, when the own part was
averaged, when every part was in).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from kit.testing.netsim import NetSim

MODULE = "tests.netsim.averaging_peer"
BARRIER_TIMEOUT = 120.0  # every wait between peers is bounded


def _wait_for(paths: list[str], timeout: float, what: str) -> None:
    give_up = time.monotonic() + timeout
    while not all(os.path.exists(p) for p in paths):
        if time.monotonic() > give_up:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.002)


def _barrier(run_dir: str, name: str, index: int, n: int) -> None:
    open(os.path.join(run_dir, f"barrier_{name}_{index}"), "w").close()
    names = [os.path.join(run_dir, f"barrier_{name}_{j}") for j in range(n)]
    _wait_for(names, BARRIER_TIMEOUT, f"barrier {name}")


def run_peer(args: argparse.Namespace) -> dict[str, Any]:
    """One peer: join the DHT, average ``rounds`` times, return what each round did."""
    import torch

    from kit.averaging import DecentralizedAverager
    from kit.dht import DHT
    from kit.errors import AveragingFailed

    torch.set_num_threads(1)
    if os.environ.get("KIT_NETSIM_LOG"):  # debugging a scenario: every peer logs to stderr
        logging.basicConfig(
            level=os.environ["KIT_NETSIM_LOG"],
            format=f"%(relativeCreated)8.0f p{args.index} %(name)s %(levelname)s %(message)s",
        )
        for name in filter(None, os.environ.get("KIT_NETSIM_DEBUG", "").split(",")):
            logging.getLogger(name).setLevel(logging.DEBUG)
    n, i, run_dir = args.peers, args.index, args.run_dir
    numel = int(args.size_mb * 1e6) // 4
    own = torch.full((numel,), float(i + 1))
    tensor = own.clone()
    address_file = os.path.join(run_dir, "initial_peers.json")
    if i > 0:
        _wait_for([address_file], BARRIER_TIMEOUT, "peer 0's address")
        with open(address_file) as f:
            initial_peers = json.load(f)
    else:
        initial_peers = []
    if args.client_mode:  # behind a NAT: relayed, then punched (kit.p2p.hole_punch)
        dht = DHT(initial_peers, client_mode=True)
    else:  # public: it also relays for the client-mode peers
        dht = DHT(initial_peers, host=args.host, port=0, peer_options={"relay_service": True})
    if i == 0:
        with open(address_file + ".tmp", "w") as f:
            json.dump(dht.get_visible_addresses(), f)
        os.replace(address_file + ".tmp", address_file)
    settings: dict[str, Any] = {"bandwidth": args.bandwidth} if args.bandwidth else {}
    averager = DecentralizedAverager(
        [tensor],
        dht,
        prefix="wan",
        target_group_size=n,
        min_group_size=n,
        min_matchmaking_time=args.min_matchmaking_time,
        request_timeout=3.0,
        allreduce_timeout=120.0,
        **settings,
    )
    rounds: list[dict[str, Any]] = []
    try:
        _barrier(run_dir, "ready", i, n)
        for r in range(args.rounds):
            with averager.get_tensors() as tensors:
                tensors[0].copy_(own)
            time.sleep(args.pause)  # lets background work (hole punches) finish between rounds
            _barrier(run_dir, f"r{r}", i, n)
            started, cpu_started = time.perf_counter(), time.process_time()
            try:
                outcome = averager.step(timeout=60.0)
            except AveragingFailed:
                outcome = None
            total = time.perf_counter() - started
            cpu = time.process_time() - cpu_started  # all threads: the runtime's loop does the work
            if outcome is None:
                rounds.append({"round": r, "ok": False, "total_s": total})
                continue
            with averager.get_tensors() as tensors:
                error = float((tensors[0] - (n + 1) / 2).abs().max())
            rounds.append(
                {
                    "round": r,
                    "ok": outcome.is_full and error < 1e-5,
                    "total_s": total,
                    "matchmaking_s": outcome.matchmaking_time,
                    "allreduce_s": outcome.allreduce_time,
                    "cpu_s": cpu,
                    "part_sizes": list(outcome.plan.part_sizes),
                    "position": list(outcome.peers).index(dht.peer_id),
                    "client_mode": averager.client_mode,
                }
            )
        _barrier(run_dir, "done", i, n)
        puncher = getattr(getattr(dht.node, "peer", None), "puncher", None)
        punch = puncher.statistics() if puncher is not None else None
        can_accept = bool(getattr(dht.node.peer, "can_accept", False))
    finally:
        averager.shutdown()
        dht.shutdown()
    return {"index": i, "rounds": rounds, "punch": punch, "can_accept": can_accept}


def run_rounds(
    sim: NetSim,
    hosts: Sequence[str],
    *,
    size_mb: float,
    rounds: int,
    bandwidths: Sequence[float | None] | None = None,
    client_mode: Sequence[str] = (),
    finals: dict[str, Any] | None = None,
    pause: float = 0.0,
    punch_seconds: float | None = None,
    timeout: float = 180.0,
) -> list[dict[str, Any]]:
    """Run one averaging peer in each of ``hosts`` for ``rounds`` rounds.

    Args:
        sim: a running NetSim that has every host.
        hosts: host names; peer i runs in ``hosts[i]`` and listens on its address.
        size_mb: the averaged float32 tensor, 1 MB = 1e6 bytes.
        rounds: rounds to time (the first includes connection set-up; callers skip it).
        bandwidths: per peer, the ``bandwidth=`` (bytes/s) given to its averager; None or a None
            entry: left to the averager's own measurement.
        client_mode: hosts whose peers run in client mode (behind their NAT; never peer 0).
        pause: seconds each peer waits before each round (background work goes on meanwhile).
        punch_seconds: how long a hole punch keeps trying (``kit.p2p.hole_punch.PUNCH_SECONDS``,
            8 s): shorter where punches are expected to fail, so that the scenario is shorter.
        finals: filled with each host's peer at the end: its hole-punch counters (``punch``)
            and whether others could connect to it directly (``can_accept``).
        timeout: for the whole run.

    Returns:
        Per round: ``round_s`` (slowest peer's step), ``allreduce_s`` (slowest all-reduce part),
        ``ok`` (every peer got the exact mean) and ``part_sizes`` keyed by host name.

    Raises:
        RuntimeError: a peer failed or printed no result in time.
    """
    n = len(hosts)
    run_dir = tempfile.mkdtemp(prefix="kit-wan-")
    processes = []
    for i, host in enumerate(hosts):
        bandwidth = bandwidths[i] if bandwidths is not None else None
        args = [f"--index={i}", f"--peers={n}", f"--run-dir={run_dir}", f"--rounds={rounds}"]
        args += [f"--host={sim.host(host).address}", f"--size-mb={size_mb}"]
        if bandwidth is not None:
            args.append(f"--bandwidth={bandwidth}")
        if host in client_mode:
            args.append("--client-mode")
        if pause:
            args.append(f"--pause={pause}")
        if punch_seconds is not None:
            args.append(f"--punch-seconds={punch_seconds}")
        processes.append(sim.python(host, MODULE, *args))
    results = []
    give_up = time.monotonic() + timeout
    for host, process in zip(hosts, processes, strict=True):
        try:
            out, _ = process.communicate(timeout=max(1.0, give_up - time.monotonic()))
        except Exception as e:
            raise RuntimeError(f"averaging peer in {host} did not finish: {e!r}") from e
        lines = out.decode().strip().splitlines()
        if process.returncode != 0 or not lines:
            raise RuntimeError(f"averaging peer in {host} failed ({process.returncode})")
        results.append(json.loads(lines[-1]))
    shutil.rmtree(run_dir, ignore_errors=True)  # barrier files only
    if finals is not None:
        for host, result in zip(hosts, results, strict=True):
            finals[host] = {"punch": result.get("punch"), "can_accept": result.get("can_accept")}
    table = []
    for r in range(rounds):
        records = [next(x for x in p["rounds"] if x["round"] == r) for p in results]
        ok = all(x["ok"] for x in records)
        row: dict[str, Any] = {"round": r, "ok": ok}
        row["round_s"] = max(x["total_s"] for x in records)
        if ok:
            row["allreduce_s"] = max(x["allreduce_s"] for x in records)
            row["matchmaking_s"] = max(x["matchmaking_s"] for x in records)
            row["peers"] = [  # per peer: step, matchmaking, all-reduce and CPU seconds (diagnosis)
                [round(x[k], 3) for k in ("total_s", "matchmaking_s", "allreduce_s", "cpu_s")]
                for x in records
            ]
            row["part_sizes"] = {
                host: x["part_sizes"][x["position"]] for host, x in zip(hosts, records, strict=True)
            }
            row["client_mode"] = {
                host: x["client_mode"] for host, x in zip(hosts, records, strict=True)
            }
        table.append(row)
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one averaging peer of a NetSim scenario")
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--peers", type=int, required=True)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--size-mb", type=float, required=True)
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--bandwidth", type=float, default=None)
    parser.add_argument("--min-matchmaking-time", type=float, default=2.0)
    parser.add_argument("--client-mode", action="store_true", help="no listening socket (NAT)")
    parser.add_argument("--pause", type=float, default=0.0, help="seconds before each round")
    parser.add_argument("--punch-seconds", type=float, default=None, help="a punch's duration")
    args = parser.parse_args(argv)
    if args.punch_seconds is not None:
        from kit.p2p import hole_punch

        hole_punch.PUNCH_SECONDS = args.punch_seconds
    print(json.dumps(run_peer(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
