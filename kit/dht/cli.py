"""``kit dht``: run a standalone public DHT node and print the addresses others join with.

A swarm needs at least one peer that everyone can reach (hivemind users learn this the hard way:
two NAT'd notebooks cannot find each other). Run this on a machine with a public address or a
forwarded port, and give its printed address to every volunteer as ``initial_peers``::

    kit dht --host 0.0.0.0 --port 31337 --announce /ip4/203.0.113.5/tcp/31337 --identity-path dht.key
    kit dht --join https://run.example.org --hf-token hf_... --identity-path relay.key

It also relays for client-mode peers (Colab, Kaggle), which register with their initial peers.
In an allowlisted run, ``--join`` makes it a member that the coordinator hands out to volunteers
as a relay (``kit.member_relay`` adds that option to this command: it logs in, so it lives
below ``auth`` and ``remote_run``).

What this module does not do: anything but start, print and wait (the node is ``kit.dht.DHT``).
"""

from __future__ import annotations

import argparse
import sys
import threading
from typing import Any, TextIO

from kit.dht.dht import DHT, PeerFactory
from kit.dht.node import DHTConfig


def add_command(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "dht",
        help="run a standalone public DHT node and print its address",
        description="Run a standalone public DHT node (it also relays for client-mode peers) "
        "and print the addresses others join with.",
    )
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default: all)")
    parser.add_argument("--port", type=int, default=31337, help="port to listen on (0: any)")
    parser.add_argument(
        "--announce",
        action="append",
        default=None,
        help="address others should dial if not the listening one, e.g. /ip4/203.0.113.5/tcp/31337"
        " (repeatable)",
    )
    parser.add_argument(
        "--identity-path", default=None, help="key file for a stable peer id (created if missing)"
    )
    parser.add_argument(
        "--initial-peers", nargs="*", default=[], help="addresses of other DHT nodes to join"
    )
    parser.add_argument(
        "--run-id", default="kit", help="peers of other runs are refused (default: kit)"
    )
    parser.add_argument(
        "--refresh-period",
        type=float,
        default=DHTConfig.refresh_period,
        help="seconds between routing-table refreshes",
    )
    parser.set_defaults(handler=run_dht_command)


def run_dht_command(args: argparse.Namespace) -> int:
    return serve(args)


def serve(
    args: argparse.Namespace,
    *,
    peer_factory: PeerFactory | None = None,
    stop: threading.Event | None = None,
    out: TextIO | None = None,
) -> int:
    """Run the node until Ctrl+C (or until ``stop`` is set, for tests); returns the exit code."""
    out = out or sys.stdout
    stop = stop or threading.Event()
    dht = DHT(
        initial_peers=args.initial_peers,
        client_mode=False,
        host=args.host,
        port=args.port,
        announce=args.announce,
        identity_path=args.identity_path,
        config=DHTConfig(refresh_period=args.refresh_period),
        peer_factory=peer_factory,
        peer_options={"relay_service": True, "run_id": args.run_id},  # clients register here
    )
    try:
        addresses = dht.get_visible_addresses()
        print(f"kit DHT node {dht.peer_id} is running.", file=out)
        if addresses:
            print("Peers join it with initial_peers set to any of:", file=out)
            for address in addresses:
                print(address, file=out)
        else:
            print(
                "It has no address others can dial - help: pass --announce <public host:port>",
                file=out,
            )
        print("Press Ctrl+C to stop.", file=out, flush=True)
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        print("stopping", file=out)
    finally:
        dht.shutdown()
    return 0
