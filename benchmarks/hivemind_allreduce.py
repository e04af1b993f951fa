"""One hivemind averaging peer of ``benchmarks/wan.py``'s comparison (run with hivemind's Python).

Holds the peer process that ``benchmarks/wan.py --hivemind-python PY`` starts in each NetSim host
of scenario 1, so hivemind's ``DecentralizedAverager`` runs on exactly the hosts, links and tensor
size kit's peers (``tests/netsim/averaging_peer.py``) just ran on. It imports hivemind, torch and
the standard library only (never kit: hivemind's venv need not have kit's dependencies), and it
does not judge the figures (``wan.py`` does).

The protocol of a run mirrors kit's peer on purpose, so the two round times mean the same thing:
peers meet through files in a shared run directory (peer 0 writes its DHT multiaddrs), a file
barrier aligns every round, each peer re-fills its tensor with the constant ``index + 1`` and
times ``step()``; the matchmaking part ends when the step's stage becomes RUNNING_ALLREDUCE.
Prints one JSON line: per round ``ok`` (the exact mean everywhere), ``total_s``,
``matchmaking_s`` and ``allreduce_s``.

    ip netns exec NS /tmp/hm/venv/bin/python benchmarks/hivemind_allreduce.py --index 0 ...
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

BARRIER_TIMEOUT = 120.0  # every wait between peers is bounded
STAGE_POLL = 0.002  # seconds between looks at the step's stage (splits matchmaking/all-reduce)


def wait_for(paths: list[str], timeout: float, what: str) -> None:
    give_up = time.monotonic() + timeout
    while not all(os.path.exists(p) for p in paths):
        if time.monotonic() > give_up:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.002)


def barrier(run_dir: str, name: str, index: int, n: int) -> None:
    open(os.path.join(run_dir, f"hm_barrier_{name}_{index}"), "w").close()
    names = [os.path.join(run_dir, f"hm_barrier_{name}_{j}") for j in range(n)]
    wait_for(names, BARRIER_TIMEOUT, f"barrier {name}")


def run_peer(args: argparse.Namespace) -> dict[str, object]:
    """Join hivemind's DHT, average ``rounds`` times, return what each round took."""
    import hivemind
    import torch
    from hivemind.averaging import DecentralizedAverager
    from hivemind.averaging.control import AveragingStage

    torch.set_num_threads(1)
    n, i, run_dir = args.peers, args.index, args.run_dir
    numel = int(args.size_mb * 1e6) // 4
    own = torch.full((numel,), float(i + 1))
    address_file = os.path.join(run_dir, "hm_initial_peers.json")
    listen = [f"/ip4/{args.host}/tcp/0"]
    if i == 0:
        dht = hivemind.DHT(start=True, host_maddrs=listen, nat_port_map=False)
        with open(address_file + ".tmp", "w") as f:
            json.dump([str(a) for a in dht.get_visible_maddrs()], f)
        os.replace(address_file + ".tmp", address_file)
    else:
        wait_for([address_file], BARRIER_TIMEOUT, "peer 0's address")
        with open(address_file) as f:
            initial_peers = json.load(f)
        dht = hivemind.DHT(
            start=True, host_maddrs=listen, initial_peers=initial_peers, nat_port_map=False
        )
    averager = DecentralizedAverager(
        [own.clone()],
        dht,
        start=True,
        prefix="wan_hivemind",
        target_group_size=n,
        min_group_size=n,
        min_matchmaking_time=args.min_matchmaking_time,
        request_timeout=3.0,
        allreduce_timeout=120.0,
    )
    rounds: list[dict[str, object]] = []
    try:
        barrier(run_dir, "ready", i, n)
        for r in range(args.rounds):
            with averager.get_tensors() as tensors:
                tensors[0].copy_(own)
            barrier(run_dir, f"r{r}", i, n)
            started = time.perf_counter()
            allreduce_started = None
            control = averager.step(wait=False, timeout=60.0)
            while not control.done():
                if allreduce_started is None and control.stage == AveragingStage.RUNNING_ALLREDUCE:
                    allreduce_started = time.perf_counter()
                time.sleep(STAGE_POLL)
            ended = time.perf_counter()
            try:
                group = control.result()
            except Exception as e:  # hivemind raises many kinds; the round just failed
                rounds.append(
                    {"round": r, "ok": False, "total_s": ended - started, "error": repr(e)}
                )
                continue
            with averager.get_tensors() as tensors:
                error = float((tensors[0] - (n + 1) / 2).abs().max())
            split = ended if allreduce_started is None else allreduce_started
            rounds.append(
                {
                    "round": r,
                    "ok": group is not None and len(group) == n and error < 1e-5,
                    "total_s": ended - started,
                    "matchmaking_s": split - started,
                    "allreduce_s": ended - split,
                }
            )
        barrier(run_dir, "done", i, n)
    finally:
        averager.shutdown()
        dht.shutdown()
    return {"index": i, "rounds": rounds}


def main() -> int:
    parser = argparse.ArgumentParser(description="one hivemind averaging peer (benchmarks/wan.py)")
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--peers", type=int, required=True)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--host", required=True, help="this namespace's address to listen on")
    parser.add_argument("--size-mb", type=float, required=True, help="float32 tensor, 1e6 B")
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--min-matchmaking-time", type=float, default=5.0)  # as the anchor
    args = parser.parse_args()
    print(json.dumps(run_peer(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
