"""A real peer in its own process, for tests that kill peers: ``python -m tests.p2p.peer_process``.

Prints its first visible address on stdout, then serves until killed:
``echo`` (unary), ``drip`` (sends N 64 KiB messages slowly), ``sink`` (reads and counts).
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from kit.p2p import wire
from kit.p2p.api import StreamAPI
from kit.p2p.identity import PeerID
from kit.p2p.peer import create_peer


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-id", default="test")
    parser.add_argument("--initial-peer", action="append", default=[])
    parser.add_argument("--client-mode", action="store_true")
    parser.add_argument("--relay", action="store_true")
    parser.add_argument("--protocol-version", type=int, default=None)
    args = parser.parse_args()
    if args.protocol_version is not None:  # to test refusals between kit versions
        wire.PROTOCOL_VERSION = args.protocol_version
    peer = await create_peer(
        args.initial_peer,
        run_id=args.run_id,
        client_mode=args.client_mode,
        relay_service=args.relay,
    )

    async def echo(caller: PeerID, request: bytes) -> bytes:
        return request

    async def drip(stream: StreamAPI) -> None:
        while True:
            await stream.send_message(b"x" * 65536, timeout=30)
            await asyncio.sleep(0.01)

    async def sink(stream: StreamAPI) -> None:
        while await stream.receive_message(max_size=2**21, timeout=60) is not None:
            pass

    peer.add_unary_handler("echo", echo)
    peer.add_stream_handler("drip", drip)
    peer.add_stream_handler("sink", sink)
    print(peer.get_visible_addresses()[0], flush=True)
    await asyncio.sleep(3600)


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
