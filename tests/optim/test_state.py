"""Training-state snapshots and their download from donors, good and bad (in-memory peers)."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
import torch

from kit.errors import StateDownloadFailed
from kit.optim.state import (
    Donor,
    StateServer,
    StateSnapshot,
    download_state,
    tensor_bytes,
    tensor_header,
)
from kit.p2p.api import StreamAPI
from kit.p2p.memory import MemoryNetwork
from kit.p2p.tensors import TensorHeader, send_tensor


class NoDHT:
    """Stands in for the DHT node: these tests hand the donors over directly."""

    def add_validators(self, validators: Any) -> None:
        pass


def training_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda e: 1 / (1 + e))
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    scheduler.step()
    return {
        "params": [p.detach() for p in model.parameters()],
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
    }


def test_snapshot_round_trip_and_digest() -> None:
    state = training_state()
    snapshot = StateSnapshot.capture(7, state)
    restored = snapshot.state()
    assert restored["scheduler"] == state["scheduler"]
    assert torch.equal(
        restored["optimizer"]["state"][0]["exp_avg"], state["optimizer"]["state"][0]["exp_avg"]
    )
    assert restored["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)  # tuples stay tuples
    assert snapshot.digest == StateSnapshot.capture(7, state).digest
    state["params"][0][0, 0] += 1
    assert snapshot.digest != StateSnapshot.capture(7, state).digest


class LyingServer(StateServer):
    """Announces the real metadata but serves a damaged tensor in the given way."""

    def __init__(self, *args: Any, damage: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.damage = damage

    async def _serve(self, stream: StreamAPI) -> None:
        snapshot = self.snapshot
        assert snapshot is not None
        while (raw := await stream.receive_message(timeout=10)) is not None:
            request = msgpack.unpackb(raw)
            if request.get("want") == "meta":
                await stream.send_message(msgpack.packb(snapshot.meta(), use_bin_type=True))
                continue
            for index in request["tensors"]:
                tensor = snapshot.tensors[index]
                if self.damage == "truncated":
                    return  # ends the stream before sending everything
                if self.damage == "wrong-shape":
                    wrong = torch.zeros(tensor.numel() + 1)
                    await send_tensor(stream, tensor_header(wrong), tensor_bytes(wrong))
                elif self.damage == "wrong-values":
                    await send_tensor(stream, tensor_header(tensor), tensor_bytes(tensor + 1))
                else:
                    await send_tensor(
                        stream, TensorHeader("float32", tuple(tensor.shape)), tensor_bytes(tensor)
                    )


@pytest.mark.parametrize("damage", ["truncated", "wrong-shape", "wrong-values"])
async def test_bad_donor_is_rejected_and_the_next_one_used(damage: str) -> None:
    network = MemoryNetwork()
    joiner = await network.create_peer()
    snapshot = StateSnapshot.capture(3, training_state())
    servers = []
    for kind in ("bad", "good"):
        peer = await network.create_peer()
        if kind == "bad":
            server: StateServer = LyingServer(peer, NoDHT(), "run", peer.identity, damage=damage)  # type: ignore[arg-type]
        else:
            server = StateServer(peer, NoDHT(), "run", peer.identity)  # type: ignore[arg-type]
        server.snapshot = snapshot
        joiner.add_address(peer.peer_id, peer.get_visible_addresses()[0])
        servers.append(server)
    donors = [Donor(server.peer.peer_id, 3) for server in servers]
    received = await download_state(joiner, donors, "run", timeout=20)
    assert received.digest == snapshot.digest and received.epoch == 3
    assert all(torch.equal(a, b) for a, b in zip(received.tensors, snapshot.tensors, strict=True))


async def test_only_bad_donors_fail_clearly() -> None:
    network = MemoryNetwork()
    joiner = await network.create_peer()
    peer = await network.create_peer()
    server = LyingServer(peer, NoDHT(), "run", peer.identity, damage="wrong-values")  # type: ignore[arg-type]
    server.snapshot = StateSnapshot.capture(1, training_state())
    joiner.add_address(peer.peer_id, peer.get_visible_addresses()[0])
    with pytest.raises(StateDownloadFailed, match="digest"):
        await download_state(joiner, [Donor(peer.peer_id, 1)], "run", timeout=10)
    with pytest.raises(StateDownloadFailed, match="help:"):
        await download_state(joiner, [], "run", timeout=1)


async def serve(network: MemoryNetwork, joiner: Any, snapshot: StateSnapshot) -> Any:
    peer = await network.create_peer()
    server = StateServer(peer, NoDHT(), "run", peer.identity)  # type: ignore[arg-type]
    server.snapshot = snapshot
    joiner.add_address(peer.peer_id, peer.get_visible_addresses()[0])
    return peer.peer_id


async def test_in_sync_donors_are_preferred_and_ties_broken_the_same_everywhere() -> None:
    network = MemoryNetwork()
    joiner = await network.create_peer()
    state = training_state()
    ours = StateSnapshot.capture(5, state)  # what the peers of a full round hold
    state["params"][0] = state["params"][0] + 1
    own = StateSnapshot.capture(5, state)  # what a peer whose round failed holds
    drifted = [await serve(network, joiner, own) for _ in range(2)]
    in_sync = await serve(network, joiner, ours)
    donors = [Donor(p, 5, drifted=True) for p in drifted] + [Donor(in_sync, 5)]
    received = await download_state(joiner, donors, "run", timeout=20)
    assert received.digest == ours.digest  # not the majority of the drifted ones
    # Only drifted donors: still served. Two in-sync halves disagreeing: every joiner picks
    # the same (the smallest digest), whichever answers first.
    received = await download_state(joiner, donors[:2], "run", timeout=20)
    assert received.digest == own.digest
    halves = [Donor(in_sync, 5), Donor(drifted[0], 5)]
    for order in (halves, halves[::-1]):
        received = await download_state(joiner, order, "run", timeout=20)
        assert received.digest == min(str(ours.digest), str(own.digest))


async def test_a_snapshot_replaced_while_it_is_hashed_is_still_served() -> None:
    """Epochs can be shorter than hashing a state: the donor publishes a new snapshot while it
    computes the digest a joiner asked for; the joiner's download of that digest must work."""
    network = MemoryNetwork()
    joiner = await network.create_peer()
    peer = await network.create_peer()
    server = StateServer(peer, NoDHT(), "run", peer.identity)  # type: ignore[arg-type]
    asked = StateSnapshot.capture(4, training_state(), digest=False)
    newer_state = training_state()
    newer_state["params"][0] = newer_state["params"][0] * 2
    newer = StateSnapshot.capture(5, newer_state, digest=False)
    hash_it = asked.ensure_digest

    def publish_meanwhile() -> str:
        server.snapshot = newer  # what publish() does, from the training thread
        return hash_it()

    asked.ensure_digest = publish_meanwhile  # type: ignore[method-assign]
    server.snapshot = asked
    joiner.add_address(peer.peer_id, peer.get_visible_addresses()[0])
    received = await download_state(joiner, [Donor(peer.peer_id, 4)], "run", timeout=10)
    assert received.epoch == 4 and received.digest == asked.digest
    assert all(torch.equal(a, b) for a, b in zip(received.tensors, asked.tensors, strict=True))
