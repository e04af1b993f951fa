"""``kit dht``: argument parsing, and serve() on a MemoryNetwork (the websocket run is manual)."""

from __future__ import annotations

import argparse
import io
import threading
import time

from kit.dht import DHT, ValueWithExpiration, get_dht_time
from kit.dht.cli import add_command, serve
from kit.p2p.memory import MemoryNetwork
from tests.dht.swarm import FAST


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kit")
    add_command(parser.add_subparsers(dest="command"))
    return parser.parse_args(list(argv))


def test_arguments() -> None:
    args = parse("dht")
    assert (args.host, args.port, args.announce, args.initial_peers) == ("0.0.0.0", 31337, None, [])
    args = parse(
        "dht", "--port", "0", "--announce", "/ip4/203.0.113.5/tcp/1", "--initial-peers", "a", "b"
    )
    assert args.port == 0 and args.announce == ["/ip4/203.0.113.5/tcp/1"]
    assert args.initial_peers == ["a", "b"] and callable(args.handler)


def test_serve_prints_an_address_others_can_join_and_stops_cleanly() -> None:
    network = MemoryNetwork()
    out = io.StringIO()
    stop = threading.Event()
    result: list[int] = []
    args = parse("dht", "--port", "0")
    thread = threading.Thread(
        target=lambda: result.append(
            serve(args, peer_factory=network.create_peer, stop=stop, out=out)
        )
    )
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while "Press Ctrl+C" not in out.getvalue() and time.monotonic() < deadline:
            time.sleep(0.01)
        lines = out.getvalue().splitlines()
        addresses = [line for line in lines if line.startswith("memory://")]
        assert len(addresses) == 1 and lines[0].startswith("kit DHT node ")
        with DHT(addresses, peer_factory=network.create_peer, config=FAST) as volunteer:
            expiration = get_dht_time() + 60
            assert volunteer.store("hello", "world", expiration)
            assert volunteer.get("hello") == ValueWithExpiration("world", expiration)
    finally:
        stop.set()
        thread.join(10)
    assert result == [0] and network.peers() == []
