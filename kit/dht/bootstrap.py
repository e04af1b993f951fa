"""Joining the swarm: a DHT node's initial peers, and the lookups they seed.

:class:`InitialPeers` holds the addresses a node joins through and the contacts among them that
answered. It joins (ping them, look up our own id, fill the buckets that lookup left empty:
Kademlia §2.3), rejoins them now and then (a restarted bootstrap peer comes back knowing
nobody), and starts a lookup from what they know when the node knows nobody near the target.

What this module does not do: sending requests or keeping the routing table (``network``), the
node's life and its background loops, records (``node``, ``publishing``).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Sequence

from kit.dht.config import DHTConfig
from kit.dht.lookup import Lookup, ValueSearch
from kit.dht.network import DHTNetwork
from kit.dht.protocol import PING, NodeInfo, PingRequest, PingResponse
from kit.dht.routing import DHTID, Contact
from kit.errors import BootstrapFailed, KitTimeout, PeerError
from kit.p2p.api import PeerAPI
from kit.p2p.identity import PeerID

logger = logging.getLogger(__name__)


class InitialPeers:
    """The addresses a node joins through (``addresses``) and those that answered (``contacts``).

    The node lends it its peer, network, settings, clock (monotonic seconds), random source and
    the :class:`NodeInfo` it introduces itself with.
    """

    def __init__(
        self,
        peer: PeerAPI,
        network: DHTNetwork,
        config: DHTConfig,
        *,
        clock: Callable[[], float],
        rng: random.Random,
        info: Callable[[], NodeInfo],
    ) -> None:
        self.peer = peer
        self.network = network
        self.config = config
        self.clock = clock
        self.rng = rng
        self.info = info
        self.node_id = network.node_id
        self.addresses: tuple[str, ...] = ()
        self.contacts: dict[PeerID, Contact] = {}  # those that answered a join

    async def bootstrap(self, initial_peers: Sequence[str]) -> int:
        """Join through ``initial_peers`` (see ``DHTNode.bootstrap``); how many answered."""
        self.addresses = tuple(initial_peers)
        own = set(self.peer.get_visible_addresses())
        others = [address for address in self.addresses if address not in own]
        if not others:
            return 0  # the first node of a swarm (maybe given the swarm's shared list)
        outcomes = await asyncio.gather(
            *(self.join(address) for address in others), return_exceptions=True
        )
        for outcome in outcomes:
            fatal = not isinstance(outcome, Exception) or isinstance(outcome, ValueError)
            if isinstance(outcome, BaseException) and fatal:
                raise outcome  # a malformed address (the user's to fix) or a cancellation
        answered = sum(outcome is True for outcome in outcomes)
        routing_table = self.network.routing_table
        if answered == 0 and len(routing_table) == 0:
            problems = "; ".join(str(o) for o in outcomes if isinstance(o, Exception))
            raise BootstrapFailed(
                f"failed to connect to bootstrap peers: none of the {len(others)} initial peers "
                f"answered ({problems}) - help: check "
                "the addresses (copy them from get_visible_maddrs() of a running public peer; "
                "client-mode peers serve no DHT requests), that it runs and its port is open"
            )
        deadline = self.clock() + self.config.bootstrap_timeout
        await self.network.lookup(self.node_id, self.config.bucket_size, None, deadline)
        await self.fill_empty_buckets(deadline)
        logger.info(
            "DHT node %s joined: %d contacts", self.peer.peer_id.short(), len(routing_table)
        )
        return answered

    async def fill_empty_buckets(self, deadline: float) -> None:
        """Kademlia §2.3's last join step ("u refreshes all k-buckets further away than its
        closest neighbor"), for the buckets the lookup of our own id left empty."""
        empty = [b for b in self.network.routing_table.buckets if not b.nodes]
        targets = [b.random_id(self.rng) for b in empty if not b.covers(self.node_id)]
        await asyncio.gather(
            *(self.lookup(t, self.config.beam_size, None, deadline) for t in targets)
        )

    async def lookup(
        self, key_id: DHTID, beam: int, search: ValueSearch | None, deadline: float
    ) -> Lookup:
        """A lookup that starts from what the initial peers know when we know nobody near the
        target (its bucket is empty).

        A node that joined through one initial peer learns its own half of the id space (the
        initial peer answers with the nodes nearest the newcomer), and nodes that joined
        before the other half filled never hear of it: after 256 nodes joined one by one, 105
        knew nobody in the other half. Their lookups of a key there converged on the nodes of
        their own half nearest to it, so the nodes that stored a matchmaking key and those
        that polled it split into two swarms that never saw each other (1 run in 8 of 256
        peers). The initial peers (every newcomer contacted them) know both halves."""
        seeds: list[Contact] = []
        entries = list(self.contacts.values())
        if entries and not self.network.routing_table.bucket_for(key_id).nodes:
            answers = await asyncio.gather(
                *(self.network.find(contact, key_id, False) for contact in entries)
            )
            seeds = [c for answer in answers if answer is not None for c in answer.nearest]
        return await self.network.lookup(key_id, beam, search, deadline, seeds)

    async def join(self, address: str, *, quiet: bool = False) -> bool:
        """Connect to ``address`` and ping it; False if it is our own address."""
        timeout = self.config.rpc_timeout
        log = logger.debug if quiet else logger.warning
        try:
            peer_id = await self.peer.connect(address, timeout=timeout)
        except (PeerError, KitTimeout) as e:
            log("initial peer %s did not answer: %s", address, e)
            raise
        if peer_id == self.peer.peer_id:
            return False  # our own address in a shared initial_peers list
        failures: list[BaseException] = []
        contact = Contact(peer_id, (address,))
        await self.network.request(contact, PING, PingRequest(self.info()), PingResponse, failures)
        if failures:
            log("initial peer %s did not answer: %s", address, failures[0])
            raise failures[0]
        self.contacts[peer_id] = contact
        return True

    async def rejoin(self) -> None:
        """Ping the initial peers again, so that a restarted one is found again.

        Initial peers are the run's bootstrap peers (a coordinator): when one restarts, it comes
        back knowing nobody, and nobody would look for it until their buckets go stale (Kademlia
        refreshes hourly). A ping puts both sides back in each other's tables, and its new
        incarnation makes us hand it the records it should hold (Kademlia §2.5).
        """
        own = set(self.peer.get_visible_addresses())
        for address in [a for a in self.addresses if a not in own]:
            try:
                await self.join(address, quiet=True)
            except (PeerError, KitTimeout, ValueError) as e:
                logger.debug("initial peer %s unreachable: %s", address, e)
