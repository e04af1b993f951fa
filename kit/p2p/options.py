"""How a peer listens, dials, relays and limits its peers: :class:`PeerOptions`, with the limits
of each connection (:class:`MuxLimits`, enforced by ``kit.p2p.mux``) and of relaying
(:class:`RelayLimits`).

Pass the fields as keywords of ``kit.p2p.peer.create_peer``. Every field has a working default;
the comments say when to change one.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field

from kit.address import AddressError
from kit.errors import ConfigError
from kit.p2p.interfaces import announced_address


@dataclass(frozen=True)
class MuxLimits:
    """Per-connection limits; defaults suit tensor traffic on 2-core machines."""

    receive_window: int = (
        8 * 1024**2
    )  # unconsumed bytes one stream may buffer here; raise for fast, far links
    max_frame: int = (
        4 * 1024**2 + 16 * 1024
    )  # largest DATA payload: an all-reduce chunk of 4 MiB and its header
    max_inbound_streams: int = 256  # concurrent streams the remote side may open
    max_refused: int = 256  # refused stream openings in a row before the peer is dropped
    connection_buffer: int = 64 * 2**20  # unread bytes per connection; raise if "reset for memory"

    def __post_init__(self) -> None:
        if self.connection_buffer < self.receive_window:
            raise ConfigError(
                f"MuxLimits.connection_buffer ({self.connection_buffer}) is smaller than "
                f"receive_window ({self.receive_window}): one stream could never use its "
                "window. help: raise connection_buffer (default 64 MiB) or lower receive_window"
            )


@dataclass(frozen=True)
class RelayLimits:
    """What one relay grants each client-mode peer. Lower them on a small coordinator box."""

    max_clients: int = 1024  # registered client-mode peers at once
    max_circuits_per_peer: int = 64  # concurrent relayed connections to or from one peer
    max_bytes_per_circuit: int | None = (
        None  # reset a circuit after this many bytes (None = no cap)
    )
    peer_bytes_per_second: float | None = None  # sustained relay bandwidth per peer (None = no cap)
    peer_burst_bytes: int = 64 * 1024**2  # bytes a peer may send at once above its rate
    peer_buffer: int = 256 * 2**20  # unread circuit bytes from one peer (fits 31 windows of 8 MiB)
    buffer_budget: int = 2 * 2**30  # unread circuit bytes of all peers; raise if "reset for memory"


@dataclass(frozen=True)
class PeerOptions:
    """How a peer listens, dials and limits its peers. Every field has a working default."""

    run_id: str = "kit"  # peers of other runs are refused at the handshake
    config_hash: str = (
        ""  # hash of the run config; peers with another one are refused ("" = no check)
    )
    host: str = "127.0.0.1"  # where to listen; "0.0.0.0" = every interface (public peers)
    port: int = 0  # 0 = any free port
    announce: tuple[str, ...] = ()  # what others dial, if not where it listens; bare host: + port
    client_mode: bool | None = False  # True = no listening socket (NAT); None = detect by dial-back
    relay_service: bool = False  # relay streams for client-mode peers (public peers, coordinators)
    relays: tuple[
        str, ...
    ] = ()  # relays a client-mode peer registers with (default: initial peers)
    relay_limits: RelayLimits = field(default_factory=RelayLimits)  # what a relay grants each peer
    tls_certfile: str | None = None  # serve wss:// with this certificate chain (PEM)
    tls_keyfile: str | None = None  # ... and this private key (PEM)
    client_ssl: ssl.SSLContext | None = (
        None  # for dialing wss://; None = system CAs, verification on
    )
    limits: MuxLimits = field(default_factory=MuxLimits)  # per-connection stream and flow limits
    buffer_budget: int = 512 * 2**20  # unread bytes, all connections; raise if "reset for memory"
    handshake_timeout: float = 10.0  # increase if you see handshake timeouts on slow links
    dial_timeout: float = 10.0  # TCP + websocket opening; increase on very slow links
    keepalive_interval: float = (
        20.0  # websocket pings; a dead peer is noticed after interval+timeout
    )
    keepalive_timeout: float = 20.0
    request_timeout: float = 30.0  # how long a unary handler may wait for the caller's request
    idle_timeout: float = 300.0  # close connections without streams for this long (0 = never)
    frame_auth: bool = False  # MAC every frame (on by itself with a private-run authorizer)
    fast_framing: bool = True  # kit's own zero-copy websocket framing after the upgrade (2x faster)
    plain_frames: bool = True  # unmasked frames between kit peers; False if a proxy parses frames
    hole_punching: bool = True  # upgrade relayed connections to direct ones (kit.p2p.hole_punch)

    def __post_init__(self) -> None:
        if self.buffer_budget < self.limits.connection_buffer:
            raise ConfigError(
                f"PeerOptions.buffer_budget ({self.buffer_budget}) is smaller than "
                f"limits.connection_buffer ({self.limits.connection_buffer}): one connection "
                "could never use its budget. help: raise buffer_budget (default 512 MiB)"
            )
        relay = self.relay_limits
        if not self.limits.receive_window <= relay.peer_buffer <= relay.buffer_budget:
            raise ConfigError(
                f"RelayLimits.peer_buffer ({relay.peer_buffer}) must lie between "
                f"limits.receive_window ({self.limits.receive_window}) and "
                f"RelayLimits.buffer_budget ({relay.buffer_budget}). help: raise buffer_budget "
                "(default 2 GiB) or peer_buffer (default 256 MiB)"
            )
        for text in self.announce:  # a typo fails here, before any socket opens
            try:
                announced_address(text, self.port or 1, False)
            except AddressError as e:
                raise ConfigError(f"PeerOptions.announce: {e}") from None
