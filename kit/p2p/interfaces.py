"""Which addresses a listening peer hands out: its interfaces' addresses, never a wildcard.

A peer listening on ``0.0.0.0`` (or ``::``) is reachable at each of its interfaces' addresses,
but the wildcard itself names no machine: handed to another peer, ``/ip4/0.0.0.0/...`` makes
that peer dial *itself*. So a wildcard listener hands out the addresses of this machine's
interfaces instead (:func:`interface_addresses`): its global ones, or its private ones when it
has none (a LAN), never loopback or link-local ones; and ``announce`` entries replace all of them
(:func:`announced_address`: a bare host or ``host:port`` takes the listening port and scheme).

How far an address reaches (:func:`scope`) is for the coordinator's start-up check
(``kit.public_address``): a private address (RFC 1918, carrier-grade NAT, IPv6 ULA) works
inside its network only, and volunteers on Colab or Kaggle are outside it.

Standard library and psutil only (psutil lists interfaces on every OS; without it, the
addresses the host name resolves to).
"""

from __future__ import annotations

import enum
import ipaddress
import logging
import socket
from collections.abc import Iterable, Sequence

from kit.address import Address, AddressError, parse_address

logger = logging.getLogger(__name__)

WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})
# RFC 6598 shared space (carrier-grade NAT): not "private" to ipaddress, not global either.
CARRIER_GRADE_NAT = ipaddress.ip_network("100.64.0.0/10")


class Scope(enum.Enum):
    """How far an address reaches, nearest first."""

    UNSPECIFIED = "unspecified"  # 0.0.0.0, ::: no machine
    LOOPBACK = "loopback"  # this machine only
    LINK_LOCAL = "link-local"  # this network segment only (169.254/16, fe80::/10)
    PRIVATE = "private"  # this network only: RFC 1918, CGNAT, ULA, documentation ranges
    GLOBAL = "global"  # the Internet
    NAME = "name"  # a DNS name: resolved by whoever dials it


def scope(host: str) -> Scope:
    """The scope of ``host`` (an IP address or a DNS name)."""
    name = host.strip("[]").lower()
    if name in WILDCARD_HOSTS:
        return Scope.UNSPECIFIED
    if name in LOOPBACK_NAMES:
        return Scope.LOOPBACK
    try:
        ip = ipaddress.ip_address(name.split("%")[0])
    except ValueError:
        return Scope.NAME
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_unspecified:
        return Scope.UNSPECIFIED
    if ip.is_loopback:
        return Scope.LOOPBACK
    if ip.is_link_local:
        return Scope.LINK_LOCAL
    if ip.is_global and ip not in CARRIER_GRADE_NAT:
        return Scope.GLOBAL
    return Scope.PRIVATE


def is_loopback_only(host: str) -> bool:
    """Whether a peer listening on ``host`` accepts connections from this machine only."""
    return scope(host) is Scope.LOOPBACK


def interface_addresses(family: socket.AddressFamily | None = None) -> list[str]:
    """This machine's interface addresses others may dial: global and private ones, not
    loopback, link-local or wildcard ones. ``family``: AF_INET or AF_INET6 only (None: both)."""
    found: list[str] = []
    for host in _raw_interface_addresses():
        try:
            ip = ipaddress.ip_address(host.split("%")[0])
        except ValueError:
            continue
        if family == socket.AF_INET and ip.version != 4:
            continue
        if family == socket.AF_INET6 and ip.version != 6:
            continue
        if scope(str(ip)) in (Scope.GLOBAL, Scope.PRIVATE) and str(ip) not in found:
            found.append(str(ip))
    return found


def _raw_interface_addresses() -> list[str]:
    try:
        import psutil
    except ImportError:  # a volunteer's minimal install: what the host name resolves to
        try:
            infos = socket.getaddrinfo(socket.gethostname(), None)
        except OSError:
            return []
        return [str(info[4][0]) for info in infos]
    hosts = []
    for addresses in psutil.net_if_addrs().values():
        hosts += [a.address for a in addresses if a.family in (socket.AF_INET, socket.AF_INET6)]
    return hosts


def announced_address(text: str, port: int | None, secure: bool) -> Address:
    """One ``announce`` entry as an address: a kit address or URL as it is; a bare host
    (``203.0.113.5``, ``run.example.org``, ``[2001:db8::1]``) or ``host:port`` with the
    listening port (or the given one) and this peer's scheme (wss:// when it serves TLS).

    Raises:
        AddressError: not an address, or a bare host while the listening port is unknown.
    """
    text = text.strip()
    if text.startswith(("https://", "http://")):  # the link an organizer knows: same server
        text = "ws" + text[len("http") :]
    if text.startswith(("/", "ws://", "wss://")):
        return parse_address(text)
    host, _, given = text.rpartition(":") if _has_port(text) else (text, "", "")
    host = host.strip("[]")
    if not host or any(c in host for c in "/ @#?"):
        raise AddressError(
            f"{text!r} is not a host - help: write a host name or IP (run.example.org, "
            "203.0.113.5), host:port, a URL (wss://run.example.org) or /dns/NAME/tcp/443/wss"
        )
    if given:
        if not given.isdigit() or not 0 < int(given) < 65536:
            raise AddressError(f"{text!r}: invalid TCP port {given!r}")
        port = int(given)
    if not port:
        raise AddressError(
            f"{text!r} has no port and the listening port is not known yet - help: write "
            f"{host}:PORT, or listen on a fixed port"
        )
    return Address(host, port, secure)


def _has_port(text: str) -> bool:
    if text.startswith("["):  # [v6]:port
        return "]:" in text
    return text.count(":") == 1  # a bare IPv6 address has several


def visible_addresses(
    listening: Sequence[Address], announce: Iterable[str], interfaces: Sequence[str] | None = None
) -> list[Address]:
    """The addresses a listening peer hands out: its ``announce`` entries when given, else
    where it listens, with each wildcard replaced by the interfaces' addresses of its family.
    ``interfaces``: the addresses to use for wildcards (default: :func:`interface_addresses`)."""
    port = listening[0].port if listening else None
    secure = bool(listening) and listening[0].secure
    announced = [announced_address(text, port, secure) for text in announce]
    if announced:
        return announced
    out: list[Address] = []
    for address in listening:
        if scope(address.host) is not Scope.UNSPECIFIED:
            out.append(address)
            continue
        hosts = list(interfaces) if interfaces is not None else interface_addresses()
        if ":" not in address.host:  # "::" on Linux is dual-stack: IPv4 addresses answer too
            hosts = [h for h in hosts if ":" not in h]
        # Global addresses only, when there are any: a private one (a Docker bridge, the LAN
        # behind a cloud VM's NAT) would make a remote peer dial some machine of its own.
        public = [h for h in hosts if scope(h) is Scope.GLOBAL]
        for host in public or hosts:
            candidate = Address(host, address.port, address.secure, address.path, address.peer_id)
            if candidate not in out:
                out.append(candidate)
    return out
