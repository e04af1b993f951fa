"""One training peer in its own process (``python -m tests.optim.collab_peer``), for the tests.

Trains a small MLP on a deterministic shard with ``kit.Optimizer`` and writes its final
parameters (``.npy``) and a JSON line with its epochs to ``--out``.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

import kit
from tests.optim.reference import make_model, micro_batches


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--initial-peer", required=True)
    parser.add_argument("--peer-index", type=int, required=True)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--target", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--average-state-every", type=int, default=0)
    parser.add_argument("--matchmaking-time", type=float, default=2.0)
    parser.add_argument("--load-state", action="store_true", help="join late: download state first")
    parser.add_argument(
        "--exact", action="store_true", help="exactly one shard per epoch, then wait"
    )
    parser.add_argument("--step-delay", type=float, default=0.0, help="sleep after each step")
    parser.add_argument(
        "--linger-file", default="", help="when done, keep serving the state until it exists"
    )
    args = parser.parse_args()
    faulthandler.dump_traceback_later(
        float(os.environ.get("KIT_TEST_DUMP_AFTER", "600")), exit=True
    )
    logging.basicConfig(
        level=getattr(logging, os.environ.get("KIT_TEST_LOG", "WARNING")),
        stream=sys.stderr,
        format=f"%(asctime)s peer{args.peer_index} %(name)s %(message)s",
    )
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = make_model()
    dht = kit.DHT(initial_peers=[args.initial_peer], host="127.0.0.1", client_mode=False)
    opt = kit.Optimizer(
        dht=dht,
        run_id="collab-test",
        target_batch_size=args.target,
        optimizer=lambda params: torch.optim.Adam(params, lr=0.01),
        params=model.parameters(),
        scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1.0 / (1 + step)),
        matchmaking_time=args.matchmaking_time,
        averaging_timeout=30.0,
        average_state_every=args.average_state_every,
        tracker_opts={"min_refresh_period": 0.2, "max_refresh_period": 1.0},
    )
    rounds: list[dict[str, object]] = []  # what the round listener saw (kit.metrics attests it)
    opt.add_round_listener(
        lambda epoch, result: rounds.append(
            {
                "epoch": epoch,
                "weights": {
                    p.to_base58(): w for p, w in zip(result.peers, result.weights, strict=True)
                },
            }
        )
    )
    loaded_epoch = None
    if args.load_state:
        opt.load_state_from_peers(timeout=60)
        loaded_epoch = opt.local_epoch
    deadline = time.monotonic() + 150
    epochs_seen = []
    progress_file = Path(args.out + ".epoch")
    step = 0
    while time.monotonic() < deadline and opt.local_epoch < args.epochs:
        epoch = opt.local_epoch
        # --exact: each peer brings exactly its shard per epoch and then waits (equivalence);
        # otherwise peers keep training on fresh data until the collaboration steps (churn).
        shard = micro_batches(args.peer_index % 3, epoch if args.exact else 1000 + step)
        for inputs, targets in shard:
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            loss.backward()
            opt.step(batch_size=len(inputs))
            opt.zero_grad()
            step += 1
            time.sleep(args.step_delay)
            if opt.local_epoch != epoch:
                break
        while args.exact and opt.local_epoch == epoch and time.monotonic() < deadline:
            opt.step(batch_size=0)  # our shard is done: wait for the collaboration's step
            time.sleep(0.05)
        if opt.local_epoch != epoch:
            epochs_seen.append(opt.local_epoch)
            progress_file.write_text(str(opt.local_epoch))
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
            np.save(f"{args.out}.e{opt.local_epoch}.npy", flat)
    # Let background work land (a catch-up download, a parameter round), and stay reachable for
    # late joiners until the test says so: training is fast, a joiner may start after the end.
    while time.monotonic() < deadline and (
        opt._driver.sharing.refreshing
        or opt._driver.state_round.running
        or (args.linger_file and not os.path.exists(args.linger_file))
    ):
        opt.step(batch_size=0)
        time.sleep(0.05)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    np.save(args.out + ".npy", params)
    with open(args.out + ".json", "w") as file:
        json.dump(
            {
                "epoch": opt.local_epoch,
                "epochs": epochs_seen,
                "loaded_epoch": loaded_epoch,
                "lr": opt.param_groups[0]["lr"],
                "rounds": rounds,
            },
            file,
        )
    opt.shutdown()
    dht.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
