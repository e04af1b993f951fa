"""Averager peers in their own processes, to be killed mid-round: ``python -m tests.averaging.averager_process``.

Importing torch takes seconds, so this process imports everything once and then forks one child
per request (a few milliseconds each). It reads one JSON request per line on stdin::

    {"initial_peers": [...], "seed": 7, "weight": 2.0, "numel": 20000, "kill_after": 5,
     "settings": {"prefix": "kill", ...}}

and the child joins the DHT, calls ``step()`` once and SIGKILLs itself when it has sent
``kill_after`` tensor payloads on all-reduce streams (as a sender or as an aggregator). The child
prints ``<pid> <peer id>`` when it is about to step. Nothing here touches torch before the fork.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from typing import Any

import scipy.optimize  # noqa: F401 (kit imports it on a leader's first LP; each child would pay it)
import torch

from kit.averaging.averager import AsyncAverager
from kit.averaging.chunk_stream import PROTOCOL
from kit.averaging.settings import AveragerSettings
from kit.dht.node import DHTConfig, DHTNode
from kit.p2p.peer import create_peer
from kit.p2p.stream import Stream

PAYLOAD_BYTES = 1024  # messages at least this large are tensor payloads, not headers


def values(seed: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


def die_after_payloads(count: int) -> None:
    """SIGKILL this process when it is about to send its ``count + 1``-th tensor payload."""
    send = Stream.send_message
    sent = 0

    async def counting(self: Stream, data: Any, *, timeout: float | None = None) -> None:
        nonlocal sent
        if self.protocol == PROTOCOL and len(memoryview(data)) >= PAYLOAD_BYTES:
            if sent >= count:
                os.kill(os.getpid(), signal.SIGKILL)
            sent += 1
        await send(self, data, timeout=timeout)

    Stream.send_message = counting  # type: ignore[method-assign]


async def victim(request: dict[str, Any]) -> None:
    die_after_payloads(request["kill_after"])
    peer = await create_peer(request["initial_peers"], run_id="test")
    config = DHTConfig(rpc_timeout=2.0, lookup_timeout=4.0, blacklist_time=0.1)
    node = await DHTNode.create(peer, request["initial_peers"], config=config)
    tensor = values(request["seed"], request["numel"])
    averager = await AsyncAverager.create([tensor], node, AveragerSettings(**request["settings"]))
    print(os.getpid(), peer.peer_id.to_base58(), flush=True)
    await averager.step(weight=request["weight"], timeout=request.get("timeout", 5.0))
    await asyncio.sleep(30)  # not reached in the tests: the round kills this process first


def main() -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    torch.set_num_threads(1)
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if os.fork() == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            try:
                asyncio.run(asyncio.wait_for(victim(request), 60.0))
            finally:
                os._exit(0)


if __name__ == "__main__":
    main()
