"""How a channel becomes a connection: the handshake a peer runs on each channel it dials or
accepts, and what it does with the outcome.

Holds :func:`handshake_settings` (what this peer offers: run id, config hash, features, receive
window, a max frame kept under a relay's inside a circuit, frame MACs in private runs),
:func:`dial_over` and :func:`accept_over` (one side's handshake, then the channel wrapped in
frame MACs, ``frame_auth``, when either side asked for them) and :func:`admit` (the listener's
side on its own port: a stranger's failed handshake costs one log line and nothing else, and a
reachability probe is answered, then hung up).

Separate from ``peer`` (the registry of connections and handlers) because it is what happens
before a connection exists: per channel, with nothing of the peer's but its identity, options
and authorizer. The handshake's messages and checks are ``handshake`` (pure) and ``channel``
(their driver); this module chooses the settings and decides what a result admits.
"""

from __future__ import annotations

import logging

from kit.errors import HandshakeRefused, KitTimeout, PeerError, Revoked
from kit.p2p.channel import Authorizer, accept_handshake, dial_handshake
from kit.p2p.connection import Channel
from kit.p2p.frame_auth import AuthenticatedChannel
from kit.p2p.handshake import HandshakeSettings, RemoteHello
from kit.p2p.identity import Identity, PeerID
from kit.p2p.options import PeerOptions

logger = logging.getLogger(__name__)

RELAY_FRAME_MARGIN = 64
#: A hello with this feature is a reachability probe: the listener answers the handshake, then
#: hangs up without keeping the connection (see kit.p2p.reachability).
PROBE_FEATURE = "probe"


def handshake_settings(
    options: PeerOptions, authorizer: Authorizer, *, relayed: bool = False, probe: bool = False
) -> HandshakeSettings:
    """What a peer with ``options`` offers in its hello (``relayed``: inside a relay's circuit;
    ``probe``: a reachability probe that wants no connection)."""
    features = ("relay",) if options.relay_service else ()
    max_frame = options.limits.max_frame
    if relayed:
        # A relayed frame travels inside one relay-stream message: keep it under the relay's
        # frame size so that each inner frame is one outer frame, not two.
        max_frame -= RELAY_FRAME_MARGIN
    return HandshakeSettings(
        run_id=options.run_id,
        config_hash=options.config_hash,
        features=features + (PROBE_FEATURE,) if probe else features,
        receive_window=options.limits.receive_window,
        max_frame=max_frame,
        frame_auth=options.frame_auth or bool(getattr(authorizer, "private", False)),
    )


async def dial_over(
    channel: Channel,
    identity: Identity,
    settings: HandshakeSettings,
    authorizer: Authorizer,
    *,
    expected_peer: PeerID | None,
    timeout: float,
) -> tuple[Channel, RemoteHello]:
    """The dialer's handshake on ``channel``; the channel to use (with frame MACs if either side
    asked) and the remote's hello.

    Raises:
        PeerError / AuthError / KitTimeout: as ``channel.dial_handshake``.
    """
    remote, keys = await dial_handshake(
        channel, identity, settings, authorizer, expected_peer=expected_peer, timeout=timeout
    )
    if settings.frame_auth or remote.frame_auth:
        channel = AuthenticatedChannel(channel, keys)
    return channel, remote


async def accept_over(
    channel: Channel,
    identity: Identity,
    settings: HandshakeSettings,
    authorizer: Authorizer,
    *,
    timeout: float,
) -> tuple[Channel, RemoteHello]:
    """The listener's handshake on ``channel``; the channel to use (with frame MACs if either
    side asked) and the remote's hello.

    Raises:
        HandshakeRefused / PeerError / KitTimeout: as ``channel.accept_handshake``.
    """
    remote, keys = await accept_handshake(channel, identity, settings, authorizer, timeout=timeout)
    if settings.frame_auth or remote.frame_auth:
        channel = AuthenticatedChannel(channel, keys)
    return channel, remote


async def admit(
    channel: Channel,
    identity: Identity,
    settings: HandshakeSettings,
    authorizer: Authorizer,
    *,
    timeout: float,
) -> tuple[Channel, RemoteHello] | None:
    """:func:`accept_over` on a channel our listening port accepted from anyone: None when it
    is not to become a connection (a failed handshake: logged; a probe: answered, closed)."""
    try:
        remote, keys = await accept_handshake(
            channel, identity, settings, authorizer, timeout=timeout
        )
    except (HandshakeRefused, PeerError, KitTimeout) as e:
        # Anyone can send garbage or half a handshake: one DEBUG line each, never more. A
        # banned user coming back holds a token signed by the authority: the organizer's news.
        level = logging.INFO if isinstance(e.__cause__, Revoked) else logging.DEBUG
        logger.log(level, "refused connection from %s: %s", channel.remote_address, e)
        return None
    except Exception as e:
        logger.debug(
            "handshake with %s failed: %s: %s", channel.remote_address, type(e).__name__, e
        )
        return None
    if PROBE_FEATURE in remote.features:
        await channel.close()  # a dial-back probe: it only wanted to see that we answer
        return None
    if settings.frame_auth or remote.frame_auth:
        channel = AuthenticatedChannel(channel, keys)
    return channel, remote
