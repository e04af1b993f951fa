"""Connections on real sockets: the memory budget (peers that send what nobody reads, and peers
that do not), and a reader whose socket dies under it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import pytest

from kit.errors import KitTimeout, StreamReset
from kit.p2p.api import StreamAPI
from kit.p2p.identity import PeerID
from kit.p2p.options import MuxLimits
from kit.p2p.peer import Peer, create_peer
from kit.p2p.wire import ResetCode

pytestmark = pytest.mark.sockets

MIB = 2**20
CHUNK = b"\1" * MIB
SMALL = MuxLimits(receive_window=MIB, connection_buffer=4 * MIB)  # the victim's, to be quick
SMALL_BUDGET = 6 * MIB
HELD = 3.0  # how long a flooding stream waits for credit that never comes


@contextlib.asynccontextmanager
async def started(*options: dict[str, object]) -> AsyncIterator[list[Peer]]:
    peers: list[Peer] = []
    try:
        for kwargs in options:
            initial = peers[0].get_visible_addresses() if peers else ()
            peers.append(await create_peer(initial, run_id="test", **kwargs))  # type: ignore[arg-type]
        yield peers
    finally:
        for peer in peers:
            await peer.shutdown()


async def never_reads(stream: StreamAPI) -> None:
    await asyncio.sleep(60)  # a slow handler, or one awaiting something else: reads nothing


async def counts(stream: StreamAPI) -> None:
    """Reads everything, then answers how many bytes it read."""
    total = 0
    while (message := await stream.receive_message(max_size=MIB, timeout=30)) is not None:
        total += len(message)
    await stream.send_message(str(total).encode(), timeout=10)


async def sends(stream: StreamAPI) -> None:
    """Sends as many MiB as asked (a donor of a state download)."""
    request = await stream.receive_message(max_size=16, timeout=10)
    assert request is not None
    for _ in range(int(request)):
        await stream.send_message(CHUNK, timeout=30)


async def echo(caller: PeerID, request: bytes) -> bytes:
    return request


def serve(peer: Peer) -> None:
    peer.add_stream_handler("sink", never_reads)
    peer.add_stream_handler("count", counts)
    peer.add_stream_handler("source", sends)
    peer.add_unary_handler("echo", echo)


async def upload(peer: Peer, to: PeerID, mebibytes: int) -> int:
    """Stream ``mebibytes`` to ``to``'s counter; the count it read."""
    stream = await peer.open_stream(to, "count", timeout=10)
    for _ in range(mebibytes):
        await stream.send_message(CHUNK, timeout=30)
    await stream.close()
    answer = await stream.receive_message(timeout=30)
    assert answer is not None
    return int(answer)


async def download(peer: Peer, donor: PeerID, mebibytes: int) -> int:
    stream = await peer.open_stream(donor, "source", timeout=10)
    await stream.send_message(str(mebibytes).encode(), timeout=10)
    await stream.close()
    total = 0
    while (message := await stream.receive_message(max_size=MIB, timeout=30)) is not None:
        total += len(message)
    return total // MIB


async def flood(peer: Peer, to: PeerID, streams: int) -> list[str]:
    """Open ``streams`` streams to a handler that never reads and send 3 MiB on each at once;
    how each ended: a reset code, "held" (blocked on credit), "" (sent it all: it must not)."""

    async def one() -> str:
        stream = await peer.open_stream(to, "sink", timeout=10)
        try:
            for _ in range(3):
                await stream.send_message(CHUNK, timeout=HELD)
        except StreamReset as e:
            return e.code
        except KitTimeout:
            return "held"  # not reset, but no credit either: its window stays full
        finally:
            stream.reset()
        return ""

    return list(await asyncio.gather(*(one() for _ in range(streams))))


async def test_a_flooding_peer_is_held_to_the_budgets_and_everyone_else_is_served(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two admitted peers open streams to a handler that never reads and fill them: the victim
    holds at most its budgets (4 MiB a connection, 6 MiB in all, instead of 2 x 16 x 1 MiB),
    resets their fullest streams with code "memory", and meanwhile serves an honest peer,
    reads a stream of one attacker, and downloads from the other."""
    victim_options = {"limits": SMALL, "buffer_budget": SMALL_BUDGET}
    async with started(victim_options, {}, {}, {}) as (victim, attacker, other, honest):
        for peer in (victim, attacker, other, honest):
            serve(peer)
        caplog.set_level(logging.WARNING, logger="kit.p2p.connection")

        async def honest_traffic() -> tuple[list[bytes], int]:
            answers = []
            for i in range(20):
                answers.append(await honest.call(victim.peer_id, "echo", b"%d" % i, timeout=10))
            return answers, await upload(honest, victim.peer_id, 24)

        floods = asyncio.gather(
            flood(attacker, victim.peer_id, 16), flood(other, victim.peer_id, 16)
        )
        results = await asyncio.wait_for(
            asyncio.gather(
                floods,
                honest_traffic(),
                upload(attacker, victim.peer_id, 16),  # the victim reads this one
                download(victim, other.peer_id, 16),  # and this one, its own
            ),
            timeout=90,
        )
        (flooded, from_other), (answers, honest_count), attacker_count, downloaded = results
        assert answers == [b"%d" % i for i in range(20)]
        assert (honest_count, attacker_count, downloaded) == (24 * MIB, 16 * MIB, 16)
        codes = flooded + from_other
        assert "" not in codes  # nobody got 3 MiB into a stream that is never read
        assert set(codes) <= {ResetCode.MEMORY.value, ResetCode.REFUSED.value, "held"}
        assert ResetCode.MEMORY.value in codes
        assert victim.buffer_ledger.peak <= SMALL_BUDGET
        assert victim.buffer_ledger.total <= SMALL_BUDGET
        for peer in (attacker, other):
            connection = victim.connection(peer.peer_id)
            assert (
                connection is not None
                and connection.mux.buffers.buffered <= SMALL.connection_buffer
            )
        warned = [r.getMessage() for r in caplog.records if "for memory" in r.getMessage()]
        assert any(attacker.peer_id.short() in message for message in warned)
        # the handlers of reset streams were cancelled: nothing of theirs is left running
        connection = victim.connection(attacker.peer_id)
        assert connection is not None and len(connection._handler_tasks) <= 1


async def test_heavy_traffic_that_is_read_is_never_reset() -> None:
    """Default budgets: four 32 MiB uploads at once on one connection and two 32 MiB downloads
    from two donors, all read as they come, complete with no stream reset for memory."""
    async with started({}, {}, {}) as (receiver, sender, donor):
        for peer in (receiver, sender, donor):
            serve(peer)
        uploads = [upload(sender, receiver.peer_id, 32) for _ in range(4)]
        downloads = [download(receiver, peer.peer_id, 32) for peer in (sender, donor)]
        results = await asyncio.wait_for(asyncio.gather(*uploads, *downloads), timeout=90)
        assert results == [32 * MIB] * 4 + [32, 32]
        for peer in (sender, donor):
            connection = receiver.connection(peer.peer_id)
            assert connection is not None and connection.mux.shed_count == 0
        assert receiver.buffer_ledger.peak <= 6 * 8 * MIB  # at most a window per stream


async def test_a_reader_keeps_what_arrived_when_the_socket_dies_under_its_credit() -> None:
    """The transport is closing but the connection has not heard yet: the credit a read returns
    cannot go out (``send_now`` raises). The read still returns what had arrived, reset never
    raises, and the connection closes."""
    outcome: list[object] = []
    done = asyncio.Event()

    async def handler(stream: StreamAPI) -> None:
        try:
            await asyncio.sleep(0.5)  # the whole message is buffered in the stream by now
            connection = stream.connection  # type: ignore[attr-defined]
            connection.channel._transport.abort()  # the socket dies; its loss is not seen yet
            message = await stream.receive_message(max_size=4 * MIB, timeout=5)
            outcome.append(len(message) if message is not None else None)
            stream.reset()  # never raises, even now
            outcome.append(connection.closed)
        except Exception as e:  # the test reports it
            outcome.append(e)
        finally:
            done.set()

    async with started({}, {}) as (a, b):
        b.add_stream_handler("credit", handler)  # type: ignore[arg-type]
        stream = await a.open_stream(b.peer_id, "credit", timeout=10)
        await stream.send_message(b"\2" * (3 * MIB), timeout=10)  # past a quarter window: credit
        await asyncio.wait_for(done.wait(), 10)
        assert outcome == [3 * MIB, True]
