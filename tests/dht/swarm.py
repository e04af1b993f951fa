"""A swarm of DHT nodes in one event loop, parametrized by the peer factory.

The same tests run on ``MemoryNetwork`` peers (default, fast) and on real websocket peers on
loopback: pass ``peer_factory=functools.partial(kit.p2p.peer.create_peer, host="127.0.0.1")``.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any, TypeVar

from kit.dht.node import DHTConfig, DHTNode
from kit.dht.validation import RecordValidator
from kit.p2p.api import PeerAPI
from tests.conftest import MS

T = TypeVar("T")
PeerFactory = Callable[..., Awaitable[PeerAPI]]

#: Settings for fast tests: short bans, no background periods in the way. The RPC timeout
#: leaves room for real sockets on a loaded 2-core CI machine (dead peers fail fast anyway).
FAST = DHTConfig(
    rpc_timeout=2000 * MS,
    lookup_timeout=5000 * MS,
    bootstrap_timeout=5000 * MS,
    blacklist_time=100 * MS,
    refresh_period=3600.0,
    republish_period=3600.0,
)


def run(coroutine: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
    """Run one test scenario in a fresh event loop, bounded in time."""

    async def bounded() -> T:
        return await asyncio.wait_for(coroutine, timeout * MS * 1000)

    return asyncio.run(bounded())


class Swarm:
    """Nodes started through one initial peer (the first node); stop them with :meth:`close`."""

    def __init__(self, peer_factory: PeerFactory, config: DHTConfig = FAST) -> None:
        self.peer_factory = peer_factory
        self.config = config
        self.nodes: list[DHTNode] = []

    @property
    def initial_peers(self) -> list[str]:
        return self.nodes[0].peer.get_visible_addresses() if self.nodes else []

    async def add_node(
        self,
        *,
        client_mode: bool = False,
        identity_path: str | os.PathLike[str] | None = None,
        record_validators: Iterable[RecordValidator] = (),
        config: DHTConfig | None = None,
    ) -> DHTNode:
        initial_peers = self.initial_peers
        options: dict[str, Any] = {"client_mode": client_mode}
        if identity_path is not None:
            options["identity_path"] = identity_path
        peer = await self.peer_factory(initial_peers, **options)
        try:
            node = await DHTNode.create(
                peer,
                initial_peers,
                config=config or self.config,
                record_validators=record_validators,
                client_mode=client_mode,
            )
        except BaseException:
            await stop_peer(peer)
            raise
        self.nodes.append(node)
        return node

    async def start(self, size: int) -> Swarm:
        for _ in range(size):
            await self.add_node()
        return self

    async def stop_node(self, node: DHTNode) -> None:
        await node.shutdown()
        await stop_peer(node.peer)
        if node in self.nodes:
            self.nodes.remove(node)

    async def close(self) -> None:
        for node in list(reversed(self.nodes)):
            await self.stop_node(node)

    async def __aenter__(self) -> Swarm:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


async def stop_peer(peer: PeerAPI) -> None:
    shutdown = getattr(peer, "shutdown", None)
    if shutdown is not None:
        await shutdown()
