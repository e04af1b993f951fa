"""Relays: public peers carry connections for client-mode peers that cannot accept any.

Most volunteers (Colab, Kaggle, home PCs behind NAT) cannot be dialed. A client-mode peer keeps
an outbound connection to one or more relays and registers there; others reach it at a relayed
address ``<relay address>/p2p-circuit/p2p/<client id>``::

    A ──CONNECT{target: C}──► relay R ──INCOMING{source: A}──► C     (two ordinary streams)
    A ◄══════ handshake + multiplexed streams, end to end ══════► C     (R only copies messages)

The relayed pair runs the full handshake through the circuit, so the relay can neither read the
identities wrong nor impersonate either side (it can drop or delay traffic, as any router can).
A relay enforces per-peer limits (concurrent circuits, bytes per circuit, bytes per second) so
one volunteer cannot use up its bandwidth, and budgets the memory circuits make it hold (below).
If a relay dies, the client registers with another
relay from its list (failover) and its relayed addresses change accordingly.

Memory. A circuit's forwarder takes a message from one side and waits for the other side's
credit; meanwhile the source may fill its stream's window (8 MiB) at the relay, with no reader
waiting. Charged like any stream, eight such circuits of one client (a volunteer in a group of
32 has 31) exceed ``MuxLimits.connection_buffer`` (64 MiB) and a legitimate circuit would be
reset mid-all-reduce. So circuit streams are charged to budgets of their own, as libp2p's
resource manager gives the relay service its own scope (``libp2p.relay/v2``) beside the
connection scopes, and circuit relay v2 bounds circuits per peer and what each may carry:
what a peer's circuits hold unread here counts against ``RelayLimits.peer_buffer`` (256 MiB,
32 windows, bounded anyway by ``max_circuits_per_peer`` x window), all circuits against
``RelayLimits.buffer_budget`` (2 GiB); over either, the circuit holding the most is reset with
code ``memory``, so a client that floods circuits to destinations that never read loses its
own circuits, and the peer's own streams and budgets (``PeerOptions.buffer_budget``) are not
touched. Not charged: one message in the forwarder's hand and what waits in the writer for a
destination's credit, each at most what that destination granted (a window).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from typing import Any, Protocol

from kit.address import Address, parse_address
from kit.errors import ConnectionLost, KitTimeout, PeerError, PeerUnavailable, RemoteProtocolError
from kit.p2p import wire
from kit.p2p.budget import BufferLedger
from kit.p2p.channel import WEBSOCKET_MAX_SIZE
from kit.p2p.connection import Channel
from kit.p2p.identity import PeerID
from kit.p2p.options import PeerOptions, RelayLimits
from kit.p2p.stream import Message, Stream, message_parts
from kit.p2p.wire import ResetCode

logger = logging.getLogger(__name__)

REGISTER = "kit/relay/register/1"
CONNECT = "kit/relay/connect/1"
INCOMING = "kit/relay/incoming/1"
CONTROL_MAX = 4096


class RelayHost(Protocol):
    """What relaying needs of the peer it runs on (``kit.p2p.peer.Peer`` has it)."""

    peer_id: PeerID
    options: PeerOptions

    def get_visible_addresses(self) -> list[str]: ...

    def add_stream_handler(self, protocol: str, handler: Any) -> None: ...

    async def connect(self, address: str | Address, *, timeout: float) -> PeerID: ...

    async def open_stream(self, peer_id: PeerID, protocol: str, *, timeout: float) -> Stream: ...

    async def accept_channel(self, channel: Channel) -> None: ...

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]: ...


class TokenBucket:
    """Bytes-per-second budget (pure: takes ``now``). ``delay(n, now)`` says how long to wait."""

    def __init__(self, rate: float, burst: int, now: float) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = float(burst)
        self.updated = now

    def delay(self, size: int, now: float) -> float:
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        self.tokens -= size
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate


class StreamChannel:
    """A relay stream as a :class:`~kit.p2p.connection.Channel` for an end-to-end connection."""

    def __init__(self, stream: Stream, description: str) -> None:
        self._stream = stream
        self.remote_address = description
        self.remote_host: str | None = None

    async def send(self, data: Message) -> None:
        try:
            await self._stream.send_message(message_parts(data))
        except (PeerError, KitTimeout) as e:
            raise ConnectionLost(f"relayed channel {self.remote_address}: {e}") from None

    async def recv(self) -> bytes:
        try:
            parts = await self._stream.receive_message_parts(max_size=WEBSOCKET_MAX_SIZE)
        except (PeerError, KitTimeout) as e:
            raise ConnectionLost(f"relayed channel {self.remote_address}: {e}") from None
        if parts is None:
            raise ConnectionLost(f"relayed channel {self.remote_address} closed")
        return parts[0] if len(parts) == 1 else b"".join(parts)  # type: ignore[return-value]

    async def close(self) -> None:
        self._stream.reset(ResetCode.CANCELLED, "relayed connection closed")


async def _control(stream: Stream, timeout: float) -> dict[str, object]:
    data = await stream.receive_message(max_size=CONTROL_MAX, timeout=timeout)
    if data is None:
        raise RemoteProtocolError(f"{stream.protocol}: closed before answering")
    body = wire.unpackb(data, stream.protocol)
    if not isinstance(body, dict):
        raise RemoteProtocolError(f"{stream.protocol}: expected a map")
    return body


async def open_relayed_channel(peer: RelayHost, address: Address, timeout: float) -> StreamChannel:
    """Ask the relay in ``address`` for a circuit to ``address.peer_id``."""
    relay_address, target = address.relay, address.peer_id
    if relay_address is None or target is None:
        raise PeerUnavailable(f"{address} is not a relayed address")
    relay_id = await peer.connect(relay_address, timeout=timeout)
    stream = await peer.open_stream(relay_id, CONNECT, timeout=timeout)
    try:
        await stream.send_message(wire.packb({"target": target.to_bytes()}), timeout=timeout)
        answer = await _control(stream, timeout)
    except BaseException:
        stream.reset(ResetCode.CANCELLED, "circuit setup failed")
        raise
    if answer.get("ok") is not True:
        stream.reset(ResetCode.CANCELLED, "circuit refused")
        raise PeerUnavailable(
            f"relay {relay_id.short()} refused a circuit to {target.short()}: {answer.get('error')}"
        )
    return StreamChannel(stream, f"{target.short()} via relay {relay_id.short()}")


class RelayService:
    """The relay side: registrations of client-mode peers and the circuits to them."""

    def __init__(
        self, peer: RelayHost, limits: RelayLimits | None = None, setup_timeout: float = 10.0
    ) -> None:
        self.peer = peer
        self.limits = limits or RelayLimits()
        self.setup_timeout = setup_timeout
        self._registered: dict[PeerID, Stream] = {}
        self._circuits: dict[PeerID, int] = {}
        self._buckets: dict[PeerID, TokenBucket] = {}
        self.relayed_bytes = 0
        # Unread bytes of the circuits relayed here, per connection: see "Memory" above.
        self.buffer_ledger: BufferLedger[Any] = BufferLedger(self.limits.buffer_budget)
        peer.add_stream_handler(REGISTER, self._serve_register)  # type: ignore[arg-type]
        peer.add_stream_handler(CONNECT, self._serve_connect)  # type: ignore[arg-type]

    def is_registered(self, peer_id: PeerID) -> bool:
        return peer_id in self._registered

    async def _serve_register(self, stream: Stream) -> None:
        client = stream.remote_peer
        if len(self._registered) >= self.limits.max_clients and client not in self._registered:
            await stream.send_message(wire.packb({"ok": False, "error": "relay full"}))
            return
        self._registered[client] = stream
        addresses = self.peer.get_visible_addresses()
        answer: dict[str, object] = {"ok": True, "addresses": addresses}
        observed = observed_endpoint(stream)
        if observed is not None:  # where the client's NAT shows it (kit.p2p.hole_punch)
            answer["observed"] = [observed[0], observed[1]]
        await stream.send_message(wire.packb(answer))
        logger.info("relaying for %s", client.short())
        try:
            # The registration lasts as long as this stream: the client holds it open.
            while await stream.receive_message(max_size=CONTROL_MAX) is not None:
                pass
        except (PeerError, KitTimeout):
            pass
        finally:
            if self._registered.get(client) is stream:
                del self._registered[client]
                logger.info("%s unregistered", client.short())

    async def _serve_connect(self, stream: Stream) -> None:
        source = stream.remote_peer
        request = await _control(stream, self.setup_timeout)
        raw_target = request.get("target")
        if not isinstance(raw_target, bytes) or len(raw_target) != PeerID.SIZE:
            raise RemoteProtocolError("CONNECT without a valid target")
        target = PeerID(raw_target)
        error = None
        if target not in self._registered:
            error = f"{target} is not registered at this relay"
        elif (
            max(self._circuits.get(source, 0), self._circuits.get(target, 0))
            >= self.limits.max_circuits_per_peer
        ):
            error = f"circuit limit of {self.limits.max_circuits_per_peer} per peer reached"
        if error is not None:
            await stream.send_message(wire.packb({"ok": False, "error": error}))
            return
        outbound = await self.peer.open_stream(target, INCOMING, timeout=self.setup_timeout)
        for peer_id in (source, target):
            self._circuits[peer_id] = self._circuits.get(peer_id, 0) + 1
        try:
            await outbound.send_message(
                wire.packb({"source": source.to_bytes()}), timeout=self.setup_timeout
            )
            answer = await _control(outbound, self.setup_timeout)
            if answer.get("ok") is not True:
                await stream.send_message(wire.packb({"ok": False, "error": "target refused"}))
                return
            for end in (stream, outbound):
                end.connection.mux.mark_circuit(
                    end.stream_id, self.buffer_ledger, self.limits.peer_buffer
                )
            await stream.send_message(wire.packb({"ok": True}), timeout=self.setup_timeout)
            await self._pipe(stream, outbound)
        finally:
            outbound.reset(ResetCode.CANCELLED, "circuit closed")
            for peer_id in (source, target):
                self._circuits[peer_id] -= 1
                if not self._circuits[peer_id]:
                    del self._circuits[peer_id]

    async def _pipe(self, a: Stream, b: Stream) -> None:
        budget = [self.limits.max_bytes_per_circuit]

        async def forward(src: Stream, dst: Stream) -> None:
            while True:
                # Forwarded as the frame payloads it arrived in: the relay copies nothing.
                parts = await src.receive_message_parts(max_size=WEBSOCKET_MAX_SIZE)
                if parts is None:
                    await dst.close()
                    return
                size = sum(len(part) for part in parts)
                await self._throttle(src.remote_peer, size)
                if budget[0] is not None:
                    budget[0] -= size
                    if budget[0] < 0:
                        raise RemoteProtocolError("circuit byte limit reached")
                self.relayed_bytes += size
                await dst.send_message(tuple(parts))

        tasks = [asyncio.ensure_future(forward(a, b)), asyncio.ensure_future(forward(b, a))]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for task in tasks:
                task.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
        errors = [
            r
            for r in results
            if isinstance(r, Exception) and not isinstance(r, asyncio.CancelledError)
        ]
        if errors:
            a.reset(ResetCode.CANCELLED, str(errors[0]))
            b.reset(ResetCode.CANCELLED, str(errors[0]))

    async def _throttle(self, peer_id: PeerID, size: int) -> None:
        rate = self.limits.peer_bytes_per_second
        if rate is None:
            return
        now = time.monotonic()
        bucket = self._buckets.get(peer_id)
        if bucket is None:
            bucket = self._buckets[peer_id] = TokenBucket(rate, self.limits.peer_burst_bytes, now)
        delay = bucket.delay(size, now)
        if delay > 0:
            await asyncio.sleep(delay)


def observed_endpoint(stream: Stream) -> tuple[str, int] | None:
    """The IP address and port the remote end of ``stream``'s connection is seen at here (its
    NAT's public side, for a peer behind one); None for a relayed or unknown connection."""
    channel = getattr(stream.connection, "channel", None)
    host = getattr(channel, "remote_host", None)
    described = getattr(channel, "remote_address", "")
    if not isinstance(host, str) or not isinstance(described, str):
        return None
    _, _, port = described.rpartition(":")
    return (host, int(port)) if port.isdigit() and 0 < int(port) < 65536 else None


class RelayClient:
    """The client-mode side: registrations with relays, failover, and incoming circuits."""

    def __init__(
        self, peer: RelayHost, relays: list[str], *, wanted: int = 2, retry_interval: float = 2.0
    ) -> None:
        self.peer = peer
        self.relays = [parse_address(r) for r in relays]
        self.wanted = wanted  # registrations kept at once: one spare for failover
        self.retry_interval = retry_interval
        self._registrations: dict[PeerID, tuple[Address, Stream]] = {}
        # Where relays see our connections come from (our NAT's public side), newest first.
        self.observed: list[tuple[str, int]] = []
        self._changed = asyncio.Event()
        self._supervisor: asyncio.Task[Any] | None = None
        peer.add_stream_handler(INCOMING, self._serve_incoming)  # type: ignore[arg-type]

    def relayed_addresses(self) -> list[Address]:
        return [
            address.relayed_to(self.peer.peer_id) for address, _ in self._registrations.values()
        ]

    async def start(self) -> None:
        if not self.relays:
            raise PeerUnavailable(
                "client mode needs at least one relay - help: pass initial_peers (public peers relay "
                "for you) or relays=[...]"
            )
        await self._register_missing()
        if not self._registrations:
            raise PeerUnavailable(
                f"no relay accepted this peer ({', '.join(map(str, self.relays))}) - help: check the "
                "initial peers' addresses and that they run with relay_service=True"
            )
        self._supervisor = self.peer.spawn(self._supervise(), "relay-supervisor")

    async def stop(self) -> None:
        if self._supervisor is not None:
            self._supervisor.cancel()
        for _, stream in self._registrations.values():
            stream.reset(ResetCode.SHUTDOWN, "client shutting down")
        self._registrations.clear()

    async def _supervise(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), self.retry_interval)
            self._changed.clear()
            if len(self._registrations) < self.wanted:
                try:
                    await self._register_missing()
                except Exception:  # a bug must not end failover for good: log it and go on
                    logger.exception("registering with relays failed")

    async def _register_missing(self) -> None:
        timeout = self.peer.options.dial_timeout
        for address in self.relays:
            if len(self._registrations) >= self.wanted:
                return
            if address.peer_id is not None and address.peer_id in self._registrations:
                continue
            try:
                relay_id = await self.peer.connect(address, timeout=timeout)
                if relay_id in self._registrations:
                    continue
                stream = await self.peer.open_stream(relay_id, REGISTER, timeout=timeout)
                await stream.send_message(wire.packb({"v": 1}), timeout=timeout)
                answer = await _control(stream, timeout)
            except (PeerError, KitTimeout) as e:
                logger.debug("relay %s unavailable: %s", address, e)
                continue
            if answer.get("ok") is not True:
                logger.info("relay %s refused registration: %s", address, answer.get("error"))
                stream.reset(ResetCode.CANCELLED, "refused")
                continue
            self._registrations[relay_id] = (address.with_peer_id(relay_id), stream)
            self._note_observed(answer.get("observed"))
            self.peer.spawn(self._watch(relay_id, stream), f"relay-{relay_id.short()}")
            logger.info("%s reachable via relay %s", self.peer.peer_id.short(), relay_id.short())

    def _note_observed(self, value: object) -> None:
        if (
            isinstance(value, list)
            and len(value) == 2
            and isinstance(value[0], str)
            and len(value[0]) <= 64
            and isinstance(value[1], int)
            and 0 < value[1] < 65536
        ):
            endpoint = (value[0], value[1])
            self.observed = [endpoint] + [e for e in self.observed if e != endpoint][:3]

    async def _watch(self, relay_id: PeerID, stream: Stream) -> None:
        try:
            while await stream.receive_message(max_size=CONTROL_MAX) is not None:
                pass
        except (PeerError, KitTimeout):
            pass
        finally:
            if self._registrations.get(relay_id, (None, None))[1] is stream:
                del self._registrations[relay_id]
                logger.warning("lost relay %s; registering with another one", relay_id.short())
            self._changed.set()

    async def _serve_incoming(self, stream: Stream) -> None:
        if stream.remote_peer not in self._registrations:
            raise RemoteProtocolError("INCOMING from a peer that is not our relay")
        request = await _control(stream, self.peer.options.handshake_timeout)
        raw_source = request.get("source")
        if not isinstance(raw_source, bytes) or len(raw_source) != PeerID.SIZE:
            raise RemoteProtocolError("INCOMING without a valid source")
        await stream.send_message(wire.packb({"ok": True}))
        channel = StreamChannel(
            stream, f"{PeerID(raw_source).short()} via relay {stream.remote_peer.short()}"
        )
        await self.peer.accept_channel(channel)
