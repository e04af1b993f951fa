"""The averaging protocols of one peer, routed to the averager of each stream's prefix.

Holds ``AveragingRouter``: one per peer, it serves the join (``kit/averaging/join/1``), invite
and all-reduce protocols and hands each incoming stream to the averager whose prefix the
stream's first message names, so that several averagers (gradients, parameters, a Moshpit grid)
share one peer and one handler per protocol. ``AveragerEndpoint`` is what it needs of an
averager (``kit.averaging.async_averager.AsyncAverager`` has it).

Separate from ``matchmaking_driver`` (one averager's search for a group) and from the averager
because it is per peer, not per averager: it owns the handlers, reads only each stream's first
message (bounded in size and time), and decides nothing about groups or rounds.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

from kit.averaging.chunk_stream import PROTOCOL as ALLREDUCE_PROTOCOL
from kit.averaging.declarations import Refusal
from kit.averaging.group import MAX_MESSAGE, decode_invite, decode_join_request, encode_answer
from kit.averaging.matchmaking_driver import INVITE_PROTOCOL, JOIN_PROTOCOL, MatchmakingDriver
from kit.errors import RemoteProtocolError
from kit.p2p import wire
from kit.p2p.api import PeerAPI, StreamAPI
from kit.p2p.identity import PeerID

MAX_INVITE = 16 * 1024  # bytes of an invitation (MAX_GONE peer ids and one declaration)
FIRST_MESSAGE_TIMEOUT = 10.0  # a stream's first message comes right after it opens


class AveragerEndpoint(Protocol):
    """What the router needs of an averager."""

    matchmaking: MatchmakingDriver

    async def serve_allreduce(self, stream: StreamAPI, header: dict[str, Any]) -> None: ...


class AveragingRouter:
    """Serves the averaging protocols of one peer for every averager on it (by prefix)."""

    _routers: weakref.WeakKeyDictionary[Any, AveragingRouter] = weakref.WeakKeyDictionary()

    def __init__(self, peer: PeerAPI) -> None:
        self.averagers: dict[str, AveragerEndpoint] = {}
        peer.add_stream_handler(JOIN_PROTOCOL, self._serve_join)
        peer.add_unary_handler(INVITE_PROTOCOL, self._serve_invite, max_request=MAX_INVITE)
        peer.add_stream_handler(ALLREDUCE_PROTOCOL, self._serve_allreduce)

    @classmethod
    def of(cls, peer: PeerAPI) -> AveragingRouter:
        """The router of ``peer`` (created, and its handlers registered, on first use)."""
        router = cls._routers.get(peer)
        if router is None:
            router = cls._routers[peer] = cls(peer)
        return router

    async def _serve_join(self, stream: StreamAPI) -> None:
        raw = await stream.receive_message(max_size=MAX_MESSAGE, timeout=FIRST_MESSAGE_TIMEOUT)
        if raw is None:
            return
        prefix, key, schema, member = decode_join_request(raw, stream.remote_peer)
        averager = self.averagers.get(prefix)
        if averager is None:
            await stream.send_message(encode_answer(Refusal("not_looking")), timeout=5.0)
            return
        await averager.matchmaking.serve_join(stream, key, schema, member)

    async def _serve_invite(self, caller: PeerID, payload: bytes) -> bytes:
        prefix, key, inviter, gone = decode_invite(payload, caller)
        averager = self.averagers.get(prefix)
        if averager is not None:
            averager.matchmaking.invited(key, inviter, gone)
        return b""

    async def _serve_allreduce(self, stream: StreamAPI) -> None:
        raw = await stream.receive_message(max_size=4096, timeout=FIRST_MESSAGE_TIMEOUT)
        if raw is None:
            return
        header = wire.decode_map(
            raw, "all-reduce stream header", {"prefix": str, "group_id": bytes}
        )
        averager = self.averagers.get(header["prefix"])
        if averager is None:
            raise RemoteProtocolError(f"no averager with prefix {header['prefix'][:64]!r} here")
        await averager.serve_allreduce(stream, header)
