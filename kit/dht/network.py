"""A DHT node's view of the network: the requests it sends, and the routing table they keep true.

Kademlia (Maymounkov & Mazières 2002) as hivemind runs it:

* lookups are iterative, ``parallel_rpc`` (alpha) requests in flight (§2.3), over the
  ``beam_size`` closest nodes heard of (``kit.dht.lookup`` holds the pure bookkeeping);
* every request and answer refreshes the routing table (§2.3); a restarted node (a new
  incarnation) is unbanned and treated as new;
* a full bucket pings its least recently seen contact before letting a newcomer in (§2.2);
* a node that meets a new (or restarted) node hands over the records that node should now hold,
  if it is itself the closest holder (§2.5);
* a node that fails to answer is blacklisted (with backoff) and dropped from the table;
  client-mode nodes are never added to routing tables.

:class:`DHTNetwork` owns the routing table, the blacklist and the incarnations seen; the node
(``kit.dht.node``) lends it the records it holds (for §2.5) and its task spawner.

What this module does not do: records, store and get (``kit.dht.node``), answering requests
(``kit.dht.serving``), message formats (``kit.dht.protocol``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any

from kit.dht.config import MAX_DHT_TIME_DISCREPANCY_SECONDS, DHTConfig, get_dht_time
from kit.dht.lookup import Lookup, ValueSearch, batches, entry_records
from kit.dht.protocol import (
    FIND,
    MAX_ADDRESSES,
    PING,
    STORE,
    FindRequest,
    FindResponse,
    FindResult,
    M,
    NodeInfo,
    PingRequest,
    PingResponse,
    StoreRequest,
    StoreResponse,
    decode,
    encode,
)
from kit.dht.routing import DHTID, Blacklist, Contact, RoutingTable
from kit.dht.storage import DHTStorage, StoreStatus
from kit.dht.validation import DHTRecord
from kit.errors import ConfigError, KitTimeout, PeerError
from kit.p2p.api import DEFAULT_MAX_MESSAGE, PeerAPI
from kit.p2p.identity import PeerID

logger = logging.getLogger(__name__)


class DHTNetwork:
    """A node's requests to other nodes and its routing table (see the module docstring).

    Args:
        peer: the ``kit.p2p`` peer requests go through.
        node_id: the node's place on the ring.
        config: the node's settings.
        storage: the records the node holds for others (handed over to newcomers, §2.5).
        client_mode: a client-mode node hands no records over.
        clock: monotonic seconds for routing and bans (the node's one clock read).
        spawn: runs owned background work (the node's; skipped when too much is in flight).
        info: this node's ``NodeInfo`` for requests.
    """

    def __init__(
        self,
        peer: PeerAPI,
        node_id: DHTID,
        config: DHTConfig,
        storage: DHTStorage,
        *,
        client_mode: bool,
        clock: Callable[[], float],
        spawn: Callable[[Coroutine[Any, Any, Any]], None],
        info: Callable[[], NodeInfo],
    ) -> None:
        self.peer, self.peer_id, self.node_id = peer, peer.peer_id, node_id
        self.config, self.storage, self.client_mode = config, storage, client_mode
        self._clock, self._spawn, self._info = clock, spawn, info
        self.routing_table = RoutingTable(
            node_id, config.bucket_size, config.depth_modulo, now=clock()
        )
        self.blacklist = Blacklist(config.blacklist_time, config.backoff_rate)
        self._incarnations: dict[DHTID, int] = {}
        self._pinging: set[DHTID] = set()
        self._warned_skew = False

    # --- requests and lookups ---------------------------------------------------------------

    async def lookup(
        self,
        target: DHTID,
        beam: int,
        search: ValueSearch | None,
        deadline: float,
        seeds: Iterable[Contact] = (),
    ) -> Lookup:
        """One iterative lookup (Kademlia §2.3) with ``parallel_rpc`` requests in flight; a
        ``search`` gathers the values found on the way (gets), ``None`` only finds nodes.
        ``seeds``: contacts to start from besides the routing table's nearest."""
        lookup = Lookup(target, beam, exclude={self.node_id})
        lookup.add(
            self.usable(contact for _, contact in self.routing_table.nearest(target, beam * 2))
        )
        lookup.add(self.usable(seeds))
        pending: dict[asyncio.Task[FindResult | None], DHTID] = {}
        loop = asyncio.get_running_loop()
        try:
            while search is None or not search.done(get_dht_time()):
                for node_id, contact in lookup.next_to_query(
                    self.config.parallel_rpc - len(pending)
                ):
                    task = loop.create_task(self.find(contact, target, search is not None))
                    pending[task] = node_id
                remaining = deadline - self._clock()
                if not pending or remaining <= 0:
                    break
                done, _ = await asyncio.wait(
                    pending, timeout=remaining, return_when=asyncio.FIRST_COMPLETED
                )
                for task in done:
                    node_id = pending.pop(task)
                    result = task.result()
                    if result is None:
                        lookup.failed(node_id)
                        continue
                    if search is not None and result.value is not None:
                        search.add_found(result.value, node_id, get_dht_time())
                    lookup.responded(node_id, self.usable(result.nearest))
        finally:
            for task in pending:
                task.cancel()
            if pending:  # cancelled requests reset their streams; give them a moment
                await asyncio.wait(pending, timeout=self.config.rpc_timeout)
        self.routing_table.mark_lookup(target, self._clock())
        if not lookup.finished and (search is None or not search.done(get_dht_time())):
            logger.debug("a lookup ended unfinished (its deadline passed)")
        return lookup

    def usable(self, contacts: Iterable[Contact]) -> list[tuple[DHTID, Contact]]:
        now = self._clock()
        return [
            (contact.node_id, contact)
            for contact in contacts
            if contact.peer_id != self.peer_id
            and not self.blacklist.is_banned(contact.peer_id, now)
        ]

    async def find(self, contact: Contact, target: DHTID, want_values: bool) -> FindResult | None:
        request = FindRequest(self._info(), (target,), want_values)
        response = await self.request(contact, FIND, request, FindResponse)
        if response is None:
            return None
        if len(response.results) != 1:
            self.on_failure(contact, "answered a find with the wrong number of results")
            return None
        return response.results[0]

    async def store_at(
        self, contact: Contact, records: Sequence[DHTRecord], in_cache: bool = False
    ) -> list[StoreStatus] | None:
        request = StoreRequest(self._info(), tuple(records), in_cache)
        response = await self.request(contact, STORE, request, StoreResponse)
        if response is None:
            return None
        if len(response.results) != len(records):
            self.on_failure(contact, "answered a store with the wrong number of results")
            return None
        for error in response.errors:
            if error:
                logger.warning("%s rejected a record: %s", contact.peer_id.short(), error)
        return list(response.results)

    async def request(
        self,
        contact: Contact,
        protocol: str,
        message: Any,
        response_type: type[M],
        failures: list[BaseException] | None = None,
    ) -> M | None:
        """One RPC; failures blacklist the peer, drop it from the routing table, and are
        appended to ``failures`` if given."""
        for address in contact.addresses[:MAX_ADDRESSES]:
            try:
                self.peer.add_address(contact.peer_id, address)
            except (ConfigError, ValueError):
                logger.debug("ignored a bad address of %s: %r", contact.peer_id.short(), address)
        try:
            data = await self.peer.call(
                contact.peer_id,
                protocol,
                encode(message),
                timeout=self.config.rpc_timeout,
                max_response=DEFAULT_MAX_MESSAGE,
            )
            response = decode(response_type, data)
        except (PeerError, KitTimeout) as e:
            self.on_failure(contact, e)
            if failures is not None:
                failures.append(e)
            return None
        self.blacklist.register_success(contact.peer_id)
        self.on_contact(contact.peer_id, response.sender, fallback_addresses=contact.addresses)
        return response

    # --- routing table upkeep ---------------------------------------------------------------

    def on_contact(
        self, peer_id: PeerID, info: NodeInfo, fallback_addresses: Sequence[str] = ()
    ) -> None:
        """A node spoke to us directly: refresh its routing entry (Kademlia §2.3)."""
        if (
            abs(info.dht_time - get_dht_time()) > MAX_DHT_TIME_DISCREPANCY_SECONDS
            and not self._warned_skew
        ):
            self._warned_skew = True
            logger.warning(
                "the clock of peer %s differs from ours by %.1f s; records near expiry will "
                "misbehave - help: enable NTP time sync on both machines",
                peer_id.short(),
                info.dht_time - get_dht_time(),
            )
        if info.client_mode or peer_id == self.peer_id:
            return
        node_id = DHTID.from_peer_id(peer_id)
        now = self._clock()
        restarted = self._incarnations.get(node_id, info.incarnation) != info.incarnation
        if restarted:
            self.blacklist.register_success(peer_id)
        if self.blacklist.is_banned(peer_id, now):
            return
        is_new = restarted or node_id not in self.routing_table
        known = self.routing_table.get(node_id)
        addresses = (
            info.addresses or tuple(fallback_addresses) or (known.addresses if known else ())
        )
        contact = Contact(peer_id, addresses)
        least_recent = self.routing_table.add_or_update(node_id, contact, now)
        self._incarnations[node_id] = info.incarnation
        if len(self._incarnations) > 2 * len(self.routing_table) + 1024:
            self._incarnations = {
                n: i for n, i in self._incarnations.items() if n in self.routing_table
            }
        if least_recent is not None:
            self._spawn(self._check_least_recent(*least_recent))
        elif is_new and not self.client_mode and node_id in self.routing_table:
            self._transfer_records(node_id, contact)

    def on_failure(self, contact: Contact, reason: object) -> None:
        node_id = contact.node_id
        self.blacklist.register_failure(contact.peer_id, self._clock())
        self.routing_table.remove(node_id)  # its incarnation is kept: a restart unbans it
        logger.debug("DHT peer %s failed: %s", contact.peer_id.short(), reason)

    async def _check_least_recent(self, node_id: DHTID, contact: Contact) -> None:
        """Ping a full bucket's oldest contact; if it is gone, a newcomer takes its place (§2.2)."""
        if node_id in self._pinging:
            return
        self._pinging.add(node_id)
        try:
            await self.request(contact, PING, PingRequest(self._info()), PingResponse)
        finally:
            self._pinging.discard(node_id)

    def _transfer_records(self, newcomer: DHTID, contact: Contact) -> None:
        """Hand a new node the records it should now hold, if we are their closest holder (§2.5)."""
        now = get_dht_time()
        records: list[DHTRecord] = []
        for key_id, entry in self.storage.items(now):
            neighbors = self.routing_table.nearest(
                key_id, self.config.num_replicas, exclude={newcomer}
            )
            if neighbors:
                newcomer_should_store = (
                    len(neighbors) < self.config.num_replicas
                    or newcomer ^ key_id < neighbors[-1][0] ^ key_id
                )
                we_are_responsible = self.node_id ^ key_id < neighbors[0][0] ^ key_id
                if not (newcomer_should_store and we_are_responsible):
                    continue
            records.extend(entry_records(entry, now))
        for batch in batches(records):
            self._spawn(self.store_at(contact, batch))
