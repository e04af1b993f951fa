"""Hole punching between two volunteers behind two NATs of their own (network namespaces).

Each NAT'd volunteer sits behind a home router of its own (``HostSpec.home_router``: its own
public address, masquerade keeping ports, unsolicited inbound dropped), both registered with a
public relay. One reaches the other through the relay; ``kit.p2p.hole_punch`` then upgrades the
relayed connection to a direct one (TCP simultaneous open through both NATs), and the tensor's
bytes no longer pass the relay: counted on the relay host's own interface. The control run,
with punching off, sends the same bytes through the relay.
"""

from __future__ import annotations

import subprocess
from typing import Any

import pytest

from kit.testing.netsim import HostSpec, NetSim
from tests.netsim.averaging_peer import run_rounds
from tests.netsim.skips import skip_without_netns
from tests.netsim.test_netsim import send, start_peer

MIB = 2**20


def interface_bytes(sim: NetSim, host: str) -> int:
    """Bytes received and sent by ``host``'s own interface (eth0), read from the kernel."""
    netns = sim.host(host).netns
    total = 0
    for direction in ("rx_bytes", "tx_bytes"):
        done = subprocess.run(
            ["ip", "netns", "exec", netns, "cat", f"/sys/class/net/eth0/statistics/{direction}"],
            capture_output=True,
            text=True,
            timeout=10.0,
        )
        total += int(done.stdout.strip())
    return total


def punch_scenario(*, punch: bool) -> tuple[dict[str, object], int]:
    hosts = [
        HostSpec("relay"),
        HostSpec("alice", nat=True, home_router=True),
        HostSpec("bob", nat=True, home_router=True),
    ]
    no_punch = () if punch else ("--no-punch",)
    with NetSim(hosts) as sim:
        relay = start_peer(sim, "relay", "--relay", "--host", sim.host("relay").address)
        relay_address = str(relay["address"])
        alice = start_peer(
            sim, "alice", "--client-mode", "true", "--initial-peer", relay_address, *no_punch
        )
        assert "/p2p-circuit/" in str(alice["address"])  # reachable through the relay only
        before = interface_bytes(sim, "relay")
        result = send(
            sim,
            "bob",
            *("--client-mode", "true", "--initial-peer", relay_address, *no_punch),
            *("--target", str(alice["address"]), "--size-mib", "16", "--wait-direct", "20"),
        )
        relayed = interface_bytes(sim, "relay") - before
    return result, relayed


@pytest.mark.netns
@pytest.mark.processes
@skip_without_netns
def test_hole_punch_takes_the_bytes_of_two_nat_peers_off_the_relay() -> None:
    result, relayed = punch_scenario(punch=True)
    assert result["client_mode"] is True and result["bytes"] == 16 * MIB
    assert result["direct"] is True, result
    assert result["punch"] == {"tried": 1, "reversed": 0, "punched": 1, "failed": 0}, result
    # The 17 MiB sent (16 + the 1 MiB warm-up) went around the relay: it saw the coordination
    # and the handshakes only.
    assert relayed < 1 * MIB, relayed


@pytest.mark.netns
@pytest.mark.processes
@skip_without_netns
def test_hole_punch_control_without_punching_every_byte_passes_the_relay() -> None:
    result, relayed = punch_scenario(punch=False)
    assert result["direct"] is False and result["bytes"] == 16 * MIB
    assert relayed > 2 * 17 * MIB  # in and out of the relay host


@pytest.mark.netns
@pytest.mark.processes
@skip_without_netns
def test_hole_punch_a_public_peer_has_a_nat_peer_dial_it_back() -> None:
    """Connection reversal: the relayed connection of a public peer (e.g. the coordinator's
    auxiliary peer) to a NAT'd one becomes a direct connection the NAT'd peer dials."""
    hosts = [HostSpec("relay"), HostSpec("server"), HostSpec("alice", nat=True, home_router=True)]
    with NetSim(hosts) as sim:
        relay = start_peer(sim, "relay", "--relay", "--host", sim.host("relay").address)
        relay_address = str(relay["address"])
        alice = start_peer(sim, "alice", "--client-mode", "true", "--initial-peer", relay_address)
        before = interface_bytes(sim, "relay")
        result = send(
            sim,
            "server",
            *("--host", sim.host("server").address, "--initial-peer", relay_address),
            *("--target", str(alice["address"]), "--size-mib", "16", "--wait-direct", "20"),
        )
        relayed = interface_bytes(sim, "relay") - before
    assert result["client_mode"] is False and result["direct"] is True, result
    assert result["punch"] == {"tried": 1, "reversed": 1, "punched": 0, "failed": 0}, result
    assert relayed < 1 * MIB, relayed


@pytest.mark.netns
@pytest.mark.processes
@pytest.mark.timeout(240)
@skip_without_netns
def test_hole_punch_lets_nat_peers_aggregate_and_the_average_stays_exact() -> None:
    """A public peer and three NAT'd ones, each behind a home router of its own, average 4 MB
    three times in one group. Others reach the NAT'd peers through the relay first and then
    directly (punched), so they lead and aggregate like the public peer: every peer gets a part
    of the vector to aggregate, not only the public one, and every round is exact."""
    hosts = [HostSpec("public")] + [
        HostSpec(name, nat=True, home_router=True) for name in ("alice", "bob", "carol")
    ]
    with NetSim(hosts) as sim:
        table = run_rounds(
            sim,
            [h.name for h in hosts],
            size_mb=4.0,
            rounds=3,
            client_mode=("alice", "bob", "carol"),
            timeout=200.0,
        )
    assert all(row["ok"] for row in table), table
    last = table[-1]
    assert last["client_mode"] == dict.fromkeys(("public", "alice", "bob", "carol"), False), last
    assert all(size > 0 for size in last["part_sizes"].values()), last["part_sizes"]


@pytest.mark.netns
@pytest.mark.processes
@pytest.mark.timeout(300)
@skip_without_netns
def test_hole_punch_fails_behind_a_symmetric_nat_and_that_peer_stops_aggregating() -> None:
    """Three volunteers behind ordinary home routers and one behind a symmetric NAT (a new
    public port per destination: the port a relay saw is not the one a punch leaves from). The
    punches to it fail and its traffic stays relayed, every round stays exact, and once three
    punches have failed (and none worked) it stops aggregating (``can_accept`` is False): the
    others no longer send it parts through relays."""
    names = ("alice", "bob", "carol")
    hosts = [
        HostSpec("public"),
        *(HostSpec(name, nat=True, home_router=True) for name in names),
        HostSpec("sym", nat=True, home_router=True, symmetric=True),
    ]
    finals: dict[str, Any] = {}
    with NetSim(hosts) as sim:
        table = run_rounds(
            sim,
            [h.name for h in hosts],
            size_mb=4.0,
            rounds=8,  # 6 left exactly 3 failed punches by the end, and none in time under load
            client_mode=(*names, "sym"),
            finals=finals,
            pause=1.5,  # each failed punch takes punch_seconds; the rounds go on meanwhile
            punch_seconds=3.0,  # (8 s by default) a punch through veths works in milliseconds
            timeout=260.0,
        )
    assert all(row["ok"] for row in table), table
    sym = finals["sym"]
    assert sym["can_accept"] is False and sym["punch"]["punched"] == 0, sym
    assert sym["punch"]["failed"] >= 3, finals
    last = table[-1]["part_sizes"]
    # The whole vector is aggregated by the others, punched NAT'd peers among them. Not
    # necessarily by the public peer too: it is also the relay, carrying sym's traffic, and
    # the LP may move its share to peers that measured faster (seen once: 0 in the last round).
    assert last["sym"] == 0 and sum(last.values()) == sum(table[0]["part_sizes"].values()), last
    assert any(last[name] > 0 for name in names), (last, finals)
