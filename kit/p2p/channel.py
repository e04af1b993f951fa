"""The async handshake driver, the authorizer hook, and the size of a channel's messages.

Two kinds of channel carry kit frames: a websocket (``kit.p2p.transport``, the only place kit
touches ``websockets``) and a stream relayed through a third peer (``kit.p2p.relay``). The
handshake driver below runs the pure cores of ``kit.p2p.handshake`` over either.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import Protocol, runtime_checkable

from kit.errors import (
    AuthError,
    BadSignature,
    HandshakeRefused,
    KitTimeout,
    RemoteProtocolError,
)
from kit.p2p import wire
from kit.p2p.connection import Channel
from kit.p2p.frame_auth import TAG_SIZE
from kit.p2p.handshake import (
    DialerHandshake,
    HandshakeSettings,
    ListenerHandshake,
    RemoteHello,
    SessionKeys,
    refusal_frame,
)
from kit.p2p.identity import Identity, PeerID
from kit.p2p.stream import wait_bounded
from kit.p2p.wire import Refusal

logger = logging.getLogger(__name__)

#: The largest websocket message any kit peer may send: a DATA frame of the largest
#: ``max_frame`` a hello may announce, plus its header, with room to spare (relayed frames).
WEBSOCKET_MAX_SIZE = 16 * 1024**2 + 4096


def websocket_max_size(max_frame: int) -> int:
    """The largest websocket message a peer that announced ``max_frame`` accepts: one DATA frame
    of ``max_frame`` bytes (or a control frame), its header and its authentication tag.

    Peers never send DATA frames larger than the receiver announced, so anything larger is
    refused at the websocket header (close code 1009) before a byte of it is buffered: a
    hostile peer cannot make this peer hold 16 MiB per connection with one frame header.
    """
    return max(max_frame, wire.MAX_CONTROL_PAYLOAD) + wire.HEADER_SIZE + TAG_SIZE


#: The hello feature that offers unmasked websocket frames after the handshake
#: (``kit.p2p.websocket`` says why); used when both hellos carry it.
PLAIN_FRAMES = "plain-frames"


@runtime_checkable
class PlainFraming(Protocol):
    """A channel that can drop RFC 6455 masking once both ends agreed (kit's websocket)."""

    plain_possible: bool  # nothing on the path parses frames, and the peer's options allow it

    def accept_plain(self) -> None: ...

    def send_plain(self) -> None: ...


def _offer_plain(channel: Channel, settings: HandshakeSettings) -> HandshakeSettings:
    if isinstance(channel, PlainFraming) and channel.plain_possible:
        return dataclasses.replace(settings, features=(*settings.features, PLAIN_FRAMES))
    return settings


def _plain_agreed(channel: Channel, remote: RemoteHello) -> PlainFraming | None:
    if isinstance(channel, PlainFraming) and channel.plain_possible:
        return channel if PLAIN_FRAMES in remote.features else None
    return None


class Authorizer(Protocol):
    """Decides who may connect. ``kit.auth`` provides the allowlist authorizer; default: open.

    An authorizer with a true ``private`` attribute also turns on frame authentication
    (``kit.p2p.frame_auth``) for every connection it admits. One with an ``attach(peer)``
    method gets it called when the peer starts (``kit.auth`` starts its session guard there,
    which re-checks established connections), and ``kit.dht`` calls ``follow_dht(node)`` when
    the peer's DHT node starts.
    """

    async def credentials(self) -> bytes:
        """What this peer presents in its hello (e.g. a signed access token)."""
        ...

    async def authorize(self, remote: RemoteHello) -> None:
        """Raise an AuthError subclass to refuse ``remote`` (its key possession is verified)."""
        ...


class OpenAuthorizer:
    """Lets every peer of the same run in (public runs)."""

    private = False  # authorizers of private runs set this: every frame is then authenticated

    async def credentials(self) -> bytes:
        return b""

    async def authorize(self, remote: RemoteHello) -> None:
        return None


async def _recv_frame(channel: Channel, timeout: float) -> wire.Frame:
    try:
        data = await asyncio.wait_for(channel.recv(), timeout)
    except asyncio.TimeoutError:
        raise KitTimeout(
            f"handshake with {channel.remote_address}: no answer within {timeout} s"
        ) from None
    return wire.decode_frame(data, 0)


async def refuse(channel: Channel, error: HandshakeRefused) -> None:
    """Tell the remote side why its handshake is refused (bounded in time), then close."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(channel.send(refusal_frame(error)), 1.0)
    await channel.close()


async def _authorize(channel: Channel, authorizer: Authorizer, remote: RemoteHello) -> None:
    try:
        await authorizer.authorize(remote)
    except AuthError as e:
        refusal = HandshakeRefused(Refusal.AUTH.value, f"{remote.peer_id} is not authorized: {e}")
        await refuse(channel, refusal)
        raise refusal from e


@contextlib.asynccontextmanager
async def _refusing_on_error(channel: Channel) -> AsyncIterator[None]:
    """Tell the remote side why a handshake failed (GOAWAY), then close the channel."""
    try:
        yield
    except HandshakeRefused as e:
        if e.reason != Refusal.AUTH.value:  # _authorize already sent its own refusal
            await refuse(channel, e)
        raise
    except (RemoteProtocolError, BadSignature) as e:
        await refuse(channel, HandshakeRefused(Refusal.PROTOCOL.value, str(e)))
        raise
    except BaseException:
        await channel.close()
        raise


async def _settings(
    channel: Channel, authorizer: Authorizer, settings: HandshakeSettings, timeout: float
) -> HandshakeSettings:
    """What this side's hello says: ``settings`` with the authorizer's credentials, and the
    offer of plain frames when the channel can drop masking."""
    credentials = await wait_bounded(authorizer.credentials(), timeout, "getting an access token")
    return dataclasses.replace(_offer_plain(channel, settings), credentials=credentials)


async def dial_handshake(
    channel: Channel,
    identity: Identity,
    settings: HandshakeSettings,
    authorizer: Authorizer,
    *,
    expected_peer: PeerID | None,
    timeout: float,
) -> tuple[RemoteHello, SessionKeys]:
    """Run the dialer's side of the handshake; returns the verified remote hello and session keys."""
    async with _refusing_on_error(channel):
        handshake = DialerHandshake(
            identity, await _settings(channel, authorizer, settings, timeout), expected_peer
        )
        await channel.send(handshake.hello())
        remote, auth = handshake.receive_hello(await _recv_frame(channel, timeout))
        await _authorize(channel, authorizer, remote)
        await channel.send(auth)
        handshake.receive_welcome(await _recv_frame(channel, timeout))
        plain = _plain_agreed(channel, remote)
        if plain is not None:  # the listener takes unmasked frames since its hello
            plain.send_plain()
    assert handshake.session_keys is not None  # set by receive_hello
    return remote, handshake.session_keys


async def accept_handshake(
    channel: Channel,
    identity: Identity,
    settings: HandshakeSettings,
    authorizer: Authorizer,
    *,
    timeout: float,
) -> tuple[RemoteHello, SessionKeys]:
    """Run the listener's side of the handshake; returns the verified remote hello and session keys."""
    async with _refusing_on_error(channel):
        handshake = ListenerHandshake(
            identity, await _settings(channel, authorizer, settings, timeout)
        )
        remote, hello = handshake.receive_hello(await _recv_frame(channel, timeout))
        await _authorize(channel, authorizer, remote)
        plain = _plain_agreed(channel, remote)
        if plain is not None:  # before our hello: the dialer goes plain after our WELCOME
            plain.accept_plain()
        await channel.send(hello)
        await channel.send(handshake.receive_auth(await _recv_frame(channel, timeout)))
    assert handshake.session_keys is not None  # set by receive_auth
    return remote, handshake.session_keys
