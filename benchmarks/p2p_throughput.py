"""Throughput of one tensor sent peer to peer: plain TCP vs kit direct vs kit through a relay.

Each peer runs in its own process, as it would on volunteers' machines. Per round the sender
sends a ``--size-mb`` MiB float32 tensor and waits for the receiver's acknowledgement; the
figure is the median over ``--rounds`` rounds (after one warm-up round). Output: one JSON line
with ``tcp_mb_s``, ``direct_mb_s``, ``relayed_mb_s`` and the ratios to plain TCP.

    python benchmarks/p2p_throughput.py --size-mb 64 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

PROTOCOL = "bench/tensor/1"


class _TensorReceiver(asyncio.BufferedProtocol):
    """The fastest plain-TCP receiver asyncio offers: the kernel writes into the final buffer."""

    def __init__(self) -> None:
        self.header = bytearray(8)
        self.buffer = memoryview(self.header)
        self.filled = 0
        self.in_header = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.buffer[self.filled :]

    def buffer_updated(self, nbytes: int) -> None:
        self.filled += nbytes
        if self.filled < len(self.buffer):
            return
        if self.in_header:
            size = int.from_bytes(self.header, "big")
            if size == 0:
                self.transport.close()
                return
            self.buffer, self.filled, self.in_header = memoryview(bytearray(size)), 0, False
        else:
            self.transport.write(b"\x01")  # type: ignore[attr-defined]
            self.buffer, self.filled, self.in_header = memoryview(self.header), 0, True


async def tcp_server() -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_TensorReceiver, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.sleep(3600)


async def tcp_client(port: int, size: int, rounds: int) -> list[float]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload = os.urandom(size)
    rates = []
    for _ in range(rounds + 1):
        start = time.perf_counter()
        writer.write(size.to_bytes(8, "big"))
        writer.write(payload)
        await writer.drain()
        await reader.readexactly(1)
        rates.append(size / (time.perf_counter() - start) / 1e6)
    writer.write((0).to_bytes(8, "big"))
    await writer.drain()
    writer.close()
    return rates[1:]


async def kit_receiver(initial_peers: list[str], client_mode: bool, relay: bool) -> None:
    from kit.p2p.peer import create_peer
    from kit.p2p.tensors import receive_tensor

    peer = await create_peer(
        initial_peers, run_id="bench", client_mode=client_mode, relay_service=relay
    )

    async def sink(stream):  # type: ignore[no-untyped-def]
        while (received := await receive_tensor(stream, timeout=60)) is not None:
            await stream.send_message(len(received[1]).to_bytes(8, "big"), timeout=60)

    peer.add_stream_handler(PROTOCOL, sink)
    print(peer.get_visible_addresses()[0], flush=True)
    await asyncio.sleep(3600)


async def kit_sender(address: str, size: int, rounds: int) -> list[float]:
    from kit.p2p.peer import create_peer
    from kit.p2p.tensors import TensorHeader, send_tensor

    peer = await create_peer(run_id="bench")
    try:
        remote = await peer.connect(address, timeout=30)
        header = TensorHeader("float32", (size // 4,))
        payload = os.urandom(header.nbytes)
        stream = await peer.open_stream(remote, PROTOCOL, timeout=30)
        rates = []
        for _ in range(rounds + 1):
            start = time.perf_counter()
            await send_tensor(stream, header, payload, timeout=60)
            ack = await stream.receive_message(max_size=8, timeout=60)
            if ack is None or int.from_bytes(ack, "big") != header.nbytes:
                raise RuntimeError("receiver did not acknowledge the whole tensor")
            rates.append(header.nbytes / (time.perf_counter() - start) / 1e6)
        await stream.close()
        return rates[1:]
    finally:
        await peer.shutdown()


def run(coro):  # type: ignore[no-untyped-def]
    """Run on the same kind of loop kit uses (uvloop when installed), for a fair comparison."""
    from kit.runtime import _new_event_loop

    loop = _new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


def spawn(*args: str) -> tuple[subprocess.Popen[str], str]:
    process = subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    line = process.stdout.readline().strip()
    if not line:
        process.kill()
        raise RuntimeError(f"{args[1]} did not start")
    return process, line


def measure(*args: str) -> list[float]:
    output = subprocess.run(
        [sys.executable, __file__, *args],
        stdout=subprocess.PIPE,
        text=True,
        timeout=600,
        check=True,
    )
    return json.loads(output.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-mb", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--role", default="main", help=argparse.SUPPRESS)
    parser.add_argument("--target", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    size = args.size_mb * 1024**2

    if args.role == "tcp-server":
        run(tcp_server())
    elif args.role == "tcp-client":
        print(json.dumps(run(tcp_client(int(args.target), size, args.rounds))))
    elif args.role in ("kit-receiver", "kit-relayed-receiver", "kit-relay"):
        targets = [args.target] if args.target else []
        run(kit_receiver(targets, args.role == "kit-relayed-receiver", args.role == "kit-relay"))
    elif args.role == "kit-sender":
        print(json.dumps(run(kit_sender(args.target, size, args.rounds))))
    else:
        common = ["--size-mb", str(args.size_mb), "--rounds", str(args.rounds)]
        processes = []
        try:
            server, port = spawn("--role", "tcp-server")
            processes.append(server)
            tcp = measure("--role", "tcp-client", "--target", port, *common)
            receiver, address = spawn("--role", "kit-receiver")
            processes.append(receiver)
            direct = measure("--role", "kit-sender", "--target", address, *common)
            relay, relay_address = spawn("--role", "kit-relay")
            processes.append(relay)
            client, relayed_address = spawn(
                "--role", "kit-relayed-receiver", "--target", relay_address
            )
            processes.append(client)
            relayed = measure("--role", "kit-sender", "--target", relayed_address, *common)
        finally:
            for process in reversed(processes):
                process.kill()
                process.wait(10)
        result = {
            "size_mb": args.size_mb,
            "rounds": args.rounds,
            "tcp_mb_s": round(statistics.median(tcp), 1),
            "direct_mb_s": round(statistics.median(direct), 1),
            "relayed_mb_s": round(statistics.median(relayed), 1),
        }
        result["direct_vs_tcp"] = round(result["direct_mb_s"] / result["tcp_mb_s"], 3)
        result["relayed_vs_tcp"] = round(result["relayed_mb_s"] / result["tcp_mb_s"], 3)
        print(json.dumps(result))


if __name__ == "__main__":
    main()
