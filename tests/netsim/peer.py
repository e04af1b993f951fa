"""A kit peer process for network-namespace scenarios: ``python -m tests.netsim.peer ROLE ...``.

``serve``: starts a peer, prints one JSON line ``{"address", "client_mode"}``, then serves until
killed (bounded by ``--lifetime``): ``netsim/tensor/1`` receives tensors and answers each with its
length and SHA-256, so the sender knows every byte arrived intact.

``send``: starts a peer, sends ``--rounds`` tensors of ``--size-mib`` MiB to ``--target`` (after a
1 MiB warm-up that opens the connection) and prints one JSON line per run
``{"bytes", "seconds": [...], "goodput_mbit_s": [...], "client_mode", "direct", "punch"}``. With
``--wait-direct S`` it first waits up to S seconds for a relayed connection to become direct
(hole punching, ``kit.p2p.hole_punch``); ``direct`` says whether the bytes went without a relay.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import sys
import time

from kit.p2p.api import StreamAPI
from kit.p2p.peer import Peer, create_peer
from kit.p2p.tensors import TensorHeader, receive_tensor, send_tensor

PROTOCOL = "netsim/tensor/1"
TIMEOUT = 60.0


def _client_mode(text: str) -> bool | None:
    return {"true": True, "false": False, "auto": None}[text]


async def _start(args: argparse.Namespace) -> Peer:
    return await create_peer(
        args.initial_peer,
        run_id="netsim",
        host=args.host,
        client_mode=_client_mode(args.client_mode),
        relay_service=args.relay,
        dial_timeout=10.0,
        hole_punching=not args.no_punch,
    )


async def serve(args: argparse.Namespace) -> None:
    peer = await _start(args)

    async def sink(stream: StreamAPI) -> None:
        while (received := await receive_tensor(stream, timeout=TIMEOUT)) is not None:
            data = received[1]
            reply = len(data).to_bytes(8, "big") + hashlib.sha256(data).digest()
            await stream.send_message(reply, timeout=TIMEOUT)

    peer.add_stream_handler(PROTOCOL, sink)
    addresses = peer.get_visible_addresses()
    print(json.dumps({"address": addresses[0], "client_mode": peer.client_mode}), flush=True)
    try:
        await asyncio.sleep(args.lifetime)
    finally:
        await peer.shutdown()


async def send(args: argparse.Namespace) -> None:
    peer = await _start(args)
    try:
        remote = await peer.connect(args.target, timeout=30)
        deadline = time.monotonic() + args.wait_direct
        while time.monotonic() < deadline:
            connection = peer.connection(remote)
            if connection is not None and not connection.relayed:
                break
            await asyncio.sleep(0.1)
        connection = peer.connection(remote)
        direct = connection is not None and not connection.relayed
        stream = await peer.open_stream(remote, PROTOCOL, timeout=30)
        sizes = [2**20] + [args.size_mib * 2**20] * args.rounds  # warm-up first
        seconds = []
        for size in sizes:
            header = TensorHeader("uint8", (size,))
            payload = os.urandom(size)
            start = time.perf_counter()
            await send_tensor(stream, header, payload, timeout=TIMEOUT)
            ack = await stream.receive_message(max_size=40, timeout=TIMEOUT)
            seconds.append(time.perf_counter() - start)
            expected = size.to_bytes(8, "big") + hashlib.sha256(payload).digest()
            if ack != expected:
                raise SystemExit(f"the receiver acknowledged {ack!r}, not the tensor sent")
        await stream.close()
        size = args.size_mib * 2**20
        result = {
            "bytes": size,
            "seconds": [round(s, 3) for s in seconds[1:]],
            "goodput_mbit_s": [round(size * 8 / s / 1e6, 1) for s in seconds[1:]],
            "client_mode": peer.client_mode,
            "direct": direct,
            "punch": peer.puncher.statistics() if peer.puncher is not None else None,
        }
        print(json.dumps(result), flush=True)
    finally:
        await peer.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["serve", "send"])
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--initial-peer", action="append", default=[])
    parser.add_argument("--client-mode", choices=["true", "false", "auto"], default="false")
    parser.add_argument("--relay", action="store_true")
    parser.add_argument("--target", default="")
    parser.add_argument("--size-mib", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--lifetime", type=float, default=600.0)
    parser.add_argument("--no-punch", action="store_true", help="no hole punching")
    parser.add_argument("--wait-direct", type=float, default=0.0, help="s to wait for a punch")
    args = parser.parse_args()
    asyncio.run(serve(args) if args.role == "serve" else send(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
