#!/usr/bin/env python
"""All-reduce benchmark: kit's DecentralizedAverager across N peer processes (hivemind's anchor).

Same flags and JSON fields as the hivemind anchor benchmark, so the two print comparable lines::

    python benchmarks/allreduce.py --peers 4 --size-mb 72 --rounds 5 --compression none

The launcher starts N peer processes, each in its own session. Peer 0 starts a ``kit.dht.DHT``
and writes its address to the run directory; the others join through it. Every peer averages one
float32 tensor of ``size-mb`` MB (1 MB = 1e6 bytes) filled with known values (``--fill randn``:
seed 1000 + i; ``const``: i + 1), so each can compute the exact float64 mean and the error after
every round. Before a round each peer refills its tensor, passes a file barrier, then times
``step()``; the RoundResult splits the time into matchmaking and all-reduce. A round's time is the
slowest peer's; "steady" means rounds 2..R. After each round the same processes run the plain-TCP
references of ``tcp_reference.py`` (``--no-tcp-bound`` skips them): the bare copy of the round's
bytes (``vs_tcp_bound``), the least a correct butterfly does (``vs_tcp_butterfly``,
``tcp_butterfly_vs_tcp_bound``: the machine's floor for any all-reduce; none and fp16 only), and
that butterfly with the checks and all-or-nothing commit of kit's guarantees
(``vs_tcp_safe_butterfly``, ``safe_butterfly_vs_butterfly``: the floor of a safe all-reduce).

While the peers run, the launcher samples every 0.25 s the PSS of all peer processes (shared
pages counted once) and the CPU time of ours and of every other process on the machine (the
machine is shared: it first waits, bounded, for other processes to use < 10 % of a core).
Everything is bounded: ``--deadline-s`` for the whole run, step, barrier and all-reduce timeouts,
and the peers' process groups are killed at the end. Prints one JSON line (the last line).
Set ``KIT_LOG_LEVEL=DEBUG`` to have the peers log into ``peer_<i>.log`` in the run directory, and
``KIT_BENCH_PROFILE=1`` for a CPU-time profile of each peer's loop thread over the steady rounds
(``profile_<i>.pstats``); ``minor_faults`` counts the page faults of the peers' rounds, and
``pool_reused_fresh`` the large buffers they took that were reused or fresh
(``kit.p2p.payload_pool``: fresh ones are where steady rounds still fault).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import resource
import signal
import statistics
import subprocess
import sys
import time
from typing import Any

from tcp_reference import BUTTERFLY_WIRE_DTYPES, WIRE_BYTES_PER_ELEMENT, TcpMesh

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))
CODECS = ("none", "fp16", "scaledfp16", "uniform8bit", "quantile8bit", "blockwise8bit")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--size-mb", type=float, default=72.0, help="float32 tensor, 1 MB = 1e6 B")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--compression", default="none", choices=CODECS)
    parser.add_argument("--fill", default="randn", choices=["randn", "const"])
    parser.add_argument("--min-matchmaking-time", type=float, default=5.0)
    parser.add_argument("--request-timeout", type=float, default=3.0)
    parser.add_argument("--step-timeout", type=float, default=90.0, help="time to find a group")
    parser.add_argument("--allreduce-timeout", type=float, default=180.0)
    parser.add_argument("--barrier-timeout", type=float, default=240.0)
    parser.add_argument("--deadline-s", type=float, default=460.0, help="limit for the whole run")
    parser.add_argument(
        "--part-size-bytes", type=int, default=None, help="bytes per streamed chunk (kit's default)"
    )
    parser.add_argument(
        "--lossy-deltas",
        default="true",
        choices=["true", "false"],
        help="lossy codecs: each sender gets its own compressed difference (true: hivemind's "
        "default) or one shared average encoded once (false: kit.Optimizer's gradients); the "
        "tcp_butterfly floors do the same",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads in each peer")
    parser.add_argument("--hosts", default="", help="comma list of per-peer listen IPs")
    parser.add_argument("--netns-prefix", default="", help="run peer i in netns <prefix><i>")
    parser.add_argument("--run-dir-base", default="/tmp/kit-bench/runs")
    parser.add_argument("--wait-quiet-s", type=float, default=120.0)
    parser.add_argument(
        "--no-tcp-bound",
        dest="tcp_bound",
        action="store_false",
        help="skip plain TCP moving the same bytes after each round (vs_tcp_bound)",
    )
    parser.add_argument("--tag", default="")
    parser.add_argument("--role", default="launcher", choices=["launcher", "peer"])
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--run-dir", default="")
    return parser.parse_args(argv)


# --- files shared by the processes ----------------------------------------------------------


def write_json(path: str, value: Any) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(value, f)
    os.replace(path + ".tmp", path)


def read_json(path: str) -> Any:
    with open(path) as f:
        return json.load(f)


def wait_for(paths: list[str], timeout: float, what: str) -> None:
    give_up = time.monotonic() + timeout
    while not all(os.path.exists(p) for p in paths):
        if time.monotonic() > give_up:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.002)


def barrier(run_dir: str, name: str, index: int, n: int, timeout: float) -> None:
    open(os.path.join(run_dir, f"barrier_{name}_{index}"), "w").close()
    wait_for([os.path.join(run_dir, f"barrier_{name}_{j}") for j in range(n)], timeout, name)


# --- a peer ---------------------------------------------------------------------------------


def make_codec(name: str) -> Any:
    from kit.averaging import compression as c

    return {
        "none": c.NoCompression,
        "fp16": c.Float16Compression,
        "scaledfp16": c.ScaledFloat16Compression,
        "uniform8bit": c.Uniform8BitQuantization,
        "quantile8bit": c.Quantile8BitQuantization,
        "blockwise8bit": c.BlockwiseQuantization,
    }[name]()


def fill_values(args: argparse.Namespace, index: int, numel: int) -> Any:
    import torch

    if args.fill == "const":
        return torch.full((numel,), float(index + 1))
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 + index))


def start_profile(round_index: int) -> Any:
    """With ``KIT_BENCH_PROFILE=1``, cProfile the runtime's loop thread in the steady rounds
    (where the round's work runs): ``profile_<i>.pstats`` in the run directory."""
    if not os.environ.get("KIT_BENCH_PROFILE") or round_index == 0:
        return None
    import cProfile

    from kit.runtime import get_runtime

    profiler = cProfile.Profile(time.thread_time)  # CPU time: not the waits of a shared machine
    get_runtime().loop.call_soon_threadsafe(profiler.enable)
    return profiler


def stop_profile(profiler: Any, run_dir: str, index: int) -> None:
    if profiler is None:
        return
    import concurrent.futures

    from kit.runtime import get_runtime

    done: concurrent.futures.Future[None] = concurrent.futures.Future()
    get_runtime().loop.call_soon_threadsafe(lambda: (profiler.disable(), done.set_result(None)))
    done.result(timeout=10)
    path = os.path.join(run_dir, f"profile_{index}.pstats")
    if os.path.exists(path):
        import pstats

        stats = pstats.Stats(path)
        stats.add(profiler)
        stats.dump_stats(path)
    else:
        profiler.dump_stats(path)


def run_peer(args: argparse.Namespace) -> None:
    started = time.perf_counter()
    sys.path.insert(0, ROOT)
    import torch

    torch.set_num_threads(args.threads)
    if os.environ.get("KIT_LOG_LEVEL"):  # e.g. DEBUG: the peers' logs go to the run directory
        logging.basicConfig(
            level=os.environ["KIT_LOG_LEVEL"],
            format="%(created).3f %(name)s %(levelname)s %(message)s",
        )
    from kit.averaging.averager import DecentralizedAverager
    from kit.dht import DHT
    from kit.p2p.payload_pool import PAYLOADS

    n, i, run_dir = args.peers, args.index, args.run_dir
    result: dict[str, Any] = {"index": i, "pid": os.getpid(), "rounds": [], "errors": []}
    result["import_s"] = round(time.perf_counter() - started, 3)
    numel = int(args.size_mb * 1e6) // 4
    host = args.hosts.split(",")[i] if args.hosts else "127.0.0.1"
    own = fill_values(args, i, numel)
    expected = torch.zeros(numel, dtype=torch.float64)
    for j in range(n):
        expected += fill_values(args, j, numel).double()
    expected /= n
    tensor = own.clone()

    address_file = os.path.join(run_dir, "initial_peers.json")
    if i > 0:
        wait_for([address_file], args.barrier_timeout, "peer 0's address")
    t0 = time.perf_counter()
    initial_peers = [] if i == 0 else read_json(address_file)
    dht = DHT(initial_peers, host=host, port=0)
    if i == 0:
        write_json(address_file, dht.get_visible_addresses())
    result["dht_start_s"] = round(time.perf_counter() - t0, 3)
    t0 = time.perf_counter()
    averager = DecentralizedAverager(
        [tensor],
        dht,
        prefix=f"bench_{args.compression}",
        target_group_size=n,
        min_group_size=n,
        min_matchmaking_time=args.min_matchmaking_time,
        request_timeout=args.request_timeout,
        allreduce_timeout=args.allreduce_timeout,
        compression=make_codec(args.compression),
        lossy_deltas=args.lossy_deltas == "true",
        **({"part_size_bytes": args.part_size_bytes} if args.part_size_bytes else {}),
    )
    result["averager_start_s"] = round(time.perf_counter() - t0, 3)
    mesh = TcpMesh(run_dir, i, n, host, args.barrier_timeout) if args.tcp_bound else None
    # What each pair of peers exchanges each way in kit's round: 2 parts of M/N wire bytes.
    pair_bytes = 2 * (numel * WIRE_BYTES_PER_ELEMENT[args.compression] // n)
    payload = memoryview(bytearray(b"\1" * pair_bytes))
    inbox = {j: bytearray(b"\0" * pair_bytes) for j in range(n) if j != i}
    work = own.clone() if args.compression in BUTTERFLY_WIRE_DTYPES else None
    try:
        barrier(run_dir, "ready", i, n, args.barrier_timeout)
        for r in range(args.rounds):
            with averager.get_tensors() as tensors:
                tensors[0].copy_(own)
            barrier(run_dir, f"r{r}", i, n, args.barrier_timeout)
            record: dict[str, Any] = {"round": r, "wall_start": time.time()}
            profiler = start_profile(r)
            faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            pool0 = (PAYLOADS.reused, PAYLOADS.allocated)
            cpu0 = os.times()
            t0 = time.perf_counter()
            try:
                outcome = averager.step(timeout=args.step_timeout)
                error = None
            except Exception as e:  # the benchmark reports every failure (AveragingFailed...)
                outcome, error = None, repr(e)
            total = time.perf_counter() - t0
            cpu1 = os.times()
            stop_profile(profiler, run_dir, i)
            record.update(
                ok=error is None,
                total_s=round(total, 4),
                user_s=round(cpu1.user - cpu0.user, 3),
                sys_s=round(cpu1.system - cpu0.system, 3),
                minor_faults=resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0,
                pool_reused=PAYLOADS.reused - pool0[0],
                pool_fresh=PAYLOADS.allocated - pool0[1],
            )
            if outcome is not None:
                record.update(
                    matchmaking_s=round(outcome.matchmaking_time, 4),
                    allreduce_s=round(total - outcome.matchmaking_time, 4),
                    group_size=len(outcome),
                    reported_full=outcome.is_full,
                    reported_unaveraged_parts=list(outcome.unaveraged_parts),
                )
                with averager.get_tensors() as tensors:
                    diff = tensors[0].double() - expected
                    record["max_abs_err"] = float(diff.abs().max())
                    record["rmse"] = float(diff.pow(2).mean().sqrt())
                    unchanged = (tensors[0] == own) & (own.double() != expected)
                    record["n_unaveraged"] = int(unchanged.sum())
                    del diff, unchanged
            else:
                record.update(matchmaking_s=round(total, 4), allreduce_s=None, error=error)
                result["errors"].append(error)
            if mesh is not None:  # right after kit's round, in the same conditions
                record.update(run_references(args, mesh, r, payload, inbox, work, own, expected))
            result["rounds"].append(record)
        result["statistics"] = {
            k: v for k, v in averager.statistics().items() if not isinstance(v, dict)
        }
    except Exception as e:  # recorded in the JSON
        result["errors"].append(repr(e))
    finally:
        write_json(os.path.join(run_dir, f"peer_{i}.json"), result)
        try:
            barrier(run_dir, "done", i, n, 60)
        except TimeoutError:
            pass
        if mesh is not None:
            mesh.close()
        t0 = time.perf_counter()
        averager.shutdown()
        dht.shutdown()
        result["shutdown_s"] = round(time.perf_counter() - t0, 3)
        write_json(os.path.join(run_dir, f"peer_{i}.json"), result)


def run_references(
    args: argparse.Namespace,
    mesh: TcpMesh,
    r: int,
    payload: memoryview,
    inbox: dict[int, bytearray],
    work: Any,
    own: Any,
    expected: Any,
) -> dict[str, Any]:
    """Round ``r`` of the plain-TCP references (``tcp_reference.py``): wall and CPU seconds."""
    timeout, record = args.allreduce_timeout, {}
    names = ("tcp", "butterfly", "safe_butterfly") if work is not None else ("tcp",)
    for name in names:
        if name == "tcp":
            mesh.arm_copy(inbox, args.barrier_timeout)
        else:
            work.copy_(own)
            safe = name == "safe_butterfly"
            deltas = args.lossy_deltas == "true"
            mesh.arm_butterfly(
                work, args.compression, args.barrier_timeout, safe=safe, deltas=deltas
            )
        barrier(args.run_dir, f"{name}{r}", args.index, args.peers, args.barrier_timeout)
        record[f"{name}_wall_start"] = time.time()
        cpu0, t0 = os.times(), time.perf_counter()
        if name == "tcp":
            mesh.copy_round(payload, timeout)
        else:
            mesh.butterfly_round(timeout)
        record[f"{name}_s"] = round(time.perf_counter() - t0, 4)
        cpu1 = os.times()
        record[f"{name}_user_s"] = round(cpu1.user - cpu0.user, 3)
        record[f"{name}_sys_s"] = round(cpu1.system - cpu0.system, 3)
        if name != "tcp":
            record[f"{name}_max_abs_err"] = float((work.double() - expected).abs().max())
    return record


# --- the launcher: processes, CPU and memory accounting -------------------------------------


def scan_processes(
    sessions: set[int],
) -> tuple[dict[int, tuple[str, int]], dict[int, tuple[str, int]]]:
    """({pid: (name, cpu ticks)} of our peers' sessions, the same for every other process)."""
    ours, others = {}, {}
    me = os.getpid()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        close = stat.rfind(")")
        comm = stat[stat.find("(") + 1 : close]
        fields = stat[close + 2 :].split()
        ticks = int(fields[11]) + int(fields[12])
        pid, ppid, session = int(name), int(fields[1]), int(fields[3])
        if session in sessions:
            ours[pid] = (comm, ticks)
        elif pid != me:
            others[pid] = ("kthread" if ppid == 2 or pid == 2 else comm, ticks)
    return ours, others


def cpu_totals() -> tuple[int, int]:
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    return sum(values), values[3] + values[4]


def other_cpu(
    before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]]
) -> dict[str, Any]:
    """CPU seconds of processes that are not ours between two scans."""
    per: dict[str, float] = {}
    for pid, (label, ticks) in after.items():
        per[label] = per.get(label, 0.0) + (ticks - before.get(pid, (label, 0))[1]) / CLOCK_TICKS
    kernel = per.pop("kthread", 0.0)
    top = sorted(((k, round(v, 2)) for k, v in per.items() if v >= 0.05), key=lambda kv: -kv[1])
    return {
        "other_procs_cpu_s": round(sum(per.values()), 2),
        "other_procs_top": dict(top[:5]),
        "kernel_threads_cpu_s": round(kernel, 2),
    }


class Sampler:
    """Samples CPU ticks and the PSS of our processes (shared pages counted once)."""

    #: PSS is read every this many samples (2 s). Reading it walks every page table of every
    #: peer (``smaps_rollup``): at every 0.25 s sample the launcher took 0.21 CPU-s per second
    #: during the rounds (12% of the peers' and its CPU in ``perf``), load the benchmark put on
    #: what it measures; 0.06 CPU-s per second this way, with the same peak PSS (4 x 72 MB).
    PSS_EVERY = 8

    def __init__(self, sessions: set[int]) -> None:
        self.sessions = sessions
        self.samples: list[
            tuple[float, int, int, dict[int, tuple[str, int]], dict[int, tuple[str, int]]]
        ] = []
        self.max_pss_kb = 0

    def sample(self) -> None:
        total, idle = cpu_totals()
        ours, others = scan_processes(self.sessions)
        self.samples.append((time.time(), total, idle, ours, others))
        if len(self.samples) % self.PSS_EVERY != 1:
            return
        pss = 0
        for pid in ours:
            try:
                with open(f"/proc/{pid}/smaps_rollup") as f:
                    pss += sum(int(line.split()[1]) for line in f if line.startswith("Pss:"))
            except OSError:
                pass
        self.max_pss_kb = max(self.max_pss_kb, pss)

    def window(self, start: float, end: float) -> dict[str, Any] | None:
        if len(self.samples) < 2:
            return None
        a = max(
            (s for s in self.samples if s[0] <= start), default=self.samples[0], key=lambda s: s[0]
        )
        b = min(
            (s for s in self.samples if s[0] >= end), default=self.samples[-1], key=lambda s: s[0]
        )
        if b[0] <= a[0]:
            return None
        per_name: dict[str, float] = {}
        for pid, (name, ticks) in b[3].items():
            per_name[name] = (
                per_name.get(name, 0.0) + (ticks - a[3].get(pid, (name, 0))[1]) / CLOCK_TICKS
            )
        return {
            "t_span_s": round(b[0] - a[0], 2),
            "machine_busy_frac": round(1.0 - (b[2] - a[2]) / max(1, b[1] - a[1]), 3),
            "cpu_s_by_process_name": {k: round(v, 2) for k, v in sorted(per_name.items())},
            **other_cpu(a[4], b[4]),
        }


def wait_for_quiet(
    max_wait: float, interval: float = 2.0, threshold: float = 0.1
) -> tuple[float, float]:
    """Wait (at most ``max_wait`` s) until other processes use < ``threshold`` of one core."""
    started = time.monotonic()
    while True:
        before = scan_processes(set())[1]
        time.sleep(interval)
        fraction = other_cpu(before, scan_processes(set())[1])["other_procs_cpu_s"] / interval
        if fraction < threshold or time.monotonic() - started >= max_wait:
            return round(time.monotonic() - started, 1), round(fraction, 3)


def non_loopback_tx_packets() -> int:
    """Packets sent on the machine's real interfaces: shows that the run stayed on loopback."""
    total = 0
    with open("/proc/net/dev") as f:
        for line in f.readlines()[2:]:
            name, rest = line.split(":", 1)
            if name.strip() != "lo":
                total += int(rest.split()[9])
    return total


def summary(values: list[float | None]) -> dict[str, Any] | None:
    present = [v for v in values if v is not None]
    if not present:
        return None
    return {
        "median": round(statistics.median(present), 4),
        "min": round(min(present), 4),
        "max": round(max(present), 4),
        "n": len(present),
    }


def count_log_lines(run_dir: str, n: int) -> dict[str, Any]:
    counts: dict[str, Any] = {}
    messages: dict[str, int] = {}
    for i in range(n):
        try:
            with open(os.path.join(run_dir, f"peer_{i}.log"), errors="ignore") as f:
                for line in f:
                    for level in ("WARN", "ERROR", "Traceback"):
                        if level in line:
                            counts[level] = counts.get(level, 0) + 1
                    if "WARN" in line or "ERROR" in line:
                        key = re.sub(r"[0-9][0-9.]*", "#", line.strip())[:120]
                        messages[key] = messages.get(key, 0) + 1
        except OSError:
            pass
    counts["messages"] = dict(sorted(messages.items(), key=lambda kv: -kv[1])[:10])
    return counts


def run_launcher(args: argparse.Namespace, argv: list[str]) -> int:
    started = time.time()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = f"allreduce-{args.compression}-n{args.peers}-{stamp}-{os.getpid()}{args.tag}"
    run_dir = os.path.join(args.run_dir_base, name)
    os.makedirs(run_dir, exist_ok=True)
    quiet = wait_for_quiet(args.wait_quiet_s) if args.wait_quiet_s > 0 else None
    tx_before = non_loopback_tx_packets()
    processes = []
    for i in range(args.peers):
        command = [
            sys.executable,
            HERE,
            *argv,
            "--role",
            "peer",
            "--index",
            str(i),
            "--run-dir",
            run_dir,
        ]
        if args.netns_prefix:
            command = ["ip", "netns", "exec", f"{args.netns_prefix}{i}", *command]
        with open(os.path.join(run_dir, f"peer_{i}.log"), "w") as log:  # the child keeps it open
            processes.append(
                subprocess.Popen(
                    command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
    sessions = {p.pid for p in processes}
    sampler = Sampler(sessions)
    give_up = time.monotonic() + args.deadline_s
    timed_out = False
    while True:
        sampler.sample()
        if all(p.poll() is not None for p in processes):
            break
        if time.monotonic() > give_up:
            timed_out = True
            break
        time.sleep(0.25)
    leftovers = scan_processes(sessions)[0]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in processes:
            try:
                os.killpg(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        if sig == signal.SIGTERM and leftovers:
            time.sleep(2)
    for p in processes:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    peers = []
    for i in range(args.peers):
        path = os.path.join(run_dir, f"peer_{i}.json")
        peers.append(
            read_json(path)
            if os.path.exists(path)
            else {"index": i, "errors": ["no result file"], "rounds": []}
        )
    nbytes = int(args.size_mb * 1e6) // 4 * 4
    per_round = []
    for r in range(args.rounds):
        records = [next((x for x in p["rounds"] if x["round"] == r), None) for p in peers]
        if any(x is None for x in records):
            continue
        per_round.append(
            {
                "round": r,
                "ok": all(x["ok"] for x in records),
                "wall_start": min(x["wall_start"] for x in records),
                "wall_end": max(x["wall_start"] + x["total_s"] for x in records),
                "round_s": max(x["total_s"] for x in records),
                "matchmaking_s": max(x["matchmaking_s"] for x in records),
                "allreduce_s": max((x["allreduce_s"] or 0) for x in records),
                "max_abs_err": max(
                    (x.get("max_abs_err", float("nan")) for x in records), default=None
                ),
                "rmse_max_over_peers": max(
                    (x.get("rmse", float("nan")) for x in records), default=None
                ),
                "n_unaveraged_elems": [x.get("n_unaveraged") for x in records],
                "reported_full": [x.get("reported_full") for x in records],
                "per_peer_total_s": [x["total_s"] for x in records],
                "minor_faults": sum(x.get("minor_faults") or 0 for x in records),
                "pool_reused_fresh": [
                    sum(x.get(k) or 0 for x in records) for k in ("pool_reused", "pool_fresh")
                ],
                "tcp_s": max((x.get("tcp_s") or 0) for x in records) or None,
                "butterfly_s": max((x.get("butterfly_s") or 0) for x in records) or None,
                "butterfly_max_abs_err": max(
                    (x.get("butterfly_max_abs_err") or 0 for x in records), default=None
                ),
                "safe_butterfly_s": max((x.get("safe_butterfly_s") or 0) for x in records) or None,
                "safe_butterfly_max_abs_err": max(
                    (x.get("safe_butterfly_max_abs_err") or 0 for x in records), default=None
                ),
                # CPU seconds of all peers (user, system): kit's round, then TCP's
                "cpu_user_sys_s": [
                    round(sum(x.get(k) or 0 for x in records), 3)
                    for k in ("user_s", "sys_s", "tcp_user_s", "tcp_sys_s")
                ],
                "butterfly_cpu_user_sys_s": [
                    round(sum(x.get(k) or 0 for x in records), 3)
                    for k in ("butterfly_user_s", "butterfly_sys_s")
                ],
            }
        )
    first = per_round[0] if per_round else None
    steady = [x for x in per_round[1:] if x["ok"]]
    steady_round = summary([x["round_s"] for x in steady])
    steady_allreduce = summary([x["allreduce_s"] for x in steady])
    steady_tcp = summary([x["tcp_s"] for x in steady])
    # Per round, kit's all-reduce phase over TCP right after it (then the median): the two
    # share the machine's load of that moment.
    ratios = [x["allreduce_s"] / x["tcp_s"] for x in steady if x["tcp_s"]]
    round_ratios = [x["round_s"] / x["tcp_s"] for x in steady if x["tcp_s"]]
    # The least a correct butterfly does (sums, codec, pipelining) over the same TCP: kit's
    # overhead is allreduce_s / butterfly_s; the machine's floor for any all-reduce is
    # butterfly_s / tcp_s.
    vs_butterfly = [x["allreduce_s"] / x["butterfly_s"] for x in steady if x["butterfly_s"]]
    floor = [x["butterfly_s"] / x["tcp_s"] for x in steady if x["butterfly_s"] and x["tcp_s"]]
    # The same with kit's guarantees' passes (checks, all-or-nothing commit): the safe floor.
    vs_safe = [x["allreduce_s"] / x["safe_butterfly_s"] for x in steady if x["safe_butterfly_s"]]
    safe_cost = [
        x["safe_butterfly_s"] / x["butterfly_s"]
        for x in steady
        if x["safe_butterfly_s"] and x["butterfly_s"]
    ]
    cpu_rounds = None
    windows = [w for w in (sampler.window(x["wall_start"], x["wall_end"]) for x in steady) if w]
    if windows:
        span = sum(w["t_span_s"] for w in windows)
        by_name: dict[str, float] = {}
        for w in windows:
            for k, v in w["cpu_s_by_process_name"].items():
                by_name[k] = by_name.get(k, 0.0) + v
        cpu_rounds = {
            "t_span_s": round(span, 2),
            "machine_busy_frac": round(
                sum(w["machine_busy_frac"] * w["t_span_s"] for w in windows) / span, 3
            ),
            "cpu_s_by_process_name": {k: round(v, 2) for k, v in sorted(by_name.items())},
            "other_procs_cpu_s": round(sum(w["other_procs_cpu_s"] for w in windows), 2),
            "kernel_threads_cpu_s": round(sum(w["kernel_threads_cpu_s"] for w in windows), 2),
        }
    n = args.peers
    unaveraged = [x for x in per_round if max(v or 0 for v in x["n_unaveraged_elems"]) >= 1000]
    result = {
        "bench": "allreduce",
        "implementation": "kit",
        "kit_version": _version(),
        "peers": n,
        "size_mb": args.size_mb,
        "numel": nbytes // 4,
        "compression": args.compression,
        "lossy_deltas": args.lossy_deltas == "true",
        "fill": args.fill,
        "rounds": args.rounds,
        "hosts": args.hosts or "127.0.0.1",
        "netns_prefix": args.netns_prefix or None,
        "min_matchmaking_time": args.min_matchmaking_time,
        "all_rounds_ok": bool(per_round)
        and len(per_round) == args.rounds
        and all(x["ok"] for x in per_round),
        "first_round_s": first["round_s"] if first else None,
        "first_round_matchmaking_s": first["matchmaking_s"] if first else None,
        "first_round_allreduce_s": first["allreduce_s"] if first else None,
        "steady_round_s": steady_round,
        "steady_matchmaking_s": summary([x["matchmaking_s"] for x in steady]),
        "steady_allreduce_s": steady_allreduce,
        "steady_tcp_same_bytes_s": steady_tcp,
        "tcp_bytes_per_pair_each_way": 2
        * (nbytes // 4 * WIRE_BYTES_PER_ELEMENT[args.compression] // n),
        "vs_tcp_bound": round(statistics.median(ratios), 3) if ratios else None,
        "round_vs_tcp_bound": round(statistics.median(round_ratios), 3) if round_ratios else None,
        "steady_tcp_butterfly_s": summary([x["butterfly_s"] for x in steady if x["butterfly_s"]]),
        "vs_tcp_butterfly": round(statistics.median(vs_butterfly), 3) if vs_butterfly else None,
        "tcp_butterfly_vs_tcp_bound": round(statistics.median(floor), 3) if floor else None,
        "tcp_butterfly_max_abs_err": max(
            (x["butterfly_max_abs_err"] or 0 for x in per_round), default=None
        ),
        "steady_tcp_safe_butterfly_s": summary(
            [x["safe_butterfly_s"] for x in steady if x["safe_butterfly_s"]]
        ),
        "vs_tcp_safe_butterfly": round(statistics.median(vs_safe), 3) if vs_safe else None,
        "safe_butterfly_vs_butterfly": (
            round(statistics.median(safe_cost), 3) if safe_cost else None
        ),
        "tcp_safe_butterfly_max_abs_err": max(
            (x["safe_butterfly_max_abs_err"] or 0 for x in per_round), default=None
        ),
        "max_abs_err": max((x["max_abs_err"] for x in per_round), default=None),
        "rmse_max": max((x["rmse_max_over_peers"] for x in per_round), default=None),
        # whole parts left at a peer's own values; a few equal elements can happen by rounding
        "rounds_with_unaveraged_parts": len(unaveraged),
        # kit reports partial rounds: an unaveraged part must come with reported_full == False
        "rounds_reported_partial": sum(1 for x in per_round if not all(x["reported_full"])),
        "unaveraged_but_reported_full": sum(1 for x in unaveraged if all(x["reported_full"])),
        "per_round": [
            {
                k: (
                    round(v, 4)
                    if isinstance(v, float) and k not in ("max_abs_err", "rmse_max_over_peers")
                    else v
                )
                for k, v in x.items()
                if k not in ("wall_start", "wall_end")
            }
            for x in per_round
        ],
        "bytes_averaged_per_s_round": round(nbytes / steady_round["median"])
        if steady_round
        else None,
        "bytes_averaged_per_s_allreduce_phase": round(nbytes / steady_allreduce["median"])
        if steady_allreduce
        else None,
        "busbw_bytes_per_s_round": round(2 * (n - 1) / n * nbytes / steady_round["median"])
        if steady_round
        else None,
        "bandwidth_lower_bound_s_at_100mbit": round(2 * (n - 1) / n * nbytes * 8 / 100e6, 3),
        "dht_start_s": [p.get("dht_start_s") for p in peers],
        "averager_start_s": [p.get("averager_start_s") for p in peers],
        "import_s": [p.get("import_s") for p in peers],
        "shutdown_s": [p.get("shutdown_s") for p in peers],
        "cpu_steady_span": sampler.window(
            min(x["wall_start"] for x in steady), max(x["wall_end"] for x in steady)
        )
        if steady
        else None,
        "cpu_whole_run": sampler.window(0, float("inf")),
        "cpu_steady_rounds_only": cpu_rounds,
        "max_pss_all_peer_procs_mb": round(sampler.max_pss_kb / 1024),
        "errors": {p["index"]: p["errors"] for p in peers if p.get("errors")},
        "log_warning_lines": count_log_lines(run_dir, n),
        "leftover_procs_after_exit": len(leftovers),
        "root_netns_non_loopback_tx_packets_delta": non_loopback_tx_packets() - tx_before,
        "timed_out": timed_out,
        "wait_for_quiet_s_and_other_core_frac": quiet,
        "run_wall_s": round(time.time() - started, 2),
        "run_dir": run_dir,
    }
    print(json.dumps(result), flush=True)
    return 0 if result["all_rounds_ok"] else 1


def _version() -> str | None:
    try:
        from importlib.metadata import version

        return version("kit-collab")
    except Exception:  # not installed as a package: run from the tree
        return None


def main() -> int:
    argv = sys.argv[1:]
    args = parse_args(argv)
    if args.role == "peer":
        run_peer(args)
        return 0
    return run_launcher(args, argv)


if __name__ == "__main__":
    sys.exit(main())
