"""One training peer of the churn scenario: ``python -m tests.netsim.churn_peer --index i ...``.

Holds the peer process that tests/netsim/test_churn.py starts (inside a NetSim host, or on
loopback) and kills (tests/netsim/test_nat_training.py starts it behind NAT, in client mode): it trains a small MLP on synthetic data labelled by a fixed teacher with
``kit.Optimizer``. It does not start or kill anyone, nor judge the results (the test does).

Peers meet through files in a shared run directory (namespaces share the file system):

* the bootstrap peer (``--bootstrap``) writes its DHT address to ``bootstrap.addr``; the others
  read it, join and download the collaboration's state;
* after every local step a peer appends ``<time.time()> <local_epoch>`` to ``peer<i>.events``
  (flushed, so a SIGKILLed peer leaves every line it wrote), and whenever its epoch changed,
  ``<local_epoch> <crc32 of its parameters>`` to ``peer<i>.params`` (where peers parted, when
  they end apart: ``test_churn.partings``);
* the driver writes ``final_epoch``: a peer trains until its local epoch reaches it, then only
  calls ``step(batch_size=0)`` (applying background work, adding no samples) until ``release``
  appears; from then on, once it is settled (:func:`background_work`: not drifted, no download,
  parameter round or optimizer step under way; bounded by ``SETTLE_TIMEOUT``), it writes its
  parameters (``peer<i>.final.npy``, float32, no pickle) and epoch and background work
  (``peer<i>.final.json``), and goes on holding until ``stop`` appears (it may still be the
  donor or a member another peer's repair needs), then shuts down, exit code 0.
  :func:`finish` is the driver's side: release, wait for every final file, stop.

Its stderr (and so any traceback) goes to ``peer<i>.log``.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import torch

import kit
from kit.optim.epochs import Refresh

RUN_ID = "churn"
TEACHER_SEED = 1234  # every peer labels its data with the same teacher
SETTLE_SECONDS = 2.0  # after release, at least: let finished background work apply
# After release, at most: a peer whose last round failed under load repairs itself in the
# background (a download of the others' state, or a parameter round), which can take a few
# matchmaking windows and a retry on a loaded 2-core machine.
SETTLE_TIMEOUT = 40.0
STOP_TIMEOUT = 90.0  # after its final files: hold until the driver says stop (every peer wrote)


def teacher(inputs: torch.Tensor) -> torch.Tensor:
    generator = torch.Generator().manual_seed(TEACHER_SEED)
    weight = torch.randn(8, 2, generator=generator)
    return torch.tanh(inputs @ weight) + 0.1 * inputs[:, :2]


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))


def flat_parameters(model: torch.nn.Module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()


def parameters_digest(model: torch.nn.Module) -> str:
    return f"{zlib.crc32(flat_parameters(model).tobytes()):08x}"


def background_work(opt: kit.Optimizer) -> dict[str, object]:
    """What the peer knows to be unsettled: every value falsy when nothing is (written with
    its final parameters: when the survivors end apart, this tells a repair still in flight
    from one nobody started)."""
    driver = opt._driver
    return {
        "drifted": driver.life.drifted,
        "refreshing": driver.life.refresh is not Refresh.IDLE,
        "parameter_round": driver.state_round.epoch if driver.state_round.running else None,
        "optimizer_step_pending": driver.inner.pending,
    }


def finish(
    run_dir: Path, processes: dict[int, subprocess.Popen[bytes]], timeout: float
) -> dict[int, int | None]:
    """The driver's side of the end: release the peers (all at the final epoch), wait until
    each wrote its final files (or exited), then tell them to stop; their exit codes (None:
    still running at the timeout, then killed by the caller)."""
    (run_dir / "release").write_text("1")
    give_up = time.monotonic() + timeout
    while time.monotonic() < give_up and not all(
        (run_dir / f"peer{i}.final.json").exists() or p.poll() is not None
        for i, p in processes.items()
    ):
        time.sleep(0.2)
    (run_dir / "stop").write_text("1")
    codes: dict[int, int | None] = {}
    for index, process in processes.items():
        try:
            codes[index] = process.wait(timeout)
        except subprocess.TimeoutExpired:
            codes[index] = None
    return codes


def read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    return int(text) if text else None


def wait_for_file(path: Path, timeout: float) -> str:
    give_up = time.monotonic() + timeout
    while not path.exists() or not path.read_text().strip():
        if time.monotonic() > give_up:
            raise TimeoutError(f"{path.name} did not appear within {timeout:.0f} s")
        time.sleep(0.05)
    return path.read_text().strip()


def main() -> int:
    parser = argparse.ArgumentParser(description="one training peer of the churn scenario")
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--bootstrap", action="store_true", help="start the DHT, never download")
    parser.add_argument("--target", type=int, required=True, help="target_batch_size")
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--compute-seconds", type=float, default=0.1, help="per micro-batch")
    parser.add_argument("--matchmaking-time", type=float, default=1.5)
    parser.add_argument("--averaging-timeout", type=float, default=10.0)
    parser.add_argument("--lifetime", type=float, default=600.0, help="exit 3 after this")
    parser.add_argument("--client-mode", action="store_true", help="behind NAT: dial out only")
    parser.add_argument("--relay", action="store_true", help="relay for client-mode peers")
    args = parser.parse_args()
    run_dir = Path(args.run_dir)
    log = open(run_dir / f"peer{args.index}.log", "ab", buffering=0)  # noqa: SIM115 (fd 2)
    os.dup2(log.fileno(), 2)  # tracebacks and faulthandler dumps land in the log
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    faulthandler.dump_traceback_later(args.lifetime + 60, exit=True)
    logging.basicConfig(
        level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s"
    )
    logging.getLogger("kit.optim").setLevel(
        getattr(logging, os.environ.get("KIT_CHURN_LOG", "INFO"))
    )
    torch.set_num_threads(1)
    give_up = time.monotonic() + args.lifetime

    model = make_model()
    if args.bootstrap:
        dht = kit.DHT(host=args.host, client_mode=False, peer_options={"relay_service": args.relay})
        address_file = run_dir / "bootstrap.addr"
        (run_dir / "bootstrap.addr.tmp").write_text(dht.get_visible_maddrs()[0])
        os.replace(run_dir / "bootstrap.addr.tmp", address_file)
    else:
        address = wait_for_file(run_dir / "bootstrap.addr", timeout=60)
        dht = kit.DHT(initial_peers=[address], host=args.host, client_mode=args.client_mode)
    opt = kit.Optimizer(
        dht=dht,
        run_id=RUN_ID,
        target_batch_size=args.target,
        optimizer=lambda params: torch.optim.Adam(params, lr=0.003),
        params=model.parameters(),
        matchmaking_time=args.matchmaking_time,
        averaging_timeout=args.averaging_timeout,
        average_state_every=1,
        tracker_opts={"min_refresh_period": 0.2, "max_refresh_period": 1.0},
    )
    if not args.bootstrap:
        opt.load_state_from_peers(timeout=60)  # join at the collaboration's epoch

    events = open(run_dir / f"peer{args.index}.events", "a", buffering=1)  # noqa: SIM115
    digests = open(run_dir / f"peer{args.index}.params", "a", buffering=1)  # noqa: SIM115
    recorded_epoch = None

    def record() -> None:
        nonlocal recorded_epoch
        events.write(f"{time.time():.3f} {opt.local_epoch}\n")
        if opt.local_epoch != recorded_epoch:
            recorded_epoch = opt.local_epoch
            digests.write(f"{opt.local_epoch} {parameters_digest(model)}\n")

    record()
    data = torch.Generator().manual_seed(10_000 + args.index)
    final_epoch_file, release_file = run_dir / "final_epoch", run_dir / "release"
    last_loss = float("nan")
    try:
        # Train until the driver names the final epoch and we reach it.
        while True:
            if time.monotonic() > give_up:
                logging.error("lifetime over before the driver released us")
                return 3
            final_epoch = read_int(final_epoch_file)
            if final_epoch is not None and opt.local_epoch >= final_epoch:
                break
            inputs = torch.randn(args.micro_batch, 8, generator=data)
            loss = torch.nn.functional.mse_loss(model(inputs), teacher(inputs))
            loss.backward()
            last_loss = float(loss.detach())
            opt.step(batch_size=len(inputs))
            opt.zero_grad()
            record()
            time.sleep(args.compute_seconds)  # a real GPU step takes time; keeps the CPU free
        # Hold at the final epoch: no samples, but background work still applies.
        released_at = None
        while True:
            if time.monotonic() > give_up:
                logging.error("lifetime over while waiting for the release")
                return 3
            if released_at is None and release_file.exists():
                released_at = time.monotonic()
            if released_at is not None:
                held = time.monotonic() - released_at
                settled = not any(background_work(opt).values())
                if held >= SETTLE_SECONDS and (settled or held >= SETTLE_TIMEOUT):
                    break
            opt.step(batch_size=0)
            record()
            time.sleep(0.1)
        relay = dht.node.peer.relay_service  # bytes it carried between client-mode peers
        final = {
            "epoch": opt.local_epoch,
            "loss": last_loss,
            "digest": parameters_digest(model),
            **background_work(opt),
            "relayed_bytes": relay.relayed_bytes if relay is not None else 0,
        }
        np.save(run_dir / f"peer{args.index}.final.npy", flat_parameters(model))
        (run_dir / f"peer{args.index}.final.tmp").write_text(json.dumps(final))
        os.replace(
            run_dir / f"peer{args.index}.final.tmp", run_dir / f"peer{args.index}.final.json"
        )
        stop_by = time.monotonic() + STOP_TIMEOUT
        while not (run_dir / "stop").exists() and time.monotonic() < stop_by:
            opt.step(batch_size=0)  # (our state may still be what another peer downloads)
            time.sleep(0.1)
    finally:
        events.close()
        digests.close()
        opt.shutdown()
        dht.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
