"""State sharing between averagers (hivemind's ``load_state_from_peers``), checked on receipt.

Donors by priority, a donor switched off, a custom ``get_current_state`` with msgpack metadata
and integer tensors, nobody sharing, metadata that cannot travel without pickle, and a donor
whose bytes do not match its digest (skipped for the next one).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import torch

from kit.averaging.averager import DecentralizedAverager
from kit.averaging.state_sharing import (
    PROTOCOL,
    StateSharing,
    load_state,
    tensor_bytes,
    tensor_header,
)
from kit.dht.node import get_dht_time
from kit.errors import ConfigError
from kit.p2p import wire
from kit.p2p.api import StreamAPI
from kit.p2p.memory import MemoryNetwork
from kit.p2p.tensors import send_tensor
from tests.averaging.facades import averagers
from tests.conftest import MS
from tests.dht.swarm import Swarm


def marked(i: int) -> list[torch.Tensor]:
    return [torch.randn(3), torch.full((1,), float(i))]


def wait_until(condition: Any, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_the_state_comes_from_the_highest_priority_donor_that_shares() -> None:
    with averagers(4, tensors=marked) as group:
        group[1].allow_state_sharing = False
        for i, averager in enumerate(group):
            averager.state_sharing_priority = 5 - abs(2 - i)  # 3, 4 (not sharing), 5, 4
        time.sleep(0.3)  # the declarations reach the DHT
        metadata, tensors = group[0].load_state_from_peers(timeout=5)  # type: ignore[misc]
        assert tensors[-1].item() == 2 and metadata == {"group_key": ""}
        _, tensors = group[2].load_state_from_peers(timeout=5)  # type: ignore[misc]
        assert tensors[-1].item() == 3  # peer 1 ranks as high, but does not share
        group[0].state_sharing_priority = 10
        time.sleep(0.3)
        _, tensors = group[2].load_state_from_peers(timeout=5)  # type: ignore[misc]
        assert tensors[-1].item() == 0
        group[0].allow_state_sharing = False  # refused at once, even before the DHT knows
        group[3].allow_state_sharing = False
        assert group[2].load_state_from_peers(timeout=5) is None


def test_a_custom_state_travels_with_msgpack_metadata_and_any_dtype() -> None:
    calls: list[int] = []
    state = {"epoch": 7, "lr": 0.5, "names": ["a", "b"]}
    shared = [torch.randn(3), torch.randint(0, 5, (4,)), torch.tensor([True, False])]

    class CustomState(DecentralizedAverager):
        def get_current_state(self) -> tuple[Any, list[torch.Tensor]]:
            calls.append(1)
            return state, shared

    with averagers(2, cls=CustomState) as (donor, loader):
        time.sleep(0.3)
        assert calls == []  # nothing is computed before someone asks
        got = loader.load_state_from_peers(timeout=5)
        assert got is not None and len(calls) == 1
        metadata, tensors = got  # type: ignore[misc]
        assert metadata == state
        assert [t.dtype for t in tensors] == [torch.float32, torch.int64, torch.bool]
        assert all(torch.equal(a, b) for a, b in zip(tensors, shared, strict=True))
        future = loader.load_state_from_peers(wait=False)
        assert future.result(5)[0] == state and len(calls) == 2  # type: ignore[union-attr]


def test_nobody_sharing_gives_none_at_once() -> None:
    with averagers(2, clients=(1,)) as (auxiliary_free, client):
        assert not client.allow_state_sharing  # hivemind's default for client-mode peers
        with pytest.raises(ConfigError, match="help:"):
            client.allow_state_sharing = True
        auxiliary_free.allow_state_sharing = False
        time.sleep(0.2)
        started = time.monotonic()
        assert client.load_state_from_peers() is None
        assert time.monotonic() - started < 2.0


def test_metadata_that_needs_pickle_is_not_shared(caplog: pytest.LogCaptureFixture) -> None:
    class Unpicklable(DecentralizedAverager):
        def get_current_state(self) -> tuple[Any, list[torch.Tensor]]:
            return {"optimizer": object()}, [torch.zeros(2)]

    with averagers(2, cls=Unpicklable) as (donor, loader):
        time.sleep(0.3)
        assert loader.load_state_from_peers(timeout=5) is None
        wait_until(lambda: "not plain msgpack data" in caplog.text)


async def test_a_donor_whose_bytes_do_not_match_is_skipped_for_the_next() -> None:
    network = MemoryNetwork()
    async with Swarm(network.create_peer) as swarm:
        honest, liar, loader = [await swarm.add_node() for _ in range(3)]
        good = [torch.arange(4, dtype=torch.float32)]
        sharing = StateSharing(
            honest,
            "run",
            lambda: ({"from": "honest"}, good),
            allow=True,
            priority=1.0,
            declare_period=30.0,
            answer_timeout=2.0,
        )
        sharing.start()

        asked: list[bool] = []

        async def lie(stream: StreamAPI) -> None:  # claims one state, sends other bytes
            asked.append(True)
            await stream.receive_message(max_size=1024, timeout=1.0)
            header = {
                "code": "state",
                "metadata": {"from": "liar"},
                "tensors": [tensor_header(good[0]).to_dict()],
                "sha256": bytes(32),
            }
            await stream.send_message(wire.packb(header), timeout=1.0)
            await send_tensor(stream, tensor_header(good[0]), tensor_bytes(good[0] + 1))

        liar.peer.add_stream_handler(PROTOCOL, lie)
        await liar.store(
            "run.all_averagers", 99.0, get_dht_time() + 30, subkey=liar.peer_id.to_bytes()
        )
        await asyncio.sleep(200 * MS)
        state = await load_state(loader, "run", answer_timeout=2.0)
        assert state is not None
        metadata, tensors = state
        assert asked and metadata == {"from": "honest"} and torch.equal(tensors[0], good[0])
        await sharing.shutdown()
