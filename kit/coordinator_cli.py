"""``kit coordinator --config run.yaml``: the organizer's coordinator from a terminal.

::

    kit coordinator --create-authority --state-dir coordinator   # prints the key for run.yaml
    kit coordinator --config run.yaml --port 8765 --announce run.example.org \\
        --tls-cert fullchain.pem --tls-key privkey.pem
    kit coordinator --config run.yaml --host 127.0.0.1 --port 8765 \\
        --announce wss://run.example.org       # behind a TLS reverse proxy on port 443

Reads the run config, starts a :class:`~kit.coordinator.Coordinator` with the options of this
machine, prints the join link and the dashboard's address on stdout (the product: what the
organizer hands out) and runs until Ctrl+C; a coordinator that cannot start (no public address
to hand out, TLS files that cannot serve, or its start-up check found that a remote volunteer
could not train) says why, one problem a line, and exits with 1.

Separate from ``coordinator`` (the services and their lifecycle, the same from the config
notebook) as ``evaluate_cli`` is from ``evaluate``: nothing but argument parsing and printing
lives here.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from kit.config import RunConfig
from kit.coordinator import Coordinator, CoordinatorOptions
from kit.errors import KitError
from kit.run_authority import create_authority

logger = logging.getLogger(__name__)


def add_command(subparsers: Any) -> None:
    """``kit coordinator --config run.yaml``: the organizer's one command."""
    parser = subparsers.add_parser("coordinator", help="run a collaboration's coordinator")
    parser.add_argument("--config", help="the run.yaml written by the config notebook")
    parser.add_argument("--host", default="0.0.0.0", help="listen address (default: all)")
    parser.add_argument("--port", type=int, default=0, help="listening port (0: any free one)")
    parser.add_argument(
        "--announce",
        action="append",
        default=[],
        help="how volunteers reach this machine: a public IP or DNS name (the listening port), "
        "host:port, or wss://run.example.org behind a TLS reverse proxy (repeatable; default: "
        "$PUBLIC_ADDRESS, comma-separated, else this machine's public interface addresses)",
    )
    parser.add_argument(
        "--tls-cert", default=None, help="serve https/wss with this certificate chain (PEM)"
    )
    parser.add_argument("--tls-key", default=None, help="... and its private key (PEM)")
    parser.add_argument("--state-dir", default="coordinator", help="keys, leaderboard, checkpoints")
    parser.add_argument(
        "--tokenizer-dir",
        default=None,
        help="tokenizer folder to serve (default: tokenizer.output_dir)",
    )
    parser.add_argument(
        "--shard-tokens",
        type=int,
        default=CoordinatorOptions.shard_tokens,
        help="token ids per served data shard (lower it for a small corpus)",
    )
    parser.add_argument("--no-auxiliary", action="store_true", help="no auxiliary peer here")
    parser.add_argument(
        "--create-authority",
        action="store_true",
        help="create the authority key in --state-dir, print its public key for run.yaml, exit",
    )
    parser.set_defaults(handler=_coordinator_command)


def _split(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _coordinator_command(args: argparse.Namespace) -> int:
    if args.create_authority:
        print(create_authority(args.state_dir), flush=True)
        return 0
    if not args.config:
        logger.error("--config is missing - help: kit coordinator --config run.yaml")
        return 2
    try:
        config = RunConfig.from_file(args.config)
        options = CoordinatorOptions(
            host=args.host,
            port=args.port,
            announce=tuple(args.announce or _split(os.environ.get("PUBLIC_ADDRESS", ""))),
            tls_certfile=args.tls_cert,
            tls_keyfile=args.tls_key,
            state_dir=args.state_dir,
            tokenizer_dir=args.tokenizer_dir,
            auxiliary_peer=not args.no_auxiliary,
            shard_tokens=args.shard_tokens,
        )
        coordinator = Coordinator(config, options)
        coordinator.start()
    except KitError as error:
        problems = getattr(error, "problems", ())  # the start-up check's, one line each
        logger.error("%s", "not started: a remote volunteer could not train" if problems else error)
        for problem in problems:
            logger.error("  %s", problem)
        return 1
    print(f"join link: {coordinator.join_url}", flush=True)
    print(f"dashboard: {coordinator.dashboard_url}", flush=True)
    coordinator.run_forever()
    return 0
