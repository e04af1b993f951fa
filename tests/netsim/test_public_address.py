"""A coordinator on a server with a public IP, listening on every interface with nothing
announced (the config notebook's default), seen from a volunteer behind a NAT.

The server namespace has a private address on the simulated Internet's LAN and a global one
(``HostSpec.global_address``, as a cloud server's public IP on its interface). ``kit
coordinator`` must hand out the global address (never 0.0.0.0), its start-up check must dial
it, and a NAT'd volunteer's ``kit preflight`` of the printed link must pass. A server with
private addresses only refuses to start and says what to set.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kit.demo import prepare
from kit.testing.netns import read_line
from kit.testing.netsim import HostSpec, NetSim
from tests.netsim.skips import skip_without_netns

GLOBAL_ADDRESS = "11.231.0.10"  # is_global: what a cloud server's public IP looks like
PORT = 8765


def coordinator_command(root: Path, state: str) -> list[str]:
    return [
        sys.executable,
        *("-m", "kit", "coordinator", "--config", str(root / "run.yaml")),
        *("--port", str(PORT), "--state-dir", str(root / state)),
        *("--tokenizer-dir", str(root / "demo_tokenizer"), "--shard-tokens", "4000"),
        "--no-auxiliary",
    ]


@pytest.mark.netns
@pytest.mark.processes
@skip_without_netns
def test_a_coordinator_on_every_interface_hands_out_its_public_address(tmp_path: Path) -> None:
    prepare(tmp_path, documents=300)
    hosts = [
        HostSpec("server", global_address=GLOBAL_ADDRESS),
        HostSpec("lan-server"),
        HostSpec("volunteer", nat=True),
    ]
    with NetSim(hosts) as sim:
        # Private addresses only: refused before anything starts, with what to set.
        refused = sim.run("lan-server", coordinator_command(tmp_path, "lan"), timeout=120.0)
        assert refused.returncode == 1, refused.stdout + refused.stderr[-2000:]
        assert "no public address to hand out" in refused.stderr
        assert (
            "10.231.0.11 (private)" in refused.stderr and "help: pass --announce" in refused.stderr
        )
        assert not (tmp_path / "lan").exists() and refused.stdout == ""

        server = sim.popen("server", coordinator_command(tmp_path, "state"))
        line = read_line(server, timeout=240.0)
        assert line == f"join link: http://{GLOBAL_ADDRESS}:{PORT}", line
        probe = (
            "import json, sys, urllib.request\n"
            "opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))\n"
            "print(opener.open(sys.argv[1], timeout=20).read().decode())\n"
        )
        fetched = sim.run(
            "volunteer",
            [sys.executable, "-c", probe, f"http://{GLOBAL_ADDRESS}:{PORT}/api/run"],
            timeout=60.0,
        )
        assert fetched.returncode == 0, fetched.stderr[-2000:]
        peers = json.loads(fetched.stdout)["initial_peers"]
        assert peers and all(
            p.startswith(f"/ip4/{GLOBAL_ADDRESS}/tcp/{PORT}/ws/p2p/") for p in peers
        )
        # The volunteer, behind its NAT, walks the whole path from the printed link.
        checked = sim.run(
            "volunteer",
            [sys.executable, "-m", "kit", "preflight", f"http://{GLOBAL_ADDRESS}:{PORT}"],
            timeout=240.0,
        )
        assert checked.returncode == 0, checked.stdout + checked.stderr[-2000:]
        assert "ok   peers: 1 of 1 peer address(es) answer" in checked.stdout
        assert "preflight passed" in checked.stdout
