"""What a coordinator hands out to volunteers, checked before anything starts.

Volunteers on Colab or Kaggle reach the coordinator from the Internet, so the addresses in its
join link and in ``/api/run`` must name this machine as the Internet sees it. A coordinator
listening on ``0.0.0.0`` with nothing announced used to hand out ``/ip4/0.0.0.0/...``: every
volunteer then dialed itself, and the start-up check, rewriting the address to loopback, passed.

:func:`check_public_address` checks, before a port opens, what the peer will hand out
(``kit.p2p.interfaces.visible_addresses``):

* ``announce`` given (``--announce``, ``PUBLIC_ADDRESS``): those, as written (a bare host takes
  the listening port and scheme), but never a wildcard, and never a loopback or link-local
  address unless the coordinator listens on loopback only (a local run, or behind a reverse
  proxy on the same machine, which then announces its public name).
* listening on loopback: loopback (a run on this machine: ``kit demo``, tests).
* listening on a wildcard: this machine's global addresses (``kit.p2p.interfaces``). None
  (a cloud VM behind 1:1 NAT, a home server behind a router, a LAN) is refused with a hint
  that says what to set: its public address is not on any interface, so only the organizer
  knows it.
* listening on one address: that one (a warning when it is private).

:func:`check_tls_files` refuses a certificate that does not match its key, or that expired,
before anything starts. Whether volunteers can reach the handed-out addresses, and whether
they trust its certificate there, is the start-up preflight's job (``kit.preflight``: it dials
them from here).

Torch-free; the coordinator (``kit.coordinator``) calls both at the top of ``start()``.
"""

from __future__ import annotations

import datetime
import logging
import ssl
from collections.abc import Sequence
from pathlib import Path

from kit.address import AddressError
from kit.errors import ConfigError
from kit.p2p.interfaces import Scope, announced_address, interface_addresses, scope

logger = logging.getLogger(__name__)

ANNOUNCE_HINT = (
    "pass --announce with this machine's public IP or DNS name (PUBLIC_ADDRESS in the config "
    "notebook; the $PUBLIC_ADDRESS variable), e.g. --announce run.example.org or, behind a "
    "reverse proxy with TLS, --announce wss://run.example.org"
)


def check_public_address(
    host: str, announce: Sequence[str], *, interfaces: Sequence[str] | None = None
) -> None:
    """Check what a coordinator listening on ``host`` would hand out (see the module docstring;
    the peer then hands out exactly that: ``kit.p2p.interfaces.visible_addresses``).
    ``interfaces``: this machine's addresses (default: ``interface_addresses()``).

    Raises:
        ConfigError: an announced address is malformed or names no machine others can reach,
            or a wildcard listener has no global address to hand out; the message says what
            to set.
    """
    listening = scope(host)
    local_only = listening is Scope.LOOPBACK
    if announce:
        for text in announce:
            _check_announce(text, local_only=local_only)
        return
    if listening is Scope.PRIVATE:
        logger.warning(
            "the coordinator listens on %s, a private address: only machines in this network "
            "can join - help: %s",
            host,
            ANNOUNCE_HINT,
        )
    if listening is not Scope.UNSPECIFIED:
        return
    found = list(interfaces) if interfaces is not None else interface_addresses()
    if ":" not in host:  # an IPv4 wildcard listens on IPv4 addresses only
        found = [h for h in found if ":" not in h]
    if not any(scope(h) is Scope.GLOBAL for h in found):
        seen = ", ".join(f"{h} ({scope(h).value})" for h in found) or "none but loopback"
        raise ConfigError(
            f"the coordinator listens on {host or '0.0.0.0'} but this machine has no public "
            f"address to hand out (its addresses: {seen}): volunteers on Colab, Kaggle or "
            f"another network could not reach it - help: {ANNOUNCE_HINT}; for a run inside "
            "this network, announce its private address; for a run on this machine only, "
            "listen on 127.0.0.1"
        )


def _check_announce(text: str, *, local_only: bool) -> None:
    try:
        address = announced_address(text, 1, False)  # the listening port: not needed to check
    except AddressError as e:
        raise ConfigError(f"announce {text!r}: {e} - help: {ANNOUNCE_HINT}") from None
    where = scope(address.host)
    if address.relay is not None:
        raise ConfigError(
            f"announce {text!r} is a relayed address: the coordinator is what volunteers dial "
            f"first - help: {ANNOUNCE_HINT}"
        )
    if where is Scope.UNSPECIFIED:
        raise ConfigError(
            f"announce {text!r} names no machine ({address.host} means 'every interface' "
            f"only to a listener) - help: {ANNOUNCE_HINT}"
        )
    if where in (Scope.LOOPBACK, Scope.LINK_LOCAL) and not local_only:
        raise ConfigError(
            f"announce {text!r} is a {where.value} address: volunteers on other machines would "
            f"dial their own - help: {ANNOUNCE_HINT}"
        )


def check_tls_files(certfile: str, keyfile: str) -> None:
    """Refuse TLS files that cannot serve: missing, not PEM, a key of another certificate, or
    a certificate that expired or is not valid yet.

    Raises:
        ConfigError: which file, what is wrong, and what to do.
    """
    for label, name in (("certificate", certfile), ("key", keyfile)):
        if not Path(name).is_file():
            raise ConfigError(
                f"TLS {label} {name} does not exist - help: give the PEM files of your "
                "certificate (e.g. Let's Encrypt's fullchain.pem and privkey.pem)"
            )
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(certfile, keyfile)
    except ssl.SSLError as e:
        reason = str(e.reason or e)
        if "KEY_VALUES_MISMATCH" in reason.upper():
            raise ConfigError(
                f"TLS key {keyfile} does not match the certificate {certfile} - help: give the "
                "private key that was issued with this certificate (Let's Encrypt: privkey.pem "
                "of the same live/ folder)"
            ) from None
        raise ConfigError(
            f"TLS files {certfile} / {keyfile} cannot be loaded ({reason}) - help: give a PEM "
            "certificate chain and its PEM private key (unencrypted)"
        ) from None
    except OSError as e:
        raise ConfigError(f"TLS files cannot be read: {e} - help: check their permissions") from e
    _check_validity(certfile)


def _check_validity(certfile: str) -> None:
    from cryptography import x509

    try:
        certificate = x509.load_pem_x509_certificate(Path(certfile).read_bytes())
    except ValueError as e:  # load_cert_chain took it: a PEM bundle this parser reads differently
        logger.debug("cannot read the validity of %s: %s", certfile, e)
        return
    now = datetime.datetime.now(datetime.timezone.utc)
    if certificate.not_valid_after_utc < now:
        raise ConfigError(
            f"TLS certificate {certfile} expired on {certificate.not_valid_after_utc:%Y-%m-%d}: "
            "volunteers would refuse it - help: renew it (certbot renew) and restart"
        )
    if certificate.not_valid_before_utc > now:
        raise ConfigError(
            f"TLS certificate {certfile} is valid from {certificate.not_valid_before_utc:%Y-%m-%d} "
            "only - help: check this machine's clock, or use a certificate valid now"
        )
