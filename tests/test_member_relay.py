"""Member relays in an allowlisted run (``kit dht --join URL --hf-token``, ``kit.member_relay``):
an allowlisted user's machine joins as a relay, the coordinator's ``/api/run`` hands it out
(``kit.relay_directory``), a NAT'd volunteer registers with it, and a key ban takes it off the
list. A stranger's token, or none, starts nothing."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kit.address import parse_address
from kit.coordinator import Coordinator, CoordinatorOptions
from kit.p2p.identity import Identity, b58decode
from kit.relay_directory import (
    MAX_ADDRESSES_PER_RELAY,
    relay_addresses,
    relay_record,
    relay_records,
)
from kit.testing.fake_hub import FakeHub
from kit.testing.netns import read_line
from kit.volunteer import fetch_run_info
from tests.test_coordinator import allowlisted_run, free_port, hub, wait_for  # noqa: F401

pytestmark = [pytest.mark.sockets, pytest.mark.processes]

PEER_ID = "/p2p/" + str(Identity.generate().peer_id)


def relay_command(url: str, *token: str) -> list[str]:
    return [
        sys.executable,
        *("-m", "kit", "dht", "--join", url, *token),
        *("--host", "127.0.0.1", "--port", "0"),
    ]


def environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "HF_TOKEN" and "proxy" not in k.lower()}


def test_relay_records_list_dialable_direct_addresses_only() -> None:
    good = f"/ip4/11.2.3.4/tcp/31337/ws{PEER_ID}"
    loopback = f"/ip4/127.0.0.1/tcp/1/ws{PEER_ID}"
    assert relay_record([good, loopback]) == {"addresses": [good]}
    assert relay_record([good, loopback], local=True) == {"addresses": [good, loopback]}
    assert relay_record(["/ip4/0.0.0.0/tcp/1/ws" + PEER_ID, "/ip4/11.2.3.4/tcp/1/ws"]) is None
    relayed = f"{good}/p2p-circuit{PEER_ID}"
    assert relay_record([relayed]) is None
    many = [f"/ip4/11.2.3.{n}/tcp/1/ws{PEER_ID}" for n in range(10)]
    assert relay_record(many) == {"addresses": many[:MAX_ADDRESSES_PER_RELAY]}
    assert relay_records({b"no owner marker": object()}) == []
    assert relay_records("garbage") == []
    records = [(b"a" * 32, [good]), (b"b" * 32, [good, loopback])]
    assert relay_addresses(records) == [good, loopback]  # each once
    assert relay_addresses(records, banned_keys={b"a" * 32}) == [good, loopback]
    assert relay_addresses(records, banned_keys={b"b" * 32}) == [good]


@pytest.mark.timeout(300)
def test_a_member_relays_for_natd_volunteers_and_a_ban_takes_it_off_the_list(
    tmp_path: Path,
    hub: FakeHub,  # noqa: F811 (the fixture of tests.test_coordinator)
) -> None:
    from kit.auth import authorizer_from_coordinator
    from kit.dht import DHT
    from kit.runtime import get_runtime

    hub.add_user("carol", token="hf_carol")  # not on the allowlist
    port = free_port()
    config = allowlisted_run(tmp_path, port)
    config = dataclasses.replace(
        config,
        access=dataclasses.replace(config.access, usernames=("alice", "bob")),
        checkpoint=dataclasses.replace(config.checkpoint, hub_repo=None),
    )
    options = CoordinatorOptions(
        host="127.0.0.1",
        port=port,
        state_dir=str(tmp_path / "coordinator"),
        tokenizer_dir=str(tmp_path / "demo_tokenizer"),
        hf_endpoint=hub.endpoint,
        auxiliary_peer=False,
        preflight=False,
        metrics_period=1.0,
    )
    with Coordinator(config, options) as coordinator:
        url = coordinator.join_url
        # No token, a stranger's token: a clear error each, exit 1, nothing running.
        for token, reason in (((), "pass --hf-token"), (("--hf-token", "hf_carol"), "allowlist")):
            refused = subprocess.run(
                relay_command(url, *token),
                capture_output=True,
                text=True,
                timeout=120,
                env=environment(),
            )
            assert refused.returncode == 1, refused.stdout + refused.stderr
            assert "not started" in refused.stderr and reason in refused.stderr, refused.stderr
            assert refused.stdout == ""
        relay = subprocess.Popen(
            relay_command(url, "--hf-token", "hf_alice"),
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            env=environment(),
        )
        volunteer = None
        try:
            assert "joined run" in read_line(relay, timeout=120.0)
            key = read_line(relay, timeout=10.0).rsplit(" ", 1)[-1]
            assert read_line(relay, timeout=10.0).startswith("The coordinator hands it out")
            address = read_line(relay, timeout=10.0)
            assert parse_address(address).port > 0

            def listed() -> list[str]:
                return list(fetch_run_info(url).relays)

            wait_for(lambda: address in listed(), 60, "the member relay in /api/run")
            info = fetch_run_info(url)
            assert info.relays[0] == address and address in info.initial_peers
            # A NAT'd volunteer (bob) registers with the member relay first.
            identity = Identity.generate()
            authorizer = get_runtime().call(
                authorizer_from_coordinator(
                    url, "hf_bob", identity, authority_public_key=info.authority_public_key
                ),
                timeout=60.0,
            )
            volunteer = DHT(
                initial_peers=list(info.initial_peers),
                client_mode=True,
                peer_options=dict(
                    identity=identity,
                    run_id=config.collaboration.run_id,
                    config_hash=info.config_hash,
                    authorizer=authorizer,
                    relays=info.relays,
                ),
            )
            relay_id = parse_address(address).peer_id
            assert any(
                parse_address(a).relay.peer_id == relay_id  # type: ignore[union-attr]
                for a in volunteer.get_visible_addresses()
            ), volunteer.get_visible_addresses()
            # A key ban: off the list at the next read.
            coordinator.revoke(peer_public_keys=[b58decode(key)], duration=600.0)
            wait_for(lambda: address not in listed(), 30, "the banned relay off /api/run")
        finally:
            if volunteer is not None:
                volunteer.shutdown()
            relay.terminate()
            relay.wait(timeout=30)
