"""Plain-TCP references for ``allreduce.py``, run by the same peer processes right after kit's round.

Two references, both over one plain TCP connection per pair of peers, made once, on an asyncio loop
of their own (the loop kit uses: uvloop when installed), receivers reading straight into their
final buffers (``asyncio.BufferedProtocol``):

- ``copy_round`` (``vs_tcp_bound``): every peer sends every other peer the bytes of kit's round,
  all at once: no framing, no reduction, no codec, no waiting for a part's sum before its average
  goes back. The time the wire and the kernel need, and nothing else.
- ``butterfly_round`` (``vs_tcp_butterfly``): the least a correct butterfly all-reduce
  (DeDLOC's, Diskin et al. 2021, §3.2) does on top of that: encode the parts, sum each part's
  contributions chunk by chunk as they arrive (pipelined), send each chunk's average back as soon
  as it is summed, decode the averages into the tensor. No protocol at all: no headers, no
  validation, no failure handling, no matchmaking. What remains between it and ``copy_round`` is
  the arithmetic and memory traffic any all-reduce must do on this machine.
- ``butterfly_round(deltas=True)``: with a lossy codec, what the round sends back is each sender's
  own rounded difference between the average and what it sent, added to its exact values
  (hivemind's scheme, kit's ``lossy_deltas``): one encoding per sender instead of one shared, a
  sum into the tensor instead of a copy. The least a butterfly with that result does, so that
  kit's rounds with ``--lossy-deltas true`` meet a floor that computes what they compute.
- ``butterfly_round(safe=True)`` (``vs_tcp_safe_butterfly``): the same, plus the passes a round
  that cannot be poisoned or half-applied needs (kit's guarantees): every part checked for
  NaN/inf before it is sent, every contribution before it is summed, every average before it is
  used, and the averages staged and written into the tensor only once all of them arrived and
  passed (all or nothing). Still no headers, no framing, no failure handling.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the launcher imports this module too, and has no use for torch
    import torch

#: Wire bytes per float32 element of each codec the butterfly reference implements.
WIRE_BYTES_PER_ELEMENT = {
    "none": 4,
    "fp16": 2,
    "scaledfp16": 2,
    "uniform8bit": 1,
    "quantile8bit": 1,
    "blockwise8bit": 1,
}
BUTTERFLY_WIRE_DTYPES = {"none": "float32", "fp16": "float16"}  # codecs the butterfly implements
REDUCE_CHUNK = 2**18  # elements summed and sent back at once: 1 MB of float32


def _write_json(path: str, value: Any) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(value, f)
    os.replace(path + ".tmp", path)


def _wait_for(path: str, timeout: float, what: str) -> None:
    give_up = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > give_up:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.002)


class _Inbox(asyncio.BufferedProtocol):
    """One connection's receiving side: fills a list of buffers, one after the other."""

    def __init__(self, mesh: TcpMesh) -> None:
        self.mesh = mesh
        self.hello = bytearray(4)  # the dialer's index comes first
        self.segments: list[memoryview] = [memoryview(self.hello)]
        self.segment, self.filled, self.received = 0, 0, 0
        self.spare = bytearray(64)
        self.on_data: Callable[[], None] | None = None
        self.done: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def expect(
        self, segments: list[memoryview], on_data: Callable[[], None] | None = None
    ) -> asyncio.Future[None]:
        self.segments, self.segment, self.filled, self.received = segments, 0, 0, 0
        self.on_data = on_data
        self.done = asyncio.get_running_loop().create_future()
        return self.done

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.segment == len(self.segments):  # nothing expected now: never an empty buffer
            return memoryview(self.spare)
        return self.segments[self.segment][self.filled :]

    def buffer_updated(self, nbytes: int) -> None:
        if self.segment == len(self.segments):
            raise ConnectionError(f"{nbytes} bytes arrived outside a round")
        self.filled += nbytes
        self.received += nbytes
        if self.filled == len(self.segments[self.segment]):
            self.segment, self.filled = self.segment + 1, 0
        if self.segments[0].obj is self.hello:
            if self.segment == 1:
                self.mesh.accepted(int.from_bytes(self.hello, "big"), self)
            return
        if self.on_data is not None:
            self.on_data()
        if self.segment == len(self.segments) and self.done is not None and not self.done.done():
            self.done.set_result(None)


class TcpMesh:
    """One plain TCP connection between every pair of peer processes, and the two references."""

    def __init__(self, run_dir: str, index: int, n: int, host: str, timeout: float) -> None:
        from kit.runtime import Runtime

        self.runtime = Runtime("tcp-bound")  # a loop of its own: kit's stays idle meanwhile
        self.run_dir, self.index, self.n, self.host = run_dir, index, n, host
        self.inboxes: dict[int, _Inbox] = {}
        self._armed: list[asyncio.Future[None]] = []
        self._butterfly: _Butterfly | None = None
        self.runtime.call(self._connect(timeout), timeout=timeout + 5)

    def accepted(self, peer: int, inbox: _Inbox) -> None:
        self.inboxes[peer] = inbox

    async def _connect(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: _Inbox(self), self.host, 0)
        port = server.sockets[0].getsockname()[1]
        _write_json(os.path.join(self.run_dir, f"tcp_{self.index}.json"), [self.host, port])
        for j in range(self.index):  # dial the lower indices; the higher ones dial us
            path = os.path.join(self.run_dir, f"tcp_{j}.json")
            await asyncio.to_thread(_wait_for, path, timeout, f"peer {j}'s TCP port")
            with open(path) as f:
                host, peer_port = json.load(f)
            transport, inbox = await loop.create_connection(lambda: _Inbox(self), host, peer_port)
            transport.write(self.index.to_bytes(4, "big"))
            inbox.segment = 1  # no hello from this side
            self.inboxes[j] = inbox
        give_up = loop.time() + timeout
        while len(self.inboxes) < self.n - 1 and loop.time() < give_up:
            await asyncio.sleep(0.005)
        server.close()  # (asyncio and uvloop set TCP_NODELAY themselves)

    # --- copy: the bytes of kit's round and nothing else -------------------------------------

    def arm_copy(self, inbox: dict[int, bytearray], timeout: float) -> None:
        """Where each peer's bytes go; call before the barrier that starts the round."""

        async def arm() -> list[asyncio.Future[None]]:
            return [self.inboxes[j].expect([memoryview(inbox[j])]) for j in self.inboxes]

        self._armed = self.runtime.call(arm(), timeout=timeout)

    def copy_round(self, payload: memoryview, timeout: float) -> None:
        """Send ``payload`` to every other peer and receive as much from each (all at once)."""

        async def exchange() -> None:
            for peer in self.inboxes.values():
                peer.transport.write(payload)  # type: ignore[attr-defined]
            await asyncio.gather(*self._armed)

        self.runtime.call(exchange(), timeout=timeout)

    # --- butterfly: the least a correct all-reduce does -------------------------------------

    def arm_butterfly(
        self,
        work: torch.Tensor,
        codec: str,
        timeout: float,
        *,
        safe: bool = False,
        deltas: bool = False,
    ) -> None:
        """Average ``work`` (flat float32, refilled by the caller) in the next butterfly round;
        ``safe``: with the checks and the all-or-nothing commit; ``deltas``: each sender gets
        its own rounded difference (a lossy codec only; see the module)."""
        self._butterfly = _Butterfly(self, work, codec, safe, deltas)
        self._armed = self.runtime.call(self._butterfly.arm(), timeout=timeout)

    def butterfly_round(self, timeout: float) -> None:
        assert self._butterfly is not None, "arm_butterfly first"
        butterfly = self._butterfly

        async def run() -> None:
            butterfly.send_parts()
            await asyncio.gather(*self._armed)
            butterfly.decode_averages()

        self.runtime.call(run(), timeout=timeout)

    def close(self) -> None:
        for inbox in self.inboxes.values():
            inbox.transport.close()
        self.runtime.shutdown()


class _Butterfly:
    """One round of a pipelined butterfly over the mesh: peer ``k`` reduces the ``k``-th part."""

    def __init__(
        self, mesh: TcpMesh, work: torch.Tensor, codec: str, safe: bool, deltas: bool
    ) -> None:
        import torch

        self.mesh, self.work, self.n, self.me = mesh, work, mesh.n, mesh.index
        self.safe = safe
        self.wire = getattr(torch, BUTTERFLY_WIRE_DTYPES[codec])
        self.deltas = deltas and self.wire != work.dtype  # (a lossless codec has none)
        numel = work.numel()
        self.bounds = [(k * numel // self.n, (k + 1) * numel // self.n) for k in range(self.n)]
        start, end = self.bounds[self.me]
        self.mine = work[start:end]
        self.contributions: dict[int, torch.Tensor] = {}
        self.averages: dict[int, torch.Tensor] = {}  # wire-typed landing buffers
        self.differences: dict[int, torch.Tensor] = {}  # deltas: what each sender gets back
        self.reduced = 0  # elements of my part summed and sent back
        self.parts_sent = False  # averages follow the parts on each connection, never precede

    async def arm(self) -> list[asyncio.Future[None]]:
        import torch

        futures = []
        for j, inbox in self.mesh.inboxes.items():
            contribution = torch.empty(self.mine.numel(), dtype=self.wire)
            start, end = self.bounds[j]
            if self.wire == self.work.dtype and not self.safe:  # they land in the tensor
                average = self.work[start:end]
            else:
                average = torch.empty(end - start, dtype=self.wire)
            self.contributions[j], self.averages[j] = contribution, average
            if self.deltas:
                self.differences[j] = torch.empty(self.mine.numel(), dtype=self.wire)
            segments = [_bytes_of(contribution), _bytes_of(average)]
            futures.append(inbox.expect(segments, self.reduce_ready))
        return futures

    def send_parts(self) -> None:
        for j, inbox in self.mesh.inboxes.items():
            start, end = self.bounds[j]
            part = self.work[start:end].to(self.wire)  # a view when nothing is encoded
            if self.safe and not is_finite(part):
                raise ValueError(f"part {j} holds NaN or inf: not sent")
            inbox.transport.write(_bytes_of(part))  # type: ignore[attr-defined]
        self.parts_sent = True
        self.reduce_ready()  # what arrived before this peer's parts went out

    def reduce_ready(self) -> None:
        """Sum and send back every whole chunk of my part that all contributors have sent."""
        if not self.parts_sent:
            return
        itemsize = self.wire.itemsize
        ready = min(
            (inbox.received // itemsize for inbox in self.mesh.inboxes.values()),
            default=self.mine.numel(),
        )
        ready = min(ready, self.mine.numel())
        while self.reduced < ready and (
            ready - self.reduced >= REDUCE_CHUNK or ready == self.mine.numel()
        ):
            start = self.reduced
            end = min(start + REDUCE_CHUNK, ready)
            total = self.mine[start:end]
            if self.safe and not is_finite(total):  # (ours: checked before it was sent)
                raise ValueError("our part holds NaN or inf")
            for contribution in self.contributions.values():
                if self.safe and not is_finite(contribution[start:end]):
                    continue  # a poisoned contribution is left out (kit drops that sender's)
                total.add_(contribution[start:end])
            total.mul_(1.0 / self.n)
            if self.deltas:  # rounded once, as kit does it (kit.averaging.widening)
                from kit.averaging.widening import subtract_narrowed

                for j, inbox in self.mesh.inboxes.items():
                    difference = self.differences[j][start:end]
                    subtract_narrowed(difference, total, self.contributions[j][start:end])
                    inbox.transport.write(_bytes_of(difference))  # type: ignore[attr-defined]
            else:
                back = _bytes_of(total.to(self.wire))
                for inbox in self.mesh.inboxes.values():
                    inbox.transport.write(back)  # type: ignore[attr-defined]
            self.reduced = end

    def decode_averages(self) -> None:
        if self.safe and not all(is_finite(average) for average in self.averages.values()):
            return  # nothing is written: the tensor keeps its values (all or nothing)
        for j, average in self.averages.items():
            start, end = self.bounds[j]
            if self.deltas:  # our exact values plus our difference to the average
                from kit.averaging.widening import add_widened

                add_widened(self.work[start:end], self.work[start:end], average)
            elif average.data_ptr() != self.work[start:end].data_ptr():
                self.work[start:end].copy_(average)


def is_finite(tensor: torch.Tensor) -> bool:
    """kit's check (one sum; element by element only when the sum is not finite)."""
    from kit.averaging.compression import is_finite as kit_is_finite

    return kit_is_finite(tensor)


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.numpy()).cast("B")
