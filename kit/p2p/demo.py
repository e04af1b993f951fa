"""``kit demo`` until the local-collaboration demo exists: two peers exchange a tensor.

It starts two peers on loopback; the second dials the first, sends a tensor of ``--size-mb`` MiB
several times and logs the throughput. It exercises the whole stack (identity, handshake, streams, flow control).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time

from tqdm.auto import tqdm

from kit.p2p.api import StreamAPI
from kit.p2p.peer import create_peer
from kit.p2p.tensors import TensorHeader, receive_tensor, send_tensor
from kit.runtime import get_runtime

logger = logging.getLogger(__name__)
PROTOCOL = "kit/demo/tensor/1"


async def run_demo(
    size_mb: int = 64, repeats: int = 5, run_id: str = "kit-demo"
) -> dict[str, float]:
    """Send a ``size_mb`` MiB tensor ``repeats`` times between two local peers; returns MB/s figures."""
    receiver = await create_peer(run_id=run_id)
    sender = await create_peer(receiver.get_visible_addresses(), run_id=run_id)
    try:

        async def sink(stream: StreamAPI) -> None:
            while (received := await receive_tensor(stream, timeout=30.0)) is not None:
                await stream.send_message(len(received[1]).to_bytes(8, "big"), timeout=30.0)

        receiver.add_stream_handler(PROTOCOL, sink)
        header = TensorHeader("float32", (size_mb * 1024**2 // 4,))
        payload = os.urandom(header.nbytes)
        stream = await sender.open_stream(receiver.peer_id, PROTOCOL, timeout=10.0)
        rates = []
        for _ in tqdm(range(repeats), desc=f"sending {size_mb} MiB tensors", unit="tensor"):
            start = time.perf_counter()
            await send_tensor(stream, header, payload, timeout=30.0)
            ack = await stream.receive_message(max_size=8, timeout=30.0)
            if ack is None or int.from_bytes(ack, "big") != header.nbytes:
                raise RuntimeError("the receiver did not confirm the whole tensor")
            rates.append(header.nbytes / (time.perf_counter() - start) / 1e6)
        await stream.close()
        return {
            "size_mb": size_mb,
            "best_mb_s": max(rates),
            "median_mb_s": sorted(rates)[len(rates) // 2],
        }
    finally:
        await sender.shutdown()
        await receiver.shutdown()


def _handle(args: argparse.Namespace) -> int:
    # Every wait in run_demo is bounded (30 s per tensor); this bounds the whole run too.
    timeout = 60.0 + 60.0 * args.repeats
    result = get_runtime().call(run_demo(args.size_mb, args.repeats), timeout=timeout)
    logger.info(
        "peer-to-peer throughput: %.0f MB/s (best), %.0f MB/s (median)",
        result["best_mb_s"],
        result["median_mb_s"],
    )
    print(json.dumps(result))
    return 0


def add_command(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser("p2p-demo", help="start two local peers and exchange a tensor")
    parser.add_argument("--size-mb", type=int, default=64, help="tensor size in MiB")
    parser.add_argument("--repeats", type=int, default=5, help="how many times to send it")
    parser.set_defaults(handler=_handle)
