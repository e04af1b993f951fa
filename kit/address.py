"""How peers are named and found: PeerIDs (base58) and addresses. Standard library only.

A PeerID is the SHA-256 of a peer's Ed25519 public key (``kit.p2p.identity`` holds the keys and
proves possession in the handshake), written in base58 like libp2p's and hivemind's.

Addresses are multiaddr-style strings (hivemind's ``get_visible_maddrs()`` shape) and URLs.

Accepted forms::

    /ip4/203.0.113.7/tcp/31337/ws/p2p/<peer id>          direct, plain websocket
    /dns/coord.example.org/tcp/443/wss/p2p/<peer id>     direct, TLS (e.g. behind a reverse proxy)
    /dns/example.org/tcp/443/wss/http-path/kit/p2p/<id>  with a URL path (proxy location)
    <relay address>/p2p-circuit/p2p/<peer id>            through a relay (client-mode peers)
    /ip4/1.2.3.4/tcp/31337/p2p/<id>                      hivemind form without /ws (ws assumed)
    ws://host:port  or  wss://host:port/path             URLs; the peer id is learned at dial time

The peer id part is optional when dialing: the handshake tells who answered, and when it is
given, a different answer is refused (a stale address never silently reaches another peer).

What this module does not do: keys and signatures (``kit.p2p.identity``), dialing (``kit.p2p``).
"""

from __future__ import annotations

import hashlib
import ipaddress
import urllib.parse
from dataclasses import dataclass

_B58_ALPHABET = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_B58_INDEX = {char: index for index, char in enumerate(_B58_ALPHABET)}


def b58encode(data: bytes) -> str:
    number = int.from_bytes(data, "big")
    out = []
    while number:
        number, remainder = divmod(number, 58)
        out.append(_B58_ALPHABET[remainder])
    leading_zeros = len(data) - len(data.lstrip(b"\0"))
    return "1" * leading_zeros + "".join(reversed(out))


def b58decode(text: str) -> bytes:
    number = 0
    for char in text:
        if char not in _B58_INDEX:
            raise ValueError(f"invalid base58 character {char!r}")
        number = number * 58 + _B58_INDEX[char]
    leading_ones = len(text) - len(text.lstrip("1"))
    body = number.to_bytes((number.bit_length() + 7) // 8, "big") if number else b""
    return b"\0" * leading_ones + body


class PeerID:
    """A peer's identity: SHA-256 of its Ed25519 public key (32 bytes), printed in base58."""

    __slots__ = ("_base58", "_bytes")
    SIZE = 32

    def __init__(self, raw: bytes) -> None:
        if not isinstance(raw, bytes) or len(raw) != self.SIZE:
            raise ValueError(f"a PeerID is {self.SIZE} bytes, got {raw!r:.60}")
        self._bytes = raw
        self._base58: str | None = None  # made once: every DHT reply prints our addresses

    @classmethod
    def from_public_key(cls, public_key: bytes) -> PeerID:
        return cls(hashlib.sha256(public_key).digest())

    @classmethod
    def from_base58(cls, text: str) -> PeerID:
        try:
            return cls(b58decode(text))
        except ValueError as e:
            raise ValueError(f"{text!r} is not a kit PeerID: {e}") from None

    def to_bytes(self) -> bytes:
        return self._bytes

    def to_base58(self) -> str:
        if self._base58 is None:
            self._base58 = b58encode(self._bytes)
        return self._base58

    def short(self) -> str:
        """A short form for logs: the last 6 base58 characters."""
        return "…" + self.to_base58()[-6:]

    def __bytes__(self) -> bytes:
        return self._bytes

    def __str__(self) -> str:
        return self.to_base58()

    def __repr__(self) -> str:
        return f"PeerID({self.to_base58()})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PeerID) and other._bytes == self._bytes

    def __lt__(self, other: PeerID) -> bool:
        return self._bytes < other._bytes

    def __hash__(self) -> int:
        return hash(self._bytes)


class AddressError(ValueError):
    """An address string that kit cannot parse (a usage error: the message shows valid forms)."""


@dataclass(frozen=True)
class Address:
    host: str
    port: int
    secure: bool = False  # wss:// (TLS) instead of ws://
    path: str = "/"  # URL path, for peers behind a reverse proxy
    peer_id: PeerID | None = None
    relay: Address | None = None  # set for relayed addresses: ``self`` is reached via ``relay``

    @property
    def url(self) -> str:
        """The websocket URL to dial (of the relay, for a relayed address)."""
        if self.relay is not None:
            return self.relay.url
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'wss' if self.secure else 'ws'}://{host}:{self.port}{self.path}"

    def with_peer_id(self, peer_id: PeerID) -> Address:
        return Address(self.host, self.port, self.secure, self.path, peer_id, self.relay)

    def relayed_to(self, peer_id: PeerID) -> Address:
        """The address of ``peer_id`` reached through this (relay) address."""
        if self.peer_id is None:
            raise AddressError("a relay address needs the relay's peer id")
        return Address(self.host, self.port, self.secure, self.path, peer_id, self)

    def __str__(self) -> str:
        if self.relay is not None:
            return f"{self.relay}/p2p-circuit/p2p/{self.peer_id}"
        try:
            protocol = "ip6" if ipaddress.ip_address(self.host).version == 6 else "ip4"
        except ValueError:
            protocol = "dns"
        text = f"/{protocol}/{self.host}/tcp/{self.port}/{'wss' if self.secure else 'ws'}"
        if self.path != "/":
            text += "/http-path/" + urllib.parse.quote(self.path.lstrip("/"), safe="")
        if self.peer_id is not None:
            text += f"/p2p/{self.peer_id}"
        return text


_FORMS = "help: use /ip4/HOST/tcp/PORT/ws/p2p/PEER_ID, /dns/NAME/tcp/443/wss/..., or ws://HOST:PORT"


def parse_address(text: str) -> Address:
    """Parse one address in any accepted form.

    Raises:
        AddressError: the text is not an address; the message shows the valid forms.
    """
    text = str(text).strip()
    if text.startswith(("ws://", "wss://")):
        return _parse_url(text)
    if not text.startswith("/"):
        raise AddressError(f"{text!r} is not a kit address - {_FORMS}")
    if "/p2p-circuit" in text:
        relay_text, _, rest = text.partition("/p2p-circuit")
        relay = parse_address(relay_text)
        parts = rest.strip("/").split("/")
        if len(parts) != 2 or parts[0] != "p2p":
            raise AddressError(f"{text!r}: a relayed address ends with /p2p-circuit/p2p/PEER_ID")
        return relay.relayed_to(_peer_id(parts[1], text))
    parts = text.strip("/").split("/")
    if len(parts) < 4 or parts[0] not in ("ip4", "ip6", "dns", "dns4", "dns6") or parts[2] != "tcp":
        raise AddressError(f"{text!r} is not a kit address - {_FORMS}")
    host, port = parts[1], _port(parts[3], text)
    secure, path, peer_id = False, "/", None
    components = parts[4:]
    while components:
        key = components.pop(0)
        if key in ("ws", "wss"):
            secure = key == "wss"
        elif key == "tls":  # /tls/ws is libp2p's spelling of wss
            secure = True
        elif key == "http-path" and components:
            path = "/" + urllib.parse.unquote(components.pop(0))
        elif key == "p2p" and components:
            peer_id = _peer_id(components.pop(0), text)
        else:
            raise AddressError(f"{text!r}: unexpected component {key!r} - {_FORMS}")
    return Address(host, port, secure, path, peer_id)


def _parse_url(text: str) -> Address:
    url = urllib.parse.urlsplit(text)
    if not url.hostname:
        raise AddressError(f"{text!r} has no host - {_FORMS}")
    try:
        port = url.port or (443 if url.scheme == "wss" else 80)
    except ValueError:
        raise AddressError(f"{text!r} has an invalid port - {_FORMS}") from None
    peer_id = _peer_id(url.fragment, text) if url.fragment else None
    return Address(url.hostname, port, url.scheme == "wss", url.path or "/", peer_id)


def _port(text: str, whole: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise AddressError(f"{whole!r}: invalid TCP port {text!r}")
    return int(text)


def _peer_id(text: str, whole: str) -> PeerID:
    try:
        return PeerID.from_base58(text)
    except ValueError:
        raise AddressError(f"{whole!r}: {text!r} is not a kit peer id") from None
