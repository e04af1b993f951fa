"""Blocking ``DecentralizedAverager`` facades on an in-process network, for hivemind-style tests.

``averagers(n, ...)`` starts ``n`` DHTs on one ``MemoryNetwork`` and a runtime of the test's own
(so a test's loop never mixes with kit's process-wide one), one averager on each, and stops
everything on exit. Used by ``test_control`` and ``test_state_sharing``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from kit.averaging.averager import DecentralizedAverager
from kit.dht import DHT
from kit.p2p.memory import MemoryNetwork
from kit.runtime import Runtime
from tests.conftest import MS
from tests.dht.swarm import FAST

FAST_AVERAGING = {
    "min_matchmaking_time": 0.3,
    "request_timeout": 300 * MS,
    "next_chunk_timeout": 1000 * MS,
    "part_size_bytes": 1024,
}


@contextlib.contextmanager
def averagers(
    n: int,
    *,
    clients: Sequence[int] = (),
    tensors: Callable[[int], list[torch.Tensor]] | None = None,
    cls: type[DecentralizedAverager] = DecentralizedAverager,
    **options: Any,
) -> Iterator[list[DecentralizedAverager]]:
    """``n`` averagers with prefix "test"; ``clients``: their DHT peers are in client mode."""
    network, runtime = MemoryNetwork(), Runtime("facade-test")
    dhts: list[DHT] = []
    started: list[DecentralizedAverager] = []
    try:
        for i in range(n):
            initial = dhts[0].get_visible_addresses() if dhts else []
            dhts.append(
                DHT(
                    initial,
                    peer_factory=network.create_peer,
                    config=FAST,
                    runtime=runtime,
                    client_mode=i in clients,
                )
            )
        for i, dht in enumerate(dhts):
            values = tensors(i) if tensors is not None else [torch.full((100,), float(i))]
            started.append(cls(values, dht, prefix="test", **{**FAST_AVERAGING, **options}))
        yield started
    finally:
        for averager in started:
            averager.shutdown()
        for dht in reversed(dhts):
            dht.shutdown()
        runtime.shutdown()
