"""Collaborative training with kit.Optimizer on loopback, plus a late joiner: the same model, batch
settings and output fields as hivemind's anchor (``shared/anchors/hivemind/collab_train.py``).

    python benchmarks/collab_train.py --peers 2 --duration 90 --late-join

Phase 1: N peer processes train a ~5.3M-parameter MLP (512-2048-2048-10) on synthetic data
(labels from a fixed random linear teacher) with target_batch_size=256, batch_size_per_step=32,
Adam, gradient averaging, matchmaking_time=3. Figures cover [T0, T0 + duration], T0 = when every
peer has made its first step. Phase 2 (--late-join): one more peer starts at T0 + duration,
downloads the state and trains; time_to_join_s = from its launch to the end of its first step at
the collaboration's epoch. One JSON line: ``full_window.samples_per_s``,
``full_window.epochs_advanced``, ``full_window.fraction_outside_fwd_bwd``,
``full_window.longest_stall_s``, ``late_join.time_to_join_s``, and (kit only) ``late_join.phases_s``:
seconds from the late peer's launch to ``imported`` (torch, kit), ``dht_ready``, ``optimizer_ready``
and ``state_loaded`` (its ``load_state_from_peers`` returned). ``--delay-grad-averaging`` (kit only, not comparable with the anchor) averages and steps in the
background (``kit.Optimizer(delay_grad_averaging=True)``); ``--reuse-grad-buffers`` (also
hivemind's option) lets autograd accumulate in ``.grad`` (the loop then calls no ``zero_grad``),
which saves the per-micro-batch pass that adds ``.grad`` into kit's float32 sums. ``KIT_BENCH_LOG=DEBUG`` makes the
peers' kit.optim log each averaging round's matchmaking and all-reduce times on stderr.
"""

from __future__ import annotations

import argparse
import compileall
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time

# Peers run as ``python benchmarks/collab_train.py``: make the repository's ``kit`` importable.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


class _KitEvents(logging.Handler):
    """Records when kit logs the late peer's first look at the progress and its state download."""

    MARKS = {
        "progress_found": "first look at the collaboration",
        "state_downloaded": "state of epoch",
    }

    def __init__(self, launched: float, phases: dict[str, float]) -> None:
        super().__init__(logging.DEBUG)
        self.launched, self.phases = launched, phases

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        for phase, mark in self.MARKS.items():
            if phase not in self.phases and message.startswith(mark):
                self.phases[phase] = record.created - self.launched


def peer_main(args: argparse.Namespace) -> None:
    launched = float(args.launched)
    phases: dict[str, float] = {"started": time.time() - launched}
    import torch

    phases["torch_imported"] = time.time() - launched
    import kit
    import kit.dht
    import kit.optim

    phases["kit_imported"] = time.time() - launched
    torch.set_num_threads(1)
    if os.environ.get("KIT_BENCH_LOG"):  # e.g. DEBUG: the optimizer's per-round timings on stderr
        logging.basicConfig(format="%(asctime)s %(name)s %(message)s")
        logging.getLogger("kit.optim").setLevel(os.environ["KIT_BENCH_LOG"])
    if args.late:
        logging.getLogger("kit.optim").setLevel(logging.DEBUG)
        logging.getLogger("kit.optim").addHandler(_KitEvents(launched, phases))
    torch.manual_seed(0)
    teacher = torch.randn(args.in_dim, 10)
    model = torch.nn.Sequential(
        torch.nn.Linear(args.in_dim, args.hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(args.hidden, args.hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(args.hidden, 10),
    )
    phases["model_built"] = time.time() - launched
    dht = kit.DHT(
        initial_peers=[args.initial_peer] if args.initial_peer else [],
        host="127.0.0.1",
        client_mode=False,
    )
    phases["dht_ready"] = time.time() - launched
    if not args.initial_peer:
        with open(args.events + ".addr", "w") as file:
            file.write(dht.get_visible_maddrs()[0])

    def adam(params: object) -> torch.optim.Optimizer:
        # As the anchor (optimizer=torch.optim.Adam, params=...): the optimizer builds it. Its
        # first construction imports torch._dynamo (~1.4 s), in either script.
        phases["adam_begun"] = time.time() - launched
        built = torch.optim.Adam(params, lr=1e-3)  # type: ignore[arg-type]
        phases["adam_built"] = time.time() - launched
        return built

    opt = kit.Optimizer(
        dht=dht,
        run_id="bench",
        target_batch_size=args.target_batch_size,
        batch_size_per_step=args.batch_size,
        optimizer=adam,
        params=model.parameters(),
        matchmaking_time=args.matchmaking_time,
        averaging_timeout=args.averaging_timeout,
        # --delay-grad-averaging (kit only): rounds and steps in the background
        delay_grad_averaging=args.delay,
        # --reuse-grad-buffers: accumulate in .grad (autograd adds; the loop never zeroes it)
        reuse_grad_buffers=args.reuse_grad_buffers,
    )
    phases["optimizer_ready"] = time.time() - launched
    if args.late:
        opt.load_state_from_peers()
        phases["state_loaded"] = time.time() - launched
    generator = torch.Generator().manual_seed(os.getpid())
    deadline = time.time() + args.deadline
    joined = not args.late
    pending: list[str] = []
    flushed = 0.0
    with open(args.events, "w") as events:
        while time.time() < deadline and not os.path.exists(args.stop):
            start = time.time()  # the batch is made inside the timed part, as in the anchor
            inputs = torch.randn(args.batch_size, args.in_dim, generator=generator)
            labels = (inputs @ teacher).argmax(-1)
            loss = torch.nn.functional.cross_entropy(model(inputs), labels)
            loss.backward()
            computed = time.time()
            opt.step()
            if not args.reuse_grad_buffers:
                opt.zero_grad()
            synced = joined or opt.local_epoch >= opt.tracker.global_progress.epoch
            end = time.time()
            pending.append(json.dumps([start, computed, end, opt.local_epoch, synced, loss.item()]))
            if not flushed or end - flushed > 1.0:  # the first step at once: the launcher waits
                events.write("\n".join(pending) + "\n")
                events.flush()
                pending.clear()
                flushed = end
            if not joined and synced:
                joined = True
                phases["joined"] = end - launched
                with open(args.events + ".phases", "w") as file:
                    json.dump({k: round(v, 3) for k, v in phases.items()}, file)
                with open(args.events + ".joined", "w") as file:
                    file.write(str(end - launched))
        events.write("".join(line + "\n" for line in pending))
    opt.shutdown()
    dht.shutdown()


def window(events: list[list[float]], t0: float, t1: float) -> dict[str, float]:
    inside = [e for e in events if t0 <= e[0] and e[2] <= t1]
    compute = sum(e[1] - e[0] for e in inside)
    gaps = [b[0] - a[2] for a, b in zip(inside, inside[1:], strict=False)] + [
        e[2] - e[1] for e in inside
    ]
    in_step = sorted(e[2] - e[1] for e in inside)
    between = sorted(b[0] - a[2] for a, b in zip(inside, inside[1:], strict=False))
    return {
        "samples": len(inside),
        "epochs_advanced": (inside[-1][3] - inside[0][3]) if inside else 0,
        "fwd_bwd_s": compute,
        "opt_step_s": sum(in_step),  # inside opt.step() + zero_grad()
        "between_steps_s": sum(between),  # the script's loop: logging the step
        "step_ms": [
            round(1000 * statistics.median(values), 2) if values else None
            for values in (sorted(e[1] - e[0] for e in inside), in_step, between)
        ],
        "longest_stall_s": max(gaps, default=0.0),
    }


def phase_durations(phases: dict[str, float]) -> dict[str, float]:
    """The late peer's start as consecutive phases (seconds each; they add up to time_to_join_s).

    The state download and the first look at the progress run in the background while the
    optimizer is built: ``state_download_wait`` is what remained of them after it.
    """
    order = [
        ("process_start", "started"),
        ("import_torch", "torch_imported"),
        ("import_kit", "kit_imported"),
        ("build_model", "model_built"),
        ("dht_bootstrap", "dht_ready"),
        ("optimizer_setup", "adam_begun"),
        ("script_adam", "adam_built"),  # the script's own torch.optim.Adam (torch._dynamo import)
        ("optimizer_setup_rest", "optimizer_ready"),
        ("state_download_wait", "state_loaded"),
        ("first_step", "joined"),
    ]
    durations, previous = {}, 0.0
    for name, mark in order:
        if mark in phases:
            durations[name] = round(phases[mark] - previous, 3)
            previous = phases[mark]
    return durations


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--peers", type=int, default=2)
    parser.add_argument("--duration", type=float, default=90.0)
    parser.add_argument("--late-join", action="store_true")
    parser.add_argument("--post-join-s", type=float, default=15.0)
    parser.add_argument("--target-batch-size", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--matchmaking-time", type=float, default=3.0)
    parser.add_argument("--averaging-timeout", type=float, default=30.0)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--in-dim", type=int, default=512)
    parser.add_argument(
        "--delay-grad-averaging",
        dest="delay",
        action="store_true",
        help="kit only: average gradients and step in the background (not in hivemind's anchor)",
    )
    parser.add_argument(
        "--reuse-grad-buffers",
        action="store_true",
        help="Optimizer(reuse_grad_buffers=True): gradients accumulate in .grad, no zero_grad()",
    )
    parser.add_argument("--role", default="launcher", help=argparse.SUPPRESS)
    for name in ("initial-peer", "events", "stop", "launched"):
        parser.add_argument(f"--{name}", default="", help=argparse.SUPPRESS)
    parser.add_argument("--late", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=600.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "peer":
        return peer_main(args)

    # kit's modules as an installed kit has them: compiled (pip compiles a wheel's modules, and
    # hivemind's are in the anchor's venv); a source tree under PYTHONDONTWRITEBYTECODE=1 would
    # compile them again in every process (~0.2 s of the late peer's start).
    compileall.compile_dir(os.path.join(ROOT, "kit"), quiet=1)
    folder = tempfile.mkdtemp(prefix="kit-collab-")
    stop = os.path.join(folder, "stop")
    common = [
        "--role",
        "peer",
        "--stop",
        stop,
        "--target-batch-size",
        str(args.target_batch_size),
        "--batch-size",
        str(args.batch_size),
        "--matchmaking-time",
        str(args.matchmaking_time),
        "--averaging-timeout",
        str(args.averaging_timeout),
        "--hidden",
        str(args.hidden),
        "--in-dim",
        str(args.in_dim),
        *(["--delay-grad-averaging"] if args.delay else []),
        *(["--reuse-grad-buffers"] if args.reuse_grad_buffers else []),
    ]

    def launch(index: int, initial: str, late: bool = False) -> subprocess.Popen[bytes]:
        extra = ["--late"] if late else []
        return subprocess.Popen(
            [
                sys.executable,
                __file__,
                *common,
                "--events",
                os.path.join(folder, f"peer{index}"),
                "--initial-peer",
                initial,
                "--launched",
                str(time.time()),
                *extra,
            ]
        )

    processes = [launch(0, "")]
    address_file = os.path.join(folder, "peer0.addr")
    while not os.path.exists(address_file):
        time.sleep(0.1)
    with open(address_file) as file:
        address = file.read().strip()
    processes += [launch(i, address) for i in range(1, args.peers)]

    def read(index: int) -> list[list[float]]:
        path = os.path.join(folder, f"peer{index}")
        return [json.loads(line) for line in open(path)] if os.path.exists(path) else []

    while not all(read(i) for i in range(args.peers)):
        time.sleep(0.2)
    t0 = max(read(i)[0][0] for i in range(args.peers))
    time.sleep(max(0.0, t0 + args.duration - time.time()))
    t1 = t0 + args.duration
    result: dict[str, object] = {
        "bench": "collab_train",
        "impl": "kit",
        "peers": args.peers,
        "duration": args.duration,
        "delay_grad_averaging": args.delay,
        "reuse_grad_buffers": args.reuse_grad_buffers,
    }
    late_result: dict[str, object] | None = None
    if args.late_join:
        late = launch(args.peers, address, late=True)
        joined = os.path.join(folder, f"peer{args.peers}.joined")
        deadline = time.time() + 120
        while not os.path.exists(joined) and time.time() < deadline and late.poll() is None:
            time.sleep(0.1)
        time.sleep(args.post_join_s)
        late_result = {"time_to_join_s": None}
        if os.path.exists(joined):
            with open(joined) as file:
                late_result["time_to_join_s"] = round(float(file.read()), 2)
        if os.path.exists(joined.replace(".joined", ".phases")):
            with open(joined.replace(".joined", ".phases")) as file:
                phases = json.load(file)
            late_result["phases_s"] = dict(sorted(phases.items(), key=lambda kv: kv[1]))
            late_result["phase_durations_s"] = phase_durations(phases)
        processes.append(late)
    open(stop, "w").close()
    for process in processes:
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
    windows = [window(read(i), t0, t1) for i in range(args.peers)]
    samples = sum(w["samples"] for w in windows) * args.batch_size
    wall = args.duration * args.peers
    result["full_window"] = {
        "samples_per_s": round(samples / args.duration, 1),
        "epochs_advanced": min(w["epochs_advanced"] for w in windows),
        "fraction_outside_fwd_bwd": round(1 - sum(w["fwd_bwd_s"] for w in windows) / wall, 3),
        "longest_stall_s": round(max(w["longest_stall_s"] for w in windows), 2),
        # where the time outside forward/backward went (fractions of the wall time), and each
        # peer's median forward/backward, opt.step() and time between steps (ms)
        "outside_in_opt_step": round(sum(w["opt_step_s"] for w in windows) / wall, 3),
        "outside_between_steps": round(sum(w["between_steps_s"] for w in windows) / wall, 3),
        "median_fwd_bwd_step_between_ms": [w["step_ms"] for w in windows],
    }
    if late_result is not None:
        result["late_join"] = late_result
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
