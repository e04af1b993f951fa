"""The async Kademlia node over a ``kit.p2p`` peer: bootstrap, store/get, maintenance.

:class:`DHTNode` drives the pure cores (``routing``, ``storage``, ``validation``, ``protocol``)
with I/O, composed of its :class:`~kit.dht.network.DHTNetwork` (requests, lookups and the
routing table they keep true), its :class:`~kit.dht.bootstrap.InitialPeers` (joining the swarm),
its :class:`~kit.dht.publishing.Publisher` (its own records, stored on the nearest nodes) and its
:class:`~kit.dht.serving.RecordServer` (answers to other nodes); its settings are
:class:`~kit.dht.config.DHTConfig`. It owns its background tasks
(bucket refresh, republishing its own records, pings of least-recently-seen contacts, record
transfers to newcomers) and cancels them on :meth:`DHTNode.shutdown`. Use it from coroutines on
kit's runtime loop; user code uses the sync facade ``kit.dht.DHT``.

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

What this module does not do: threads, blocking calls (``dht``), message formats (``protocol``),
sending requests (``network``), joining (``bootstrap``), storing records on other nodes
(``publishing``), answering requests (``serving``).
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

from kit.dht.bootstrap import InitialPeers
from kit.dht.config import (
    DHTConfig,
    get_dht_time,
)
from kit.dht.lookup import (
    CheckedRecords,
    Lookup,
    ValueSearch,
    batches,
    entry_records,
    store_record,
)
from kit.dht.network import DHTNetwork
from kit.dht.protocol import (
    MAX_ADDRESSES,
    NodeInfo,
)
from kit.dht.publishing import Publisher
from kit.dht.routing import DHTID, Contact
from kit.dht.serving import RecordServer
from kit.dht.storage import (
    DHTStorage,
    StoredEntry,
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
    check_expiration,
    pack_key,
    pack_subkey,
    pack_value,
)
from kit.errors import (
    ConfigError,
    DHTNotRunning,
    KitTimeout,
    PeerError,
)
from kit.p2p.api import PeerAPI
from kit.p2p.identity import PeerID

logger = logging.getLogger(__name__)

REPLICAS_REUSE = 10.0  # seconds a get(replicas=...) reuses the nearest nodes it looked up
MAX_REUSED_REPLICA_SETS = 64  # keys whose nearest nodes are kept for that
CHECKED_RECORDS = 8192  # records found valid by gets, remembered (see CheckedRecords)


class DHTNode:
    """One Kademlia node on a running peer. Create it with :meth:`create`.

    Attributes:
        peer: the ``kit.p2p`` peer it runs on (not owned: shut it down yourself).
        node_id: its place on the ring, derived from the peer's PeerID.
        client_mode: True if it only queries (serves nothing, stores nothing for others).
        routing_table, storage, cache, blacklist: the pure state, readable for diagnostics.
        network, server: its requests to other nodes and its answers to them.
        initial_peers, publisher: how it joined (and rejoins), and its own records.
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
        self.storage = DHTStorage(
            config.max_records, config.max_subkeys, config.max_dictionary_bytes
        )
        self.cache = DHTStorage(config.cache_size, config.max_subkeys, config.max_dictionary_bytes)
        self._incarnation = random.getrandbits(62)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loops: list[asyncio.Task[Any]] = []
        self._rng = random.Random()
        # key -> (until, its nearest nodes): polls of one key (matchmaking) skip the lookup
        self._replicas: dict[DHTID, tuple[float, list[tuple[DHTID, Contact]]]] = {}
        self._checked = CheckedRecords(CHECKED_RECORDS)  # records found valid by gets
        self._running = False
        self.network = DHTNetwork(
            peer,
            self.node_id,
            config,
            self.storage,
            client_mode=client_mode,
            clock=self._clock,
            spawn=self._spawn,
            info=self._info,
        )
        self.routing_table, self.blacklist = self.network.routing_table, self.network.blacklist
        self.initial_peers = InitialPeers(
            peer, self.network, config, clock=self._clock, rng=self._rng, info=self._info
        )
        self.publisher = Publisher(
            self.network,
            self.storage,
            self.cache,
            config,
            lookup=self.initial_peers.lookup,
            clock=self._clock,
        )
        self.server = RecordServer(
            self.storage,
            self.cache,
            validator,
            config,
            self.routing_table,
            on_contact=self.network.on_contact,
            info=self._info,
            check_running=self._check_running,
        )

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
            node.server.serve(peer)
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
        if node.config.rejoin_period > 0 and node.initial_peers.addresses:
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
        return await self.initial_peers.bootstrap(initial_peers)

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
        return await self.publisher.store(record)

    async def get(
        self, key: Any, latest: bool = False, *, replicas: int | None = None
    ) -> ValueWithExpiration[Any] | None:
        """The value stored under ``key``, or None.

        Args:
            latest: False returns the first non-expired value found (fast); True asks every
                replica on the way and returns the newest (subkeys merged).
            replicas: with ``latest``, read the value from only this many of the
                ``num_replicas`` nodes nearest to the key, chosen at random (their subkeys
                merged). For a key with hundreds of subkeys that hundreds of peers poll (a
                matchmaking key): every replica's copy per read otherwise, and the readers
                spread over the replicas instead of all asking the nearest ones.

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
            checked=self._checked,
        )
        for source in (self.storage, self.cache):
            entry = source.get(key_id, now)
            if entry is not None:
                search.add_entry(entry, now)
        if latest and replicas is not None:
            await self._read_replicas(key_id, search, replicas)
        elif not search.done(now):
            deadline = self._clock() + self.config.lookup_timeout
            lookup = await self.initial_peers.lookup(
                key_id, self.config.beam_size, search, deadline
            )
            now = get_dht_time()
            entry = search.entry(now)
            if entry is not None:
                self._cache_found(entry, lookup, search, now)
        return search.result(get_dht_time())

    async def _read_replicas(self, key_id: DHTID, search: ValueSearch, count: int) -> None:
        """Read ``count`` random replicas of the key. Their set is looked up once per
        REPLICAS_REUSE seconds: polls of one key (hundreds of matchmaking peers, each several
        times a second) would otherwise spend most of their requests finding the same nodes."""
        held = self._replicas.get(key_id)
        if held is not None and held[0] > self._clock():
            nearest = held[1]
        else:
            deadline = self._clock() + self.config.lookup_timeout
            lookup = await self.initial_peers.lookup(key_id, self.config.beam_size, None, deadline)
            nearest = lookup.nearest_responded(self.config.num_replicas)
            if len(self._replicas) >= MAX_REUSED_REPLICA_SETS:
                self._replicas.pop(next(iter(self._replicas)))  # the oldest
            self._replicas[key_id] = (self._clock() + REPLICAS_REUSE, nearest)
        chosen = self._rng.sample(nearest, min(count, len(nearest)))
        found = await asyncio.gather(
            *(self.network.find(contact, key_id, True) for _, contact in chosen)
        )
        for (node_id, _), result in zip(chosen, found, strict=True):
            if result is None:  # a replica failed: look them up again next time
                self._replicas.pop(key_id, None)
            elif result.value is not None:
                search.add_found(result.value, node_id, get_dht_time())

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
        lookup = await self.initial_peers.lookup(key_id, beam, None, deadline)
        return [contact for _, contact in lookup.nearest_responded(k or self.config.num_replicas)]

    async def republish(self) -> int:
        """Re-store this node's own unexpired records on their current nearest nodes.

        Returns:
            How many records at least one node accepted.
        """
        self._check_running()
        return await self.publisher.republish()

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
            for batch in batches(records):  # a dictionary may hold more than one request may
                self._spawn(self.network.store_at(contact, batch, in_cache=True))

    # --- background work --------------------------------------------------------------------

    async def _refresh_loop(self) -> None:
        """Drop expired records; rejoin if alone; refresh stale buckets (Kademlia §2.3)."""
        while True:
            await asyncio.sleep(self.config.refresh_period / 2)
            try:
                now = get_dht_time()
                self.storage.remove_expired(now)
                self.cache.remove_expired(now)
                if len(self.routing_table) == 0 and self.initial_peers.addresses:
                    await self.bootstrap(self.initial_peers.addresses)
                    await self.republish()
                period = self.config.refresh_period
                for bucket in self.routing_table.stale_buckets(self._clock(), period):
                    deadline = self._clock() + self.config.lookup_timeout
                    await self.network.lookup(
                        bucket.random_id(self._rng), self.config.beam_size, None, deadline
                    )
            except (PeerError, KitTimeout) as e:
                logger.warning("DHT refresh of %s failed: %s", self.peer_id.short(), e)

    async def _rejoin_loop(self) -> None:
        """Ping the initial peers now and then, so that a restarted one is found again."""
        while True:
            await asyncio.sleep(self.config.rejoin_period)
            await self.initial_peers.rejoin()

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
        """Stop serving (the handlers go) and cancel every background task (the peer keeps
        running; a new node may start on it)."""
        if not self._running:
            return
        self._running = False
        unfollow = getattr(getattr(self.peer, "authorizer", None), "unfollow_dht", None)
        if callable(unfollow):  # the peer's checks stop reading the ban list through us
            unfollow(self)
        if not self.client_mode:
            self.server.stop(self.peer)  # (the peer runs on: a new node of it may serve)
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
        """Monotonic seconds for routing and bans (the one clock read of the driver): the loop's
        time, so that a loop on virtual time moves them too."""
        loop = asyncio._get_running_loop()
        return loop.time() if loop is not None else time.monotonic()
