"""The async Kademlia node over a ``kit.p2p`` peer: bootstrap, lookups, store/get, maintenance.

:class:`DHTNode` drives the pure cores (``routing``, ``storage``, ``validation``, ``protocol``)
with I/O. It owns its background tasks (bucket refresh, republishing its own records, pings of
least-recently-seen contacts, record transfers to newcomers) and cancels them on
:meth:`DHTNode.shutdown`. Use it from coroutines on kit's runtime loop; user code uses the sync
facade ``kit.dht.DHT``.

Kademlia (Maymounkov & Mazières 2002) as hivemind runs it:

* lookups are iterative, ``parallel_rpc`` (alpha) requests in flight (§2.3), over the
  ``beam_size`` closest nodes heard of; gets stop at the first value that is fresh enough
  (``latest=True`` keeps going and merges what every replica holds);
* a record is stored on the ``num_replicas`` nodes closest to its key (hivemind: 5, not k);
* every request and answer refreshes the routing table (§2.3); a full bucket pings its least
  recently seen contact before letting a newcomer in (§2.2);
* a node that meets a new (or restarted) node hands over the records that node should now hold,
  if it is itself the closest holder (§2.5);
* client-mode nodes query and store through others, but serve no RPCs, are never added to
  routing tables, and hold no records for others.

What this module does not do: threads, blocking calls (``dht``), message formats (``protocol``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import random
import time
from collections.abc import Coroutine, Iterable, Sequence
from typing import Any

from kit.dht.lookup import (
    Lookup,
    ValueSearch,
    batches,
    entry_records,
    found_size,
    found_value,
    store_record,
)
from kit.dht.protocol import (
    FIND,
    MAX_ADDRESSES,
    MAX_CONTACTS,
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
from kit.dht.storage import (
    DHTStorage,
    StoredEntry,
    StoreStatus,
    ValueWithExpiration,
)
from kit.dht.validation import (
    CompositeValidator,
    DHTRecord,
    RecordValidator,
    check_record,
    default_validator,
)
from kit.dht.values import (
    RecordLimits,
    check_expiration,
    pack_key,
    pack_subkey,
    pack_value,
)
from kit.errors import (
    BootstrapFailed,
    ConfigError,
    DHTNotRunning,
    InvalidRecord,
    KitTimeout,
    PeerError,
)
from kit.p2p.api import DEFAULT_MAX_MESSAGE, PeerAPI
from kit.p2p.identity import PeerID

logger = logging.getLogger(__name__)

#: Clocks of nodes further apart than this make short-lived records unreliable (hivemind: 3 s).
MAX_DHT_TIME_DISCREPANCY_SECONDS = 3.0
#: Bytes of values one find response may carry; more keys get only nearest nodes.
RESPONSE_VALUE_BUDGET = 3 * 1024 * 1024
_SMALL_REQUEST = 64 * 1024


def get_dht_time() -> float:
    """The DHT's clock: absolute wall-clock seconds (``time.time()``), as in hivemind."""
    return time.time()


@dataclasses.dataclass(frozen=True)
class DHTConfig:
    """Settings of one DHT node; every node of a swarm should share ``limits`` and replicas."""

    # fmt: off
    bucket_size: int = 20  # k: contacts per k-bucket (Kademlia §2.2); increase if lookups fail under heavy churn
    num_replicas: int = 5  # nodes storing each record (hivemind: 5); increase if records vanish as peers leave
    beam_size: int = 10  # closest nodes a lookup keeps querying (>= num_replicas); increase if gets miss fresh values
    parallel_rpc: int = 3  # alpha: requests in flight per lookup (Kademlia §2.3)
    depth_modulo: int = 5  # b of Kademlia §4.2: also split buckets whose depth is not a multiple of b
    rpc_timeout: float = 3.0  # seconds for one request; increase if you see peers blacklisted on slow links
    lookup_timeout: float = 15.0  # seconds for one whole lookup (store or get)
    bootstrap_timeout: float = 15.0  # seconds to fill the routing table after reaching the initial peers
    refresh_period: float = 600.0  # refresh buckets with no lookup for this long (Kademlia §2.3: one hour)
    republish_period: float = 300.0  # re-store this node's own records on the current nearest nodes
    rejoin_period: float = 15.0  # ping the initial peers this often, so a restarted bootstrap peer is found again; 0 = never
    cache_locally: bool = True  # keep values this node found, to answer repeated gets at once
    cache_on_store: bool = True  # keep values this node stored in its cache too
    cache_nearest: int = 1  # after a get, cache the value on this many nearest nodes that lacked it (§2.3)
    cache_size: int = 10_000  # records in the local cache
    max_records: int = 100_000  # records held for others; the earliest-expiring is evicted past it
    max_subkeys: int = 10_000  # subkeys held under one key
    max_dictionary_bytes: int = 2 * 1024 * 1024  # bytes held under one key with subkeys; must fit one message
    blacklist_time: float = 5.0  # seconds an unresponsive peer is skipped after its first failure
    backoff_rate: float = 2.0  # each further failure multiplies the ban by this
    max_background_tasks: int = 64  # pings and record transfers in flight; more are skipped
    limits: RecordLimits = RecordLimits()  # sizes and lifetime of records (the same on every node)
    # fmt: on

    def __post_init__(self) -> None:
        positive_ints = (
            "bucket_size",
            "num_replicas",
            "beam_size",
            "parallel_rpc",
            "depth_modulo",
            "cache_size",
            "max_records",
            "max_subkeys",
            "max_dictionary_bytes",
            "max_background_tasks",
        )
        for name in positive_ints:
            if getattr(self, name) < 1:
                raise ConfigError(f"DHTConfig.{name} must be >= 1 - help: keep the default")
        for name in ("rpc_timeout", "lookup_timeout", "bootstrap_timeout", "refresh_period"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"DHTConfig.{name} must be > 0 seconds - help: keep the default")
        if not self.republish_period > 0 or self.blacklist_time < 0 or self.backoff_rate < 1:
            raise ConfigError(
                "DHTConfig: republish_period must be > 0, blacklist_time >= 0, backoff_rate >= 1"
                " - help: keep the defaults"
            )
        if self.bucket_size > MAX_CONTACTS:
            raise ConfigError(
                f"DHTConfig.bucket_size must be <= {MAX_CONTACTS}, the contacts one find answer "
                "may carry - help: keep the default (20)"
            )
        if self.beam_size < self.num_replicas:
            raise ConfigError(
                f"DHTConfig.beam_size ({self.beam_size}) must be >= num_replicas "
                f"({self.num_replicas}) - help: raise beam_size with num_replicas"
            )
        if self.max_dictionary_bytes > RESPONSE_VALUE_BUDGET:
            raise ConfigError(
                f"DHTConfig.max_dictionary_bytes must be <= {RESPONSE_VALUE_BUDGET} to fit one "
                "message - help: keep the default"
            )


class DHTNode:
    """One Kademlia node on a running peer. Create it with :meth:`create`.

    Attributes:
        peer: the ``kit.p2p`` peer it runs on (not owned: shut it down yourself).
        node_id: its place on the ring, derived from the peer's PeerID.
        client_mode: True if it only queries (serves nothing, stores nothing for others).
        routing_table, storage, cache, blacklist: the pure state, readable for diagnostics.
    """

    def __init__(
        self,
        peer: PeerAPI,
        *,
        config: DHTConfig,
        validator: CompositeValidator,
        client_mode: bool,
    ) -> None:
        self.peer = peer
        self.peer_id: PeerID = peer.peer_id
        self.node_id = DHTID.from_peer_id(peer.peer_id)
        self.config = config
        self.validator = validator
        self.client_mode = client_mode
        self.routing_table = RoutingTable(
            self.node_id, config.bucket_size, config.depth_modulo, now=self._clock()
        )
        self.storage = DHTStorage(
            config.max_records, config.max_subkeys, config.max_dictionary_bytes
        )
        self.cache = DHTStorage(config.cache_size, config.max_subkeys, config.max_dictionary_bytes)
        self.blacklist = Blacklist(config.blacklist_time, config.backoff_rate)
        self._incarnation = random.getrandbits(62)
        self._incarnations: dict[DHTID, int] = {}
        self._own_records: dict[tuple[bytes, bytes | None], DHTRecord] = {}
        self._initial_peers: tuple[str, ...] = ()
        self._initial_ids: dict[
            str, DHTID
        ] = {}  # initial peer address -> its node id, once reached
        self._pinging: set[DHTID] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loops: list[asyncio.Task[Any]] = []
        self._rng = random.Random()
        self._warned_skew = False
        self._running = False

    def __repr__(self) -> str:
        mode = "client" if self.client_mode else "public"
        return f"DHTNode({self.peer_id.short()}, {mode}, contacts={len(self.routing_table)})"

    @classmethod
    async def create(
        cls,
        peer: PeerAPI,
        initial_peers: Sequence[str] = (),
        *,
        config: DHTConfig | None = None,
        record_validators: Iterable[RecordValidator] = (),
        client_mode: bool | None = None,
    ) -> DHTNode:
        """Start a node on ``peer``, join through ``initial_peers`` and start its maintenance.

        Args:
            peer: a running peer (``kit.p2p.peer.Peer`` or ``MemoryPeer``).
            initial_peers: addresses of nodes already in the DHT; empty for the first node.
            config: node settings (:class:`DHTConfig`).
            record_validators: extra validators (signing identities, schemas); owner
                signatures are always verified.
            client_mode: None follows ``peer.client_mode``; True makes a public peer's node
                query only.

        Raises:
            BootstrapFailed: initial peers were given but none answered.
            ConfigError: ``client_mode=False`` on a peer that is in client mode.
        """
        if client_mode is None:
            client_mode = peer.client_mode
        elif not client_mode and peer.client_mode:
            raise ConfigError(
                "client_mode=False needs a peer that accepts connections, but this peer is in "
                "client mode - help: pass client_mode=True (or None), or give the peer a "
                "reachable host/port"
            )
        validator = default_validator(record_validators)
        node = cls(peer, config=config or DHTConfig(), validator=validator, client_mode=client_mode)
        if not client_mode:
            peer.add_unary_handler(PING, node._rpc_ping, max_request=_SMALL_REQUEST)
            peer.add_unary_handler(STORE, node._rpc_store, max_request=DEFAULT_MAX_MESSAGE)
            peer.add_unary_handler(FIND, node._rpc_find, max_request=_SMALL_REQUEST)
        node._running = True
        follow = getattr(getattr(peer, "authorizer", None), "follow_dht", None)
        if callable(follow):  # private runs: the peer reads the run's ban list through us
            follow(node)
        try:
            await node.bootstrap(initial_peers)
        except BaseException:
            await node.shutdown()
            raise
        loop = asyncio.get_running_loop()
        node._loops = [
            loop.create_task(node._refresh_loop(), name=f"dht-refresh-{node.peer_id.short()}"),
            loop.create_task(node._republish_loop(), name=f"dht-republish-{node.peer_id.short()}"),
        ]
        if node.config.rejoin_period > 0 and node._initial_peers:
            node._loops.append(
                loop.create_task(node._rejoin_loop(), name=f"dht-rejoin-{node.peer_id.short()}")
            )
        return node

    @property
    def is_running(self) -> bool:
        return self._running

    def add_validators(self, validators: Iterable[RecordValidator]) -> None:
        """Add record validators (every node of the swarm should run the same ones)."""
        self.validator.extend(validators)

    # --- joining ----------------------------------------------------------------------------

    async def bootstrap(self, initial_peers: Sequence[str]) -> int:
        """Join through ``initial_peers``: ping them, then look up our own id (Kademlia §2.3).

        Returns:
            How many initial peers answered.

        Raises:
            BootstrapFailed: peers were given but none answered.
            ValueError: an address is malformed (ConfigError, kit.address.AddressError).
        """
        self._check_running()
        self._initial_peers = tuple(initial_peers)
        own = set(self.peer.get_visible_addresses())
        others = [address for address in self._initial_peers if address not in own]
        if not others:
            return 0  # the first node of a swarm (maybe given the swarm's shared list)
        outcomes = await asyncio.gather(
            *(self._join(address) for address in others), return_exceptions=True
        )
        for outcome in outcomes:
            fatal = not isinstance(outcome, Exception) or isinstance(outcome, ValueError)
            if isinstance(outcome, BaseException) and fatal:
                raise outcome  # a malformed address (the user's to fix) or a cancellation
        answered = sum(outcome is True for outcome in outcomes)
        if answered == 0 and len(self.routing_table) == 0:
            problems = "; ".join(str(o) for o in outcomes if isinstance(o, Exception))
            raise BootstrapFailed(
                f"failed to connect to bootstrap peers: none of the {len(others)} initial peers "
                f"answered ({problems}) - help: check "
                "the addresses (copy them from get_visible_maddrs() of a running public peer; "
                "client-mode peers serve no DHT requests), that it runs and its port is open"
            )
        deadline = self._clock() + self.config.bootstrap_timeout
        await self._iterate(self.node_id, self.config.bucket_size, None, deadline)
        logger.info(
            "DHT node %s joined: %d contacts", self.peer_id.short(), len(self.routing_table)
        )
        return answered

    async def _join(self, address: str, *, quiet: bool = False) -> bool:
        timeout = self.config.rpc_timeout
        log = logger.debug if quiet else logger.warning
        try:
            peer_id = await self.peer.connect(address, timeout=timeout)
        except (PeerError, KitTimeout) as e:
            log("initial peer %s did not answer: %s", address, e)
            raise
        if peer_id == self.peer_id:
            return False  # our own address in a shared initial_peers list
        failures: list[BaseException] = []
        contact = Contact(peer_id, (address,))
        await self._request(contact, PING, PingRequest(self._info()), PingResponse, failures)
        if failures:
            log("initial peer %s did not answer: %s", address, failures[0])
            raise failures[0]
        return True

    # --- store and get ----------------------------------------------------------------------

    async def store(self, key: Any, value: Any, expiration_time: float, subkey: Any = None) -> bool:
        """Store ``value`` under ``key`` (and ``subkey``) on the nearest nodes until expiration.

        Returns:
            True if at least one replica accepted it; False if all held a later record or it
            has already expired (hivemind semantics).

        Raises:
            ValueNotSerializable, RecordTooLarge: bad key, subkey or value.
            ForgedRecord: the key names an ``[owner:...]`` this node holds no identity for.
            SchemaViolation, InvalidRecord: rejected by a validator / bad expiration.
        """
        self._check_running()
        now = get_dht_time()
        limits = self.config.limits
        key_bytes = pack_key(key, limits)
        subkey_bytes = None if subkey is None else pack_subkey(subkey, limits)
        expiration = check_expiration(expiration_time, now, limits)
        record = DHTRecord(key_bytes, subkey_bytes, pack_value(value, limits), expiration)
        record = dataclasses.replace(record, value=self.validator.sign_value(record))
        check_record(record, self.validator, limits, now)
        if expiration < now:
            return False
        held = self._own_records.get((key_bytes, subkey_bytes))
        if held is None or held.expiration_time <= expiration:
            self._own_records[(key_bytes, subkey_bytes)] = record
        return await self._publish(record)

    async def get(self, key: Any, latest: bool = False) -> ValueWithExpiration[Any] | None:
        """The value stored under ``key``, or None.

        Args:
            latest: False returns the first non-expired value found (fast); True asks every
                replica on the way and returns the newest (subkeys merged).

        Returns:
            ``ValueWithExpiration(value, expiration_time)``; for keys with subkeys the value
            is ``{subkey: ValueWithExpiration}`` and the expiration the latest of them.
        """
        self._check_running()
        key_bytes = pack_key(key, self.config.limits)
        key_id = DHTID.from_key_bytes(key_bytes)
        now = get_dht_time()
        search = ValueSearch(
            key_bytes,
            math.inf if latest else now,
            self.validator,
            self.config.limits,
            max_subkeys=self.config.max_subkeys,
            max_dictionary_bytes=self.config.max_dictionary_bytes,
        )
        for source in (self.storage, self.cache):
            entry = source.get(key_id, now)
            if entry is not None:
                search.add_entry(entry, now)
        if not search.done(now):
            deadline = self._clock() + self.config.lookup_timeout
            lookup = await self._iterate(key_id, self.config.beam_size, search, deadline)
            now = get_dht_time()
            entry = search.entry(now)
            if entry is not None:
                self._cache_found(entry, lookup, search, now)
        return search.result(get_dht_time())

    async def get_many(
        self, keys: Iterable[Any], latest: bool = False
    ) -> dict[Any, ValueWithExpiration[Any] | None]:
        """:meth:`get` for several keys at once (keys must be hashable)."""
        keys = list(keys)
        values = await asyncio.gather(*(self.get(key, latest=latest) for key in keys))
        return dict(zip(keys, values, strict=True))

    async def find_nearest(self, key: Any, k: int | None = None) -> list[Contact]:
        """The ``k`` (default ``num_replicas``) other live nodes closest to ``key``, nearest first."""
        self._check_running()
        key_id = DHTID.from_key_bytes(pack_key(key, self.config.limits))
        deadline = self._clock() + self.config.lookup_timeout
        beam = max(self.config.beam_size, k or 0)
        lookup = await self._iterate(key_id, beam, None, deadline)
        return [contact for _, contact in lookup.nearest_responded(k or self.config.num_replicas)]

    async def republish(self) -> int:
        """Re-store this node's own unexpired records on their current nearest nodes.

        Returns:
            How many records at least one node accepted.
        """
        self._check_running()
        now = get_dht_time()
        for identifier, record in list(self._own_records.items()):
            if record.expiration_time < now:
                del self._own_records[identifier]
        semaphore = asyncio.Semaphore(8)

        async def publish(record: DHTRecord) -> bool:
            async with semaphore:
                return await self._publish(record)

        outcomes = await asyncio.gather(*(publish(r) for r in list(self._own_records.values())))
        return sum(outcomes)

    async def _publish(self, record: DHTRecord) -> bool:
        key_id = DHTID.from_key_bytes(record.key)
        deadline = self._clock() + self.config.lookup_timeout
        lookup = await self._iterate(key_id, self.config.beam_size, None, deadline)
        replicas = self.config.num_replicas
        targets = lookup.nearest_responded(replicas)
        here = not self.client_mode and (
            len(targets) < replicas or self.node_id ^ key_id < targets[-1][0] ^ key_id
        )
        if here:
            targets = targets[: replicas - 1]
        outcomes = await asyncio.gather(
            *(self._store_at(contact, [record]) for _, contact in targets)
        )
        now = get_dht_time()
        stored = any(result is not None and result[0] is StoreStatus.STORED for result in outcomes)
        if here:
            stored |= store_record(self.storage, key_id, record, now) is StoreStatus.STORED
        if self.config.cache_on_store:
            self._cache_on_store(key_id, record, stored, now)
        return stored

    def _cache_on_store(self, key_id: DHTID, record: DHTRecord, stored: bool, now: float) -> None:
        """Keep the cache consistent with a store (hivemind's ``_update_cache_on_store``)."""
        if not stored:
            self.cache.remove(key_id)  # others hold something newer: our cached copy is stale
        elif record.subkey is None or key_id in self.cache:
            store_record(self.cache, key_id, record, now)

    def _cache_found(
        self, entry: StoredEntry, lookup: Lookup, search: ValueSearch, now: float
    ) -> None:
        records = entry_records(entry, now)
        if self.config.cache_locally:
            for record in records:
                store_record(self.cache, search.key_id, record, now)
        lacking = [
            contact
            for node_id, contact in lookup.nearest_responded(self.config.beam_size)
            if node_id not in search.holders
        ]
        for contact in lacking[: self.config.cache_nearest]:
            self._spawn(self._store_at(contact, records, in_cache=True))

    # --- lookups and requests ---------------------------------------------------------------

    async def _iterate(
        self, target: DHTID, beam: int, search: ValueSearch | None, deadline: float
    ) -> Lookup:
        """One iterative lookup (Kademlia §2.3) with ``parallel_rpc`` requests in flight."""
        lookup = Lookup(target, beam, exclude={self.node_id})
        lookup.add(
            self._usable(contact for _, contact in self.routing_table.nearest(target, beam * 2))
        )
        pending: dict[asyncio.Task[FindResult | None], DHTID] = {}
        loop = asyncio.get_running_loop()
        try:
            while search is None or not search.done(get_dht_time()):
                for node_id, contact in lookup.next_to_query(
                    self.config.parallel_rpc - len(pending)
                ):
                    task = loop.create_task(self._find(contact, target, search is not None))
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
                    lookup.responded(node_id, self._usable(result.nearest))
        finally:
            for task in pending:
                task.cancel()
            if pending:  # cancelled requests reset their streams; give them a moment
                await asyncio.wait(pending, timeout=self.config.rpc_timeout)
        self.routing_table.mark_lookup(target, self._clock())
        return lookup

    def _usable(self, contacts: Iterable[Contact]) -> list[tuple[DHTID, Contact]]:
        now = self._clock()
        return [
            (contact.node_id, contact)
            for contact in contacts
            if contact.peer_id != self.peer_id
            and not self.blacklist.is_banned(contact.peer_id, now)
        ]

    async def _find(self, contact: Contact, target: DHTID, want_values: bool) -> FindResult | None:
        request = FindRequest(self._info(), (target,), want_values)
        response = await self._request(contact, FIND, request, FindResponse)
        if response is None:
            return None
        if len(response.results) != 1:
            self._on_failure(contact, "answered a find with the wrong number of results")
            return None
        return response.results[0]

    async def _store_at(
        self, contact: Contact, records: Sequence[DHTRecord], in_cache: bool = False
    ) -> list[StoreStatus] | None:
        request = StoreRequest(self._info(), tuple(records), in_cache)
        response = await self._request(contact, STORE, request, StoreResponse)
        if response is None:
            return None
        if len(response.results) != len(records):
            self._on_failure(contact, "answered a store with the wrong number of results")
            return None
        for error in response.errors:
            if error:
                logger.warning("%s rejected a record: %s", contact.peer_id.short(), error)
        return list(response.results)

    async def _request(
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
            self._on_failure(contact, e)
            if failures is not None:
                failures.append(e)
            return None
        self.blacklist.register_success(contact.peer_id)
        self._on_contact(contact.peer_id, response.sender, fallback_addresses=contact.addresses)
        return response

    # --- routing table upkeep ---------------------------------------------------------------

    def _on_contact(
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

    def _on_failure(self, contact: Contact, reason: object) -> None:
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
            await self._request(contact, PING, PingRequest(self._info()), PingResponse)
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
            self._spawn(self._store_at(contact, batch))

    # --- serving ----------------------------------------------------------------------------

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

    # --- background work --------------------------------------------------------------------

    async def _refresh_loop(self) -> None:
        """Drop expired records; rejoin if alone; refresh stale buckets (Kademlia §2.3)."""
        while True:
            await asyncio.sleep(self.config.refresh_period / 2)
            try:
                now = get_dht_time()
                self.storage.remove_expired(now)
                self.cache.remove_expired(now)
                if len(self.routing_table) == 0 and self._initial_peers:
                    await self.bootstrap(self._initial_peers)
                    await self.republish()
                period = self.config.refresh_period
                for bucket in self.routing_table.stale_buckets(self._clock(), period):
                    deadline = self._clock() + self.config.lookup_timeout
                    await self._iterate(
                        bucket.random_id(self._rng), self.config.beam_size, None, deadline
                    )
            except (PeerError, KitTimeout) as e:
                logger.warning("DHT refresh of %s failed: %s", self.peer_id.short(), e)

    async def _rejoin_loop(self) -> None:
        """Ping the initial peers now and then, so that a restarted one is found again.

        Initial peers are the run's bootstrap peers (a coordinator): when one restarts, it comes
        back knowing nobody, and nobody would look for it until their buckets go stale (Kademlia
        refreshes hourly). A ping puts both sides back in each other's tables, and its new
        incarnation makes us hand it the records it should hold (Kademlia §2.5).
        """
        while True:
            await asyncio.sleep(self.config.rejoin_period)
            own = set(self.peer.get_visible_addresses())
            for address in [a for a in self._initial_peers if a not in own]:
                try:
                    await self._join(address, quiet=True)
                except (PeerError, KitTimeout, ValueError) as e:
                    logger.debug("initial peer %s unreachable: %s", address, e)

    async def _republish_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.republish_period)
            try:
                await self.republish()
            except (PeerError, KitTimeout) as e:
                logger.warning("DHT republish of %s failed: %s", self.peer_id.short(), e)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run owned background work (pings, transfers); skipped when too much is in flight."""
        if not self._running or len(self._tasks) >= self.config.max_background_tasks:
            coro.close()
            return
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.warning("DHT background task failed", exc_info=task.exception())

    async def shutdown(self) -> None:
        """Stop serving and cancel every background task (the peer keeps running)."""
        if not self._running:
            return
        self._running = False
        tasks = [*self._loops, *self._tasks]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
        self._tasks.clear()
        self._loops = []

    # --- helpers ----------------------------------------------------------------------------

    def _check_running(self) -> None:
        if not self._running:
            raise DHTNotRunning(
                f"DHT node {self.peer_id.short()} is shut down - help: create a new DHT"
            )

    def _info(self) -> NodeInfo:
        addresses = (
            () if self.client_mode else tuple(self.peer.get_visible_addresses()[:MAX_ADDRESSES])
        )
        return NodeInfo(addresses, self.client_mode, self._incarnation, get_dht_time())

    @staticmethod
    def _clock() -> float:
        """Monotonic seconds for routing and bans (the one clock read of the driver)."""
        return time.monotonic()
