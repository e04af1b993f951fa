"""kit.testing.netsim: namespaces, shaped links, NAT, cleanup, the delay proxy, and kit.p2p on top.

The ``netns`` tests need root, iproute2 and nftables; they are skipped (with the reason) elsewhere.
Peers run as real processes inside the namespaces (``tests/netsim/peer.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import subprocess
import sys
import time

import pytest

from kit.errors import ConfigError
from kit.testing.delay_proxy import DelayProxy, DelaySchedule
from kit.testing.netns import clean_stale, list_namespaces, read_line, stale_namespaces
from kit.testing.netsim import DEFAULT_CONGESTION_CONTROL, HostSpec, LinkShape, NetSim
from tests.conftest import MS
from tests.netsim.skips import skip_without_netns

PEER = "tests.netsim.peer"
CONNECT = (  # prints "connected" or the error: a TCP dial of argv[1]:argv[2]
    "import socket, sys\n"
    "s = socket.socket(); s.settimeout(1.0)\n"
    "try:\n    s.connect((sys.argv[1], int(sys.argv[2]))); print('connected')\n"
    "except OSError as e:\n    print(type(e).__name__)\n"
)
CONGESTION = (  # dials argv[1]:7001 if given, else accepts once; prints the TCP congestion control
    "import socket, sys\n"
    "if len(sys.argv) > 1:\n    c = socket.create_connection((sys.argv[1], 7001), timeout=5.0)\n"
    "else:\n"
    "    s = socket.create_server(('0.0.0.0', 7001)); s.settimeout(10.0)\n"
    "    print('ready', flush=True); c, _ = s.accept()\n"
    "name = c.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16)\n"
    "print(name.rstrip(b'\\0').decode(), flush=True)\n"
)
LISTEN = (  # accepts once, prints the address the connection came from
    "import socket\n"
    "s = socket.socket(); s.bind(('0.0.0.0', 7000)); s.listen(); print('ready', flush=True)\n"
    "c, a = s.accept(); print(a[0], flush=True)\n"
)


def start_peer(sim: NetSim, host: str, *args: str) -> dict[str, object]:
    process = sim.python(host, PEER, "serve", *args)
    return dict(json.loads(read_line(process, timeout=30.0)))


def send(sim: NetSim, host: str, *args: str) -> dict[str, object]:
    done = sim.run(host, [sys.executable, "-m", PEER, "send", *args], timeout=60.0)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def dial(sim: NetSim, host: str, address: str, port: int = 7000) -> str:
    done = sim.run(host, [sys.executable, "-c", CONNECT, address, str(port)], timeout=10.0)
    return done.stdout.strip()


# --- pure parts (no root needed) ---------------------------------------------------------------


def test_stale_namespaces_are_those_of_dead_processes() -> None:
    names = ["ksim12x0-r", "ksim12x0-h0", "ksim34x1-r", "other", "ksimjunk-r"]
    assert stale_namespaces(names, alive={34}) == ["ksim12x0-r", "ksim12x0-h0"]
    assert stale_namespaces(names, alive={12, 34}) == []


def test_delay_schedule_keeps_order_and_adds_stalls() -> None:
    schedule = DelaySchedule(0.05, 0.5, 0.2, random.Random(1))
    arrivals = (0.0, 0.001, 0.002, 0.003, 0.004, 0.005)
    releases = [schedule.release_time(now) for now in arrivals]
    assert releases == sorted(releases)  # in order even when an earlier chunk stalled
    assert all(r >= now + 0.05 for r, now in zip(releases, arrivals, strict=True))
    assert max(releases) >= 0.2  # with p=0.5 over 6 chunks, some chunk stalled (seeded)
    with pytest.raises(ConfigError):
        DelaySchedule(-1.0, 0.0, 0.2, random.Random(0))


def test_congestion_control_must_be_a_name() -> None:
    with pytest.raises(ConfigError, match="help:"):
        NetSim([HostSpec("a")], congestion_control="cubic; reboot")


def test_link_shape_validation() -> None:
    assert LinkShape(100).tbf_arguments()[:3] == ["tbf", "rate", "100000kbit"]
    with pytest.raises(ConfigError, match="help:"):
        LinkShape(rate_mbit=0)


@pytest.mark.sockets
async def test_delay_proxy_adds_round_trip_delay_on_loopback() -> None:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    target = ("127.0.0.1", server.sockets[0].getsockname()[1])
    delay = 100 * MS
    proxy = DelayProxy(target, delay=delay)
    port = await proxy.start("127.0.0.1")
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        payload = bytes(range(256)) * 4096  # 1 MiB: several chunks, order must survive
        start = time.perf_counter()
        writer.write(payload)
        received = await asyncio.wait_for(reader.readexactly(len(payload)), 10)
        elapsed = time.perf_counter() - start
        assert received == payload
        assert elapsed >= 2 * delay  # each direction held for `delay`
        writer.close()
    finally:
        await proxy.close()
        server.close()


# --- namespaces -----------------------------------------------------------------------------------


@pytest.mark.netns
@pytest.mark.processes
@skip_without_netns
@pytest.mark.parametrize("body_raises", [False, True])
def test_nothing_of_the_run_remains_after_exit(body_raises: bool) -> None:
    sim = NetSim([HostSpec("a", shape=LinkShape(50)), HostSpec("b", nat=True)])
    process = None
    expected = pytest.raises(RuntimeError) if body_raises else contextlib.nullcontext()
    with expected, sim:
        assert len(sim.leftovers()) == 3  # router + 2 hosts
        process = sim.popen("a", ["sleep", "60"])
        if body_raises:
            raise RuntimeError("the body failed")
    assert sim.leftovers() == []
    assert process is not None and process.poll() is not None  # its processes were killed


@pytest.mark.netns
@skip_without_netns
def test_stale_namespaces_of_dead_runs_are_removed() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    name = f"ksim{dead.pid}x0-r"
    subprocess.run(["ip", "netns", "add", name], check=True, timeout=10)
    try:
        assert name in clean_stale()
        assert name not in list_namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)


@pytest.mark.netns
@pytest.mark.processes
@skip_without_netns
def test_nat_allows_outbound_only() -> None:
    hosts = [
        HostSpec("pub"),
        HostSpec("pub2"),
        HostSpec("home", nat=True),
        HostSpec("home2", nat=True),
    ]
    with NetSim(hosts) as sim:
        for name in ("pub", "pub2", "home", "home2"):
            listener = sim.popen(name, [sys.executable, "-c", LISTEN])
            assert read_line(listener, timeout=10.0) == "ready"
            if name == "pub":
                pub_listener = listener
        assert dial(sim, "home", sim.host("pub").address) == "connected"
        assert read_line(pub_listener, timeout=5.0) == "10.231.0.1"  # masqueraded
        assert dial(sim, "pub2", sim.host("pub").address) != "connected"  # listener took one
        assert dial(sim, "pub2", sim.host("home").address) != "connected"  # no inbound route
        assert dial(sim, "home2", sim.host("home").address) != "connected"  # homes are apart
        assert dial(sim, "pub", sim.host("pub2").address) == "connected"  # the switch works


@pytest.mark.netns
@pytest.mark.processes
@skip_without_netns
@pytest.mark.parametrize("congestion_control", [DEFAULT_CONGESTION_CONTROL, "reno"])
def test_hosts_use_the_pinned_congestion_control(congestion_control: str) -> None:
    # Pinned per namespace (on the routes), not inherited from this machine: both ends of a
    # connection between public hosts, and of one from a NAT'd host, use it.
    hosts = [HostSpec("pub"), HostSpec("pub2"), HostSpec("home", nat=True)]
    with NetSim(hosts, congestion_control=congestion_control) as sim:
        for dialer in ("pub2", "home"):
            listener = sim.popen("pub", [sys.executable, "-c", CONGESTION])
            assert read_line(listener, timeout=10.0) == "ready"
            done = sim.run(
                dialer, [sys.executable, "-c", CONGESTION, sim.host("pub").address], timeout=10.0
            )
            assert done.stdout.strip() == congestion_control, (dialer, done.stderr)
            assert read_line(listener, timeout=5.0) == congestion_control, dialer


# --- kit.p2p scenarios ------------------------------------------------------------------------


@pytest.mark.netns
@pytest.mark.processes
@skip_without_netns
def test_kit_goodput_on_a_100_mbit_link() -> None:
    shape = LinkShape(rate_mbit=100)
    with NetSim([HostSpec("sender", shape=shape), HostSpec("receiver", shape=shape)]) as sim:
        receiver = start_peer(sim, "receiver", "--host", sim.host("receiver").address)
        result = send(
            sim,
            "sender",
            *("--host", sim.host("sender").address, "--target", str(receiver["address"])),
            *("--size-mib", "32"),
        )
    goodput = result["goodput_mbit_s"][0]  # type: ignore[index]
    assert 0.80 * 100 <= goodput <= 1.05 * 100, result


@pytest.mark.netns
@pytest.mark.processes
@skip_without_netns
def test_nat_peers_talk_through_a_public_relay_and_detect_client_mode() -> None:
    hosts = [HostSpec("relay"), HostSpec("public"), HostSpec("alice", nat=True)]
    with NetSim([*hosts, HostSpec("bob", nat=True)]) as sim:
        relay = start_peer(sim, "relay", "--relay", "--host", sim.host("relay").address)
        relay_address = str(relay["address"])
        # alice only says "detect": the relay's dial-back hits her router, so she goes client mode
        alice = start_peer(sim, "alice", "--client-mode", "auto", "--initial-peer", relay_address)
        assert alice["client_mode"] is True
        assert "/p2p-circuit/" in str(alice["address"])
        # the control: the same detection on a public host keeps listening
        public = start_peer(
            sim, "public", "--client-mode", "auto", "--host", sim.host("public").address,
            "--initial-peer", relay_address,
        )  # fmt: skip
        assert public["client_mode"] is False
        # bob (NAT'd, client mode) reaches alice (NAT'd) through the relay; every byte checked
        result = send(
            sim,
            "bob",
            *("--client-mode", "true", "--initial-peer", relay_address),
            *("--target", str(alice["address"]), "--size-mib", "4"),
        )
    assert result["client_mode"] is True
    assert result["bytes"] == 4 * 2**20


@pytest.mark.netns
@pytest.mark.processes
@skip_without_netns
def test_kit_through_a_delay_proxy_between_namespaces() -> None:
    with NetSim([HostSpec("a"), HostSpec("b"), HostSpec("middle")]) as sim:
        receiver = start_peer(sim, "b", "--host", sim.host("b").address)
        parts = str(receiver["address"]).split("/")  # /ip4/HOST/tcp/PORT/ws/p2p/ID
        target = (parts[2], int(parts[4]))
        _, port = sim.start_delay_proxy("middle", target, delay=0.1)
        parts[2], parts[4] = sim.host("middle").address, str(port)
        result = send(sim, "a", "--host", sim.host("a").address, "--target", "/".join(parts),
                      "--size-mib", "1")  # fmt: skip
    # a tensor and its acknowledgement cross the proxy once each way: at least 2 x 0.1 s
    assert result["seconds"][0] >= 0.2, result  # type: ignore[index]
