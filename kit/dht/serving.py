"""Answering other nodes: the PING, STORE and FIND requests of a public DHT node.

:class:`RecordServer` checks every record it is asked to store (``kit.dht.validation``), stores
it in the node's storage or cache, and answers finds with the freshest value it holds (within
one response's value budget) and the nearest contacts it knows. Every request refreshes the
caller's routing entry (``kit.dht.upkeep``). Client-mode nodes serve nothing.

What this module does not do: sending requests, lookups (``kit.dht.node``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kit.dht.config import RESPONSE_VALUE_BUDGET, DHTConfig, get_dht_time
from kit.dht.lookup import found_size, found_value, store_record
from kit.dht.protocol import (
    FIND,
    PING,
    STORE,
    FindRequest,
    FindResponse,
    FindResult,
    NodeInfo,
    PingRequest,
    PingResponse,
    StoreRequest,
    StoreResponse,
    decode,
    encode,
)
from kit.dht.routing import DHTID, RoutingTable
from kit.dht.storage import DHTStorage, StoredEntry, StoreStatus
from kit.dht.validation import CompositeValidator, check_record
from kit.errors import InvalidRecord
from kit.p2p.api import DEFAULT_MAX_MESSAGE, PeerAPI
from kit.p2p.identity import PeerID

logger = logging.getLogger(__name__)

_SMALL_REQUEST = 64 * 1024


class RecordServer:
    """Answers a node's PING, STORE and FIND requests (see the module docstring).

    Args:
        storage, cache: the node's records held for others and its cache.
        validator, config: how records are checked; the node's settings.
        routing_table: where the nearest contacts come from.
        on_contact: refreshes the caller's routing entry (``RoutingUpkeep.on_contact``).
        info: this node's ``NodeInfo`` for answers.
        check_running: raises ``DHTNotRunning`` once the node is shut down.
    """

    def __init__(
        self,
        storage: DHTStorage,
        cache: DHTStorage,
        validator: CompositeValidator,
        config: DHTConfig,
        routing_table: RoutingTable,
        *,
        on_contact: Callable[[PeerID, NodeInfo], None],
        info: Callable[[], NodeInfo],
        check_running: Callable[[], None],
    ) -> None:
        self.storage, self.cache, self.validator = storage, cache, validator
        self.config, self.routing_table = config, routing_table
        self._on_contact, self._info, self._check_running = on_contact, info, check_running

    def serve(self, peer: PeerAPI) -> None:
        """Register the three request handlers on ``peer``."""
        peer.add_unary_handler(PING, self._rpc_ping, max_request=_SMALL_REQUEST)
        peer.add_unary_handler(STORE, self._rpc_store, max_request=DEFAULT_MAX_MESSAGE)
        peer.add_unary_handler(FIND, self._rpc_find, max_request=_SMALL_REQUEST)

    def stop(self, peer: PeerAPI) -> None:
        """Remove the three handlers from ``peer`` (it may serve a new node of its own later)."""
        for protocol in (PING, STORE, FIND):
            peer.remove_handler(protocol)

    async def _rpc_ping(self, caller: PeerID, data: bytes) -> bytes:
        self._check_running()
        request = decode(PingRequest, data)
        self._on_contact(caller, request.sender)
        return encode(PingResponse(self._info()))

    async def _rpc_store(self, caller: PeerID, data: bytes) -> bytes:
        self._check_running()
        request = decode(StoreRequest, data)
        self._on_contact(caller, request.sender)
        now = get_dht_time()
        target = self.cache if request.in_cache else self.storage
        results: list[StoreStatus] = []
        errors: list[str] = []
        for record in request.records:
            try:
                check_record(record, self.validator, self.config.limits, now)
            except InvalidRecord as e:
                logger.debug("rejected a record from %s: %s", caller.short(), e)
                results.append(StoreStatus.INVALID)
                errors.append(f"{type(e).__name__}: {e}")
                continue
            key_id = DHTID.from_key_bytes(record.key)
            results.append(store_record(target, key_id, record, now))
            errors.append("")
        return encode(StoreResponse(self._info(), tuple(results), tuple(errors)))

    async def _rpc_find(self, caller: PeerID, data: bytes) -> bytes:
        self._check_running()
        request = decode(FindRequest, data)
        self._on_contact(caller, request.sender)
        now = get_dht_time()
        exclude = {DHTID.from_peer_id(caller)}
        budget = RESPONSE_VALUE_BUDGET
        results = []
        for key_id in request.key_ids:
            found = None
            if request.want_values:
                entry = self._freshest(key_id, now)
                if entry is not None:
                    found = found_value(entry, now)
                    if found_size(found) > budget:
                        found = None  # the caller asks the next replica or again later
                    else:
                        budget -= found_size(found)
            nearest = self.routing_table.nearest(key_id, self.config.bucket_size, exclude)
            results.append(FindResult(found, tuple(contact for _, contact in nearest)))
        return encode(FindResponse(self._info(), tuple(results)))

    def _freshest(self, key_id: DHTID, now: float) -> StoredEntry | None:
        stored, cached = self.storage.get(key_id, now), self.cache.get(key_id, now)
        if stored is None or (
            cached is not None and cached.expiration_time > stored.expiration_time
        ):
            return cached
        return stored
