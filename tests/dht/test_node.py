"""DHTNode swarms in one event loop (MemoryNetwork by default; see tests/dht/swarm.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from pathlib import Path
from typing import Any

import msgpack
import pytest

from kit.dht.node import DHTNode, get_dht_time
from kit.dht.protocol import STORE, NodeInfo, StoreRequest, StoreResponse, decode, encode
from kit.dht.routing import DHTID
from kit.dht.storage import StoreStatus, ValueWithExpiration
from kit.dht.validation import DHTRecord, Ed25519SignatureValidator, SchemaValidator
from kit.dht.values import pack_key
from kit.errors import (
    BootstrapFailed,
    DHTNotRunning,
    ForgedRecord,
    RecordTooLarge,
    RemoteError,
    SchemaViolation,
    UnknownProtocol,
    ValueNotSerializable,
)
from kit.p2p.identity import Identity
from kit.p2p.memory import MemoryNetwork
from tests.conftest import MS
from tests.dht.swarm import FAST, PeerFactory, Swarm, run, stop_peer


def holders(nodes: list[DHTNode], key: Any) -> list[DHTNode]:
    key_id = DHTID.generate(key)
    return [node for node in nodes if key_id in node.storage]


def test_every_node_of_a_30_node_swarm_finds_every_record(peer_factory: PeerFactory) -> None:
    async def scenario() -> None:
        async with Swarm(peer_factory) as swarm:
            await swarm.start(30)
            nodes = swarm.nodes
            expiration = get_dht_time() + 60
            stored = await asyncio.gather(
                *(
                    node.store(f"record {i}", {"from": i}, expiration)
                    for i, node in enumerate(nodes)
                )
            )
            assert all(stored)
            for i in range(len(nodes)):
                assert len(holders(nodes, f"record {i}")) == FAST.num_replicas
            for node in nodes:
                found = await node.get_many([f"record {i}" for i in range(len(nodes))])
                assert found == {
                    f"record {i}": ValueWithExpiration({"from": i}, expiration)
                    for i in range(len(nodes))
                }
            assert await nodes[7].get("never stored") is None

    run(scenario())


def test_a_node_that_knows_nobody_near_a_key_finds_its_nodes_through_its_initial_peer(
    network: MemoryNetwork,
) -> None:
    """Nodes that joined through one initial peer before the other half of the id space
    filled know nobody there (105 of 256 did). Here the nodes of one half, all but the initial
    peer, forget the other half: a lookup of a key there still finds its true nearest nodes,
    starting from what the initial peer knows (before, it converged on the nearest nodes of
    its own half: 256 matchmaking peers split into two swarms, 1 run in 8)."""
    top = 1 << (DHTID.HASH_BITS - 1)

    async def scenario() -> None:
        async with Swarm(network.create_peer) as swarm:
            await swarm.start(32)
            first, nodes = swarm.nodes[0], swarm.nodes
            searcher = next(n for n in nodes[1:] if (n.node_id ^ first.node_id) & top == 0)
            island = [n for n in nodes[1:] if (n.node_id ^ searcher.node_id) & top == 0]
            for node in island:
                for bucket in node.routing_table.buckets:
                    far = [
                        i for i in [*bucket.nodes, *bucket.replacements] if (i ^ node.node_id) & top
                    ]
                    bucket.replacements.clear()
                    for node_id in far:
                        bucket.nodes.pop(node_id, None)
            key = next(
                f"key {i}"
                for i in range(1000)
                if (DHTID.from_key_bytes(pack_key(f"key {i}", FAST.limits)) ^ searcher.node_id)
                & top
            )
            key_id = DHTID.from_key_bytes(pack_key(key, FAST.limits))
            truth = sorted(
                (n for n in nodes if n is not searcher), key=lambda n: n.node_id ^ key_id
            )
            found = await searcher.find_nearest(key, 5)
            assert [c.peer_id for c in found] == [n.peer_id for n in truth[:5]]

    run(scenario())


def test_records_with_three_replicas_survive_the_loss_of_30_percent(
    peer_factory: PeerFactory,
) -> None:
    config = dataclasses.replace(FAST, num_replicas=3, beam_size=6)

    async def scenario() -> None:
        async with Swarm(peer_factory, config) as swarm:
            await swarm.start(30)
            rng = random.Random(2024)
            keys = [f"checkpoint {i}" for i in range(10)]
            expiration = get_dht_time() + 60
            for key in keys:
                assert await rng.choice(swarm.nodes).store(key, key.upper(), expiration)
            held_by = {key: holders(swarm.nodes, key) for key in keys}
            assert all(len(nodes) >= 3 for nodes in held_by.values())
            # worst case allowed: all but one holder of the first record die, plus others at
            # random, as long as each record keeps one live holder (else it is lost by definition)
            victims = set(held_by[keys[0]][1:])
            while len(victims) < 9:
                candidate = rng.choice(swarm.nodes)
                if all(set(nodes) - (victims | {candidate}) for nodes in held_by.values()):
                    victims.add(candidate)
            for victim in victims:
                await swarm.stop_node(victim)
            assert len(swarm.nodes) == 21
            for node in swarm.nodes:
                for key in keys:
                    assert await node.get(key) == ValueWithExpiration(key.upper(), expiration)

    run(scenario())


def test_expired_records_disappear(peer_factory: PeerFactory) -> None:
    async def scenario() -> None:
        async with Swarm(peer_factory) as swarm:
            await swarm.start(8)
            a, b = swarm.nodes[2], swarm.nodes[5]
            soon = get_dht_time() + 300 * MS
            assert await a.store("short-lived", 1, soon)
            assert await a.store("dictionary", 1, soon, subkey="short")
            assert await a.store("dictionary", 2, get_dht_time() + 60, subkey="long")
            assert await b.get("short-lived") == ValueWithExpiration(1, soon)
            assert not await a.store("already expired", 1, get_dht_time() - 1)
            await asyncio.sleep(400 * MS)
            for node in swarm.nodes:
                assert await node.get("short-lived") is None
                found = await node.get("dictionary", latest=True)
                assert found is not None and list(found.value) == ["long"]
                node.storage.remove_expired(get_dht_time())
            assert holders(swarm.nodes, "short-lived") == []

    run(scenario())


def test_later_expiration_wins_also_per_subkey(peer_factory: PeerFactory) -> None:
    async def scenario() -> None:
        async with Swarm(peer_factory) as swarm:
            await swarm.start(10)
            a, b, c = swarm.nodes[1], swarm.nodes[4], swarm.nodes[8]
            now = get_dht_time()
            assert await a.store("model", "v2", now + 100)
            assert not await b.store("model", "v1", now + 50)  # rejected by every replica
            assert await b.get("model") == ValueWithExpiration("v2", now + 100)
            assert await c.get("model", latest=True) == ValueWithExpiration("v2", now + 100)
            assert await b.store("model", "v3", now + 200)
            assert await c.get("model", latest=True) == ValueWithExpiration("v3", now + 200)

            assert await a.store("peers", "a-new", now + 100, subkey="a")
            assert not await b.store("peers", "a-old", now + 50, subkey="a")
            assert await b.store("peers", "b", now + 70, subkey="b")
            expected = {
                "a": ValueWithExpiration("a-new", now + 100),
                "b": ValueWithExpiration("b", now + 70),
            }
            for node in swarm.nodes:
                assert await node.get("peers", latest=True) == ValueWithExpiration(
                    expected, now + 100
                )

    run(scenario())


def test_client_mode_nodes_store_and_get_through_public_nodes(peer_factory: PeerFactory) -> None:
    async def scenario() -> None:
        async with Swarm(peer_factory) as swarm:
            await swarm.start(10)
            clients = [await swarm.add_node(client_mode=True) for _ in range(3)]
            public = swarm.nodes[:10]
            expiration = get_dht_time() + 60
            assert all(client.client_mode for client in clients)
            assert await clients[0].store("from a client", "hello", expiration)
            assert await clients[1].store("progress", 5, expiration, subkey="client 1")
            assert await public[3].store("progress", 7, expiration, subkey="public 3")
            assert await public[6].get("from a client") == ValueWithExpiration("hello", expiration)
            assert await clients[2].get("from a client") == ValueWithExpiration("hello", expiration)
            progress = await clients[2].get("progress", latest=True)
            assert progress is not None and set(progress.value) == {"client 1", "public 3"}
            client_ids = {client.node_id for client in clients}
            for node in swarm.nodes:
                assert not client_ids & {node_id for node_id, _ in node.routing_table.contacts()}
            for client in clients:
                assert len(client.storage) == 0  # stores nothing for others
                assert len(client.routing_table) > 0  # but knows public nodes to ask
                stats = getattr(client.peer, "stats", None)
                assert not stats or not any(p.startswith("kit/dht") for p in stats)

    run(scenario())


def signed_record(
    owner: Ed25519SignatureValidator, key: str, value: Any, expiration: float
) -> DHTRecord:
    packed = msgpack.packb
    record = DHTRecord(packed(key), packed(owner.local_owner), packed(value), expiration)
    return dataclasses.replace(record, value=owner.sign_value(record))


def test_bad_records_and_malformed_rpcs_are_rejected_and_the_node_keeps_serving(
    peer_factory: PeerFactory,
) -> None:
    alice = Ed25519SignatureValidator(Identity.generate())
    mallory = Ed25519SignatureValidator(Identity.generate())

    def integer_steps(value: Any, subkey: Any) -> bool:
        return isinstance(value, int)

    async def scenario() -> None:
        async with Swarm(peer_factory) as swarm:
            await swarm.start(6)
            honest = await swarm.add_node(record_validators=[alice])
            target = swarm.nodes[2]
            now = get_dht_time()
            assert await honest.store("progress", 10, now + 60, subkey=alice.local_owner)
            # local misuse: typed errors before anything is sent
            with pytest.raises(ForgedRecord, match="help:"):
                await target.store("progress", 99, now + 90, subkey=alice.local_owner)
            with pytest.raises(RecordTooLarge):
                await target.store("big", b"x" * 100_000, now + 60)
            with pytest.raises(ValueNotSerializable):
                await target.store("object", object(), now + 60)
            target.add_validators([SchemaValidator("steps", integer_steps)])
            with pytest.raises(SchemaViolation):
                await target.store("steps", "not an int", now + 60)

            # a peer that speaks the protocol directly, as an attacker would
            attacker = await peer_factory([], client_mode=False)
            try:
                address = target.peer.get_visible_addresses()[0]
                await attacker.connect(address, timeout=1.0)
                with pytest.raises(RemoteError, match="MalformedDHTMessage"):
                    await attacker.call(target.peer_id, STORE, b"\xc1 garbage", timeout=1.0)
                forged = signed_record(mallory, "progress", 99, now + 90)
                forged = dataclasses.replace(forged, subkey=msgpack.packb(alice.local_owner))
                records = (
                    forged,
                    DHTRecord(msgpack.packb("big"), None, msgpack.packb(b"x" * 100_000), now + 60),
                    DHTRecord(msgpack.packb("junk"), None, b"\xc1\xc1 not msgpack", now + 60),
                    DHTRecord(msgpack.packb("fine"), None, msgpack.packb("ok"), now + 60),
                )
                info = NodeInfo((), True, 1, now)
                data = encode(StoreRequest(info, records))
                response = decode(
                    StoreResponse, await attacker.call(target.peer_id, STORE, data, timeout=1.0)
                )
                assert response.results == (StoreStatus.INVALID,) * 3 + (StoreStatus.STORED,)
                assert response.errors[0].startswith("ForgedRecord")
                assert response.errors[1].startswith("RecordTooLarge")
                assert response.errors[2].startswith("ValueNotSerializable")
            finally:
                await stop_peer(attacker)
            for node in swarm.nodes:  # everyone still serves, and alice's record is intact
                progress = await node.get("progress", latest=True)
                assert progress is not None
                assert progress.value == {alice.local_owner: ValueWithExpiration(10, now + 60)}
            assert await swarm.nodes[0].get("fine") == ValueWithExpiration("ok", now + 60)

    run(scenario())


def test_found_values_are_cached_locally_and_on_the_nearest_node_that_lacked_them(
    peer_factory: PeerFactory,
) -> None:
    config = dataclasses.replace(FAST, num_replicas=1, beam_size=3)

    async def scenario() -> None:
        async with Swarm(peer_factory, config) as swarm:
            await swarm.start(10)
            writer = swarm.nodes[0]
            expiration = get_dht_time() + 60
            assert await writer.store("popular", "value", expiration)
            (holder,) = holders(swarm.nodes, "popular")
            reader = next(n for n in swarm.nodes if n is not holder and n is not writer)
            key_id = DHTID.generate("popular")
            assert await reader.get("popular") == ValueWithExpiration("value", expiration)
            assert key_id in reader.cache  # a second get is answered locally
            for _ in range(50):
                others = [n for n in swarm.nodes if n not in (holder, writer, reader)]
                if any(key_id in n.cache for n in others):
                    break
                await asyncio.sleep(10 * MS)
            assert any(key_id in n.cache for n in others)

    run(scenario())


def test_node_restarted_with_the_same_identity_rejoins_and_gets_its_records_back(
    peer_factory: PeerFactory, tmp_path: Path
) -> None:
    async def scenario() -> None:
        async with Swarm(peer_factory) as swarm:
            paths = [tmp_path / f"node{i}.key" for i in range(12)]
            for path in paths:
                await swarm.add_node(identity_path=path)
            expiration = get_dht_time() + 60
            keys = [f"shard {i}" for i in range(12)]
            for i, key in enumerate(keys):
                assert await swarm.nodes[i].store(key, i, expiration)
            restarted_index = 5
            old = swarm.nodes[restarted_index]
            held_before = {key for key in keys if old in holders(swarm.nodes, key)}
            assert held_before, "with 12 nodes and 5 replicas every node holds something"
            await swarm.stop_node(old)
            new = await swarm.add_node(identity_path=paths[restarted_index])
            assert new.peer_id == old.peer_id and new.node_id == old.node_id
            for _ in range(100):  # the others hand its records back (Kademlia §2.5)
                if all(new in holders(swarm.nodes, key) for key in held_before):
                    break
                await asyncio.sleep(10 * MS)
            assert all(new in holders(swarm.nodes, key) for key in held_before)
            known_by = sum(new.node_id in node.routing_table for node in swarm.nodes)
            assert known_by >= len(swarm.nodes) // 2  # it is routed to again
            for key in keys:
                assert await swarm.nodes[0].get(key) is not None

    run(scenario())


def test_republish_puts_own_records_back_when_all_their_replicas_left(
    peer_factory: PeerFactory,
) -> None:
    config = dataclasses.replace(FAST, num_replicas=2, beam_size=4, republish_period=200 * MS)

    async def scenario() -> None:
        async with Swarm(peer_factory, config) as swarm:
            await swarm.start(12)
            publisher = swarm.nodes[3]
            for i in range(1000):  # a key the publisher is not a replica of
                key = f"own {i}"
                nearest = await publisher.find_nearest(key, k=2)
                key_id = DHTID.generate(key)
                if all(c.node_id ^ key_id < publisher.node_id ^ key_id for c in nearest):
                    break
            expiration = get_dht_time() + 60
            assert await publisher.store(key, "mine", expiration)
            replicas = holders(swarm.nodes, key)
            assert replicas and publisher not in replicas
            # the publisher republishes every 200 ms, so it may already have put the record on a
            # new nearest node between the two stops: only the originals are known to be gone
            for holder in replicas:
                await swarm.stop_node(holder)
            for _ in range(150):  # both stores of one republish land at their own times
                if len(holders(swarm.nodes, key)) == 2:
                    break
                await asyncio.sleep(20 * MS)
            assert len(holders(swarm.nodes, key)) == 2
            reader = next(node for node in swarm.nodes if node is not publisher)
            assert await reader.get(key) == ValueWithExpiration("mine", expiration)

    run(scenario())


def test_unresponsive_peers_are_blacklisted_and_routed_around(network: MemoryNetwork) -> None:
    config = dataclasses.replace(FAST, blacklist_time=30.0, rpc_timeout=300 * MS)

    async def scenario() -> None:
        async with Swarm(network.create_peer, config) as swarm:
            await swarm.start(15)
            silent = swarm.nodes[4:7]
            links = [network.link(node.peer_id) for node in silent]
            for link in links:
                link.dropping = True
            reader = swarm.nodes[12]
            expiration = get_dht_time() + 60
            loop = asyncio.get_running_loop()
            started = loop.time()
            for i in range(5):
                assert await reader.store(f"key {i}", i, expiration)
                assert await reader.get(f"key {i}", latest=True) == ValueWithExpiration(
                    i, expiration
                )
            # each silent peer costs at most one timeout: then it is banned, not asked again
            assert loop.time() - started < len(silent) * config.rpc_timeout + 1.0
            now = reader._clock()
            contacted = [node for node in silent if reader.blacklist.is_banned(node.peer_id, now)]
            assert contacted, "the lookups must have tried some of the silent peers"
            for node in contacted:
                assert node.node_id not in reader.routing_table
            for link in links:
                link.dropping = False

    run(scenario())


def test_background_refresh_and_clean_shutdown(peer_factory: PeerFactory) -> None:
    config = dataclasses.replace(FAST, refresh_period=100 * MS, republish_period=100 * MS)

    async def scenario() -> None:
        async with Swarm(peer_factory, config) as swarm:
            await swarm.start(5)
            node = swarm.nodes[2]
            start = node._clock()
            await asyncio.sleep(300 * MS)
            assert all(bucket.last_updated > start for bucket in node.routing_table.buckets)
            tasks = list(node._loops)
            await swarm.stop_node(node)
            assert all(task.done() for task in tasks)
            with pytest.raises(DHTNotRunning, match="help:"):
                await node.get("anything")

    run(scenario())


def test_a_peer_that_outlives_its_dht_node_stops_serving_and_may_start_another(
    peer_factory: PeerFactory,
) -> None:
    async def scenario() -> None:
        seed_peer, peer = await peer_factory(), await peer_factory()
        seed = await DHTNode.create(seed_peer, config=FAST)
        seeds = seed_peer.get_visible_addresses()
        first = await DHTNode.create(peer, seeds, config=FAST)
        try:
            await first.shutdown()  # the peer runs on
            with pytest.raises(UnknownProtocol):  # its handlers went with the node
                await seed_peer.call(peer.peer_id, STORE, b"not a store", timeout=5)
            second = await DHTNode.create(peer, seeds, config=FAST)  # the protocols are free
            try:
                assert await second.store("again", 1, get_dht_time() + 10)
                assert (await seed.get("again", latest=True)) is not None
            finally:
                await second.shutdown()
        finally:
            await seed.shutdown()
            for each in (peer, seed_peer):
                await stop_peer(each)

    run(scenario())


def test_bootstrap_failure_is_typed_and_the_first_node_needs_no_peers(
    network: MemoryNetwork,
) -> None:
    async def scenario() -> None:
        peer = await network.create_peer()
        own_address = peer.get_visible_addresses()[0]
        # the first node may get the swarm's shared list, which holds its own address
        lonely = await DHTNode.create(peer, [own_address], config=FAST)
        assert await lonely.store("alone", 1, get_dht_time() + 10)  # stores on itself
        assert await lonely.get("alone") is not None
        client = await DHTNode.create(
            await network.create_peer(client_mode=True), [own_address], config=FAST
        )
        client_address = client.peer.get_visible_addresses()[0]  # reachable, but no DHT server
        with pytest.raises(BootstrapFailed, match="client-mode peers serve no DHT requests"):
            await DHTNode.create(await network.create_peer(), [client_address], config=FAST)
        for node in (client, lonely):
            await node.shutdown()
            await stop_peer(node.peer)
        with pytest.raises(BootstrapFailed, match="help:"):
            await DHTNode.create(await network.create_peer(), [own_address], config=FAST)

    run(scenario())


@pytest.mark.sockets
def test_a_restarted_bootstrap_peer_is_found_again_by_the_nodes_that_joined_through_it(
    tmp_path: Path,
) -> None:
    """A coordinator restarts knowing nobody: its volunteers re-contact it (``rejoin_period``)
    and re-store their records, so it reads them again within seconds, not at the next refresh."""
    import dataclasses
    import socket

    from kit.p2p.peer import create_peer

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = dataclasses.replace(FAST, rejoin_period=200 * MS)
    key = tmp_path / "bootstrap.key"

    async def scenario() -> None:
        first_peer = await create_peer(host="127.0.0.1", port=port, identity_path=key)
        first = await DHTNode.create(first_peer, [], config=config)
        address = first_peer.get_visible_addresses()[0]
        volunteer = await DHTNode.create(
            await create_peer(host="127.0.0.1"), [address], config=config
        )
        try:
            assert await volunteer.store("progress", "epoch 3", get_dht_time() + 60)
            await first.shutdown()
            await first_peer.shutdown()
            second_peer = await create_peer(host="127.0.0.1", port=port, identity_path=key)
            second = await DHTNode.create(second_peer, [], config=config)
            try:
                assert len(second.routing_table) == 0
                for _ in range(100):
                    if volunteer.node_id in second.routing_table:
                        break
                    await asyncio.sleep(50 * MS)
                assert volunteer.node_id in second.routing_table
                found = await second.get("progress")
                assert found is not None and found.value == "epoch 3"
            finally:
                await second.shutdown()
                await second_peer.shutdown()
        finally:
            await volunteer.shutdown()
            await volunteer.peer.shutdown()

    run(scenario())
