"""The blocking facade ``kit.dht.DHT`` on kit's runtime loop, over MemoryNetwork peers."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kit.dht import DHT, DHTNode, ValueWithExpiration, get_dht_time, parse_maddr
from kit.errors import BootstrapFailed, ConfigError, DHTNotRunning, KitTimeout, KitUsageError
from kit.p2p.api import PeerAPI
from kit.p2p.identity import PeerID
from kit.p2p.memory import MemoryNetwork, memory_address
from kit.runtime import get_runtime
from tests.dht.swarm import FAST


def make_dht(network: MemoryNetwork, *initial_peers: str, **kwargs: Any) -> DHT:
    return DHT(list(initial_peers), peer_factory=network.create_peer, config=FAST, **kwargs)


def test_store_and_get_with_hivemind_semantics(network: MemoryNetwork) -> None:
    with (
        make_dht(network) as first,
        make_dht(network, *first.get_visible_maddrs()) as second,
        make_dht(network, *second.get_visible_addresses(), client_mode=True) as client,
    ):
        assert not first.client_mode and client.client_mode
        assert isinstance(first.peer_id, PeerID) and first.peer_id != second.peer_id
        expiration = get_dht_time() + 60
        assert second.store("weights", [1.0, 2.0], expiration) is True
        value, expiration_time = client.get("weights")
        assert (value, expiration_time) == ([1.0, 2.0], expiration)
        assert first.store("weights", "old", expiration - 10) is False
        assert client.store("peers", {"bandwidth": 10}, expiration, subkey=b"me") is True
        future = first.get("peers", latest=True, return_future=True)
        assert isinstance(future, concurrent.futures.Future)
        assert future.result(10) == ValueWithExpiration(
            {b"me": ValueWithExpiration({"bandwidth": 10}, expiration)}, expiration
        )
        stored = second.store("later", 1, expiration, return_future=True)
        assert stored.result(10) is True
        assert first.get("nothing here") is None
    with pytest.raises(DHTNotRunning, match="help:"):
        first.get("weights")
    first.shutdown()  # twice is fine
    assert network.peers() == []  # every peer was shut down with its DHT


def test_run_coroutine_runs_on_the_runtime_loop_and_blocking_calls_there_fail(
    network: MemoryNetwork,
) -> None:
    with make_dht(network) as dht:
        dht.store("key", "value", get_dht_time() + 60)

        async def read(dht_: DHT, node: DHTNode) -> tuple[Any, bool]:
            found = await node.get("key")
            return found, get_runtime().in_runtime_thread()

        found, on_runtime = dht.run_coroutine(read)
        assert found.value == "value" and on_runtime
        assert dht.run_coroutine(read, return_future=True).result(10)[0].value == "value"

        async def blocking(dht_: DHT, node: DHTNode) -> Any:
            return dht_.get("key")  # a deadlock in hivemind; a clear error here

        with pytest.raises(KitUsageError, match="help:"):
            dht.run_coroutine(blocking)
        assert dht.get("key") is not None  # still usable


def test_start_false_then_run_in_background(network: MemoryNetwork) -> None:
    dht = make_dht(network, start=False)
    assert not dht.is_alive()
    with pytest.raises(DHTNotRunning):
        dht.store("key", 1, get_dht_time() + 10)
    dht.run_in_background(await_ready=False)
    dht.wait_until_ready(timeout=10)
    assert dht.is_alive() and dht.get_visible_addresses() == [memory_address(dht.peer_id)]
    dht.shutdown()
    assert not dht.is_alive()


def test_await_ready_false_returns_at_once_and_a_short_wait_times_out(
    network: MemoryNetwork,
) -> None:
    async def slow_factory(initial_peers: list[str], **options: Any) -> PeerAPI:
        await asyncio.sleep(0.5)  # a slow start (e.g. a relay far away)
        return await network.create_peer(initial_peers, **options)

    started = time.monotonic()
    dht = DHT(peer_factory=slow_factory, config=FAST, await_ready=False)
    assert time.monotonic() - started < 0.4 and not dht.is_alive()
    with pytest.raises(KitTimeout, match="help:"):  # a builtin TimeoutError too, as hivemind's
        dht.wait_until_ready(timeout=0.01)
    dht.wait_until_ready(timeout=10)  # it went on starting
    assert dht.is_alive()
    dht.shutdown()


def test_bootstrap_failure_is_raised_and_the_peer_is_stopped(network: MemoryNetwork) -> None:
    nobody = memory_address(PeerID(bytes(32)))
    with pytest.raises(BootstrapFailed, match="(?i)failed to connect to bootstrap peers.*help:"):
        make_dht(network, nobody)
    assert network.peers() == []


def test_hivemind_options_are_mapped_or_ignored_with_one_warning(
    network: MemoryNetwork, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[dict[str, Any]] = []

    async def recording_factory(initial_peers: list[str], **options: Any) -> PeerAPI:
        seen.append(options)
        return await network.create_peer(initial_peers, **options)

    with caplog.at_level(logging.WARNING, logger="kit.dht.dht"):
        dht = DHT(
            start=True,
            peer_factory=recording_factory,
            host_maddrs=["/ip4/0.0.0.0/tcp/31337"],
            announce_maddrs=["/ip4/203.0.113.5/tcp/31337"],
            identity_path=tmp_path / "dht.key",
            use_relay=True,
            use_auto_relay=False,
            nat_port_map=True,
            num_workers=4,
            num_replicas=3,
            wait_timeout=1.5,
            parallel_rpc=None,
        )
    try:
        assert seen == [
            {
                "host": "0.0.0.0",
                "port": 31337,
                "announce": ("/ip4/203.0.113.5/tcp/31337",),
                "identity_path": tmp_path / "dht.key",
                "client_mode": None,
            }
        ]
        assert dht.config.num_replicas == 3 and dht.config.rpc_timeout == 1.5
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert warnings == [
            "kit.dht.DHT ignores these hivemind options: use_relay, use_auto_relay, "
            "nat_port_map, num_workers"
        ]
    finally:
        dht.shutdown()
    client = DHT(start=False, peer_factory=recording_factory, dht_mode="client")
    assert client._peer_options["client_mode"] is True
    with pytest.raises(ConfigError, match="unknown option"):
        DHT(start=False, peer_factory=recording_factory, bucket_sise=20)
    with pytest.raises(ConfigError, match="help:"):
        DHT(start=False, host="0.0.0.0", host_maddrs=["/ip4/0.0.0.0/tcp/1"])
    with pytest.raises(ConfigError, match="multiaddr"):
        DHT(start=False, announce_maddrs=["203.0.113.5:31337"])


def test_parse_maddr() -> None:
    assert parse_maddr("/ip4/127.0.0.1/tcp/80") == ("127.0.0.1", 80)
    assert parse_maddr("/dns/example.org/tcp/443/p2p/QmAbc") == ("example.org", 443)
    assert parse_maddr("/ip6/::1/tcp/1") == ("::1", 1)
    for bad in ("/ip4/1.2.3.4/udp/1", "1.2.3.4:80", "/ip4/1.2.3.4/tcp/99999"):
        with pytest.raises(ConfigError):
            parse_maddr(bad)


def test_facade_is_usable_from_many_threads(network: MemoryNetwork) -> None:
    with make_dht(network) as first, make_dht(network, *first.get_visible_addresses()) as second:
        expiration = get_dht_time() + 60
        errors: list[BaseException] = []

        def worker(n: int) -> None:
            try:
                assert second.store(f"thread {n}", n, expiration)
                assert first.get(f"thread {n}") == ValueWithExpiration(n, expiration)
            except BaseException as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert errors == []
