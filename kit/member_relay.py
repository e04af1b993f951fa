"""``kit dht --join URL --hf-token ...``: a run member's public machine as bootstrap peer and relay.

A run whose volunteers are mostly NAT'd needs relays besides the coordinator (see
``kit.relay_directory`` for why and how they are listed). A plain ``kit dht`` peer serves open
runs only: in an allowlisted run every member refuses a peer without an access token at the
handshake. :func:`start_member_relay` joins as a member instead, like a volunteer that does not
train:

1. fetch the run from the coordinator's link (``/api/run``: run id, config hash, peers, the
   authority's key);
2. log in with the member's Hugging Face token (an allowlisted user: the coordinator issues an
   access token for this machine's peer key, renewed as volunteers' are);
3. check that it has an address remote volunteers can dial (``kit.public_address``: as the
   coordinator, never a wildcard or loopback one; ``--announce`` otherwise);
4. start a listening DHT peer with ``relay_service=True`` and the token, joined to the run's
   peers, and publish its addresses (``RelayAnnouncer``): the coordinator's ``/api/run`` then
   hands it out, and NAT'd volunteers register with it and join through it.

Bans hold for it as for any member: its user or key banned, every peer closes its connections
and the coordinator stops listing it. Nothing of the run's training runs here (no torch).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import ssl
import threading
import urllib.parse
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kit.errors import KitError, KitUsageError
from kit.p2p.identity import Identity, IdentityLock, b58encode, load_identity
from kit.p2p.interfaces import is_loopback_only

if TYPE_CHECKING:
    from kit.auth import AllowlistAuthorizer
    from kit.dht import DHT, DHTNode
    from kit.relay_directory import RelayAnnouncer
    from kit.remote_run import RunInfo

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class MemberRelay:
    """A running member relay; stop it with :meth:`shutdown`."""

    info: RunInfo  # the run it joined
    dht: DHT
    announcer: RelayAnnouncer
    username: str | None  # the member it logged in as (None: an open run)
    dht_identity: Identity  # its peer key (the token names it; a key ban names it too)
    lock: IdentityLock | None = None

    @property
    def addresses(self) -> list[str]:
        return list(self.dht.get_visible_addresses())

    def shutdown(self) -> None:
        announcer, dht = self.announcer, self.dht
        if dht.is_alive():
            dht.run_coroutine(lambda _, __: announcer.shutdown())
        dht.shutdown()
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def start_member_relay(
    url: str,
    hf_token: str | None,
    *,
    host: str = "0.0.0.0",
    port: int = 31337,
    announce: Sequence[str] = (),
    identity_path: str | None = None,
    ssl_context: ssl.SSLContext | None = None,
    allow_insecure_http: bool = False,
    period: float | None = None,
) -> MemberRelay:
    """Join the run at ``url`` as a relay (see the module docstring); returns once it is up.

    Raises:
        CoordinatorUnreachable, ConfigError: the link does not answer with a run.
        KitUsageError: an allowlisted run and no ``hf_token``.
        InvalidHubToken, NotAllowlisted, Revoked, TokenServiceUnavailable: no access token.
        ConfigError: no address volunteers could dial (``--announce`` says what to set).
    """
    from kit.dht import DHT
    from kit.public_address import check_public_address
    from kit.relay_directory import REFRESH_PERIOD, RelayAnnouncer
    from kit.remote_run import fetch_run_info

    info = fetch_run_info(url, timeout=30.0, ssl_context=ssl_context)
    check_public_address(host, announce)  # before logging in: nothing is half-started
    lock = None
    identity = Identity.generate()
    if identity_path is not None:
        identity, lock = load_identity(identity_path)
    try:
        authorizer, username = _login(info, hf_token, identity, ssl_context, allow_insecure_http)
        peer_options: dict[str, object] = dict(
            identity=identity,
            run_id=info.config.collaboration.run_id,
            config_hash=info.config_hash,
            relay_service=True,
        )
        if authorizer is not None:
            peer_options["authorizer"] = authorizer
        if ssl_context is not None:
            peer_options["client_ssl"] = ssl_context
        dht = DHT(
            initial_peers=list(info.initial_peers),
            client_mode=False,
            host=host,
            port=port,
            announce=list(announce) or None,
            peer_options=peer_options,
        )
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    run_id = info.config.collaboration.run_id
    # A run on one machine (a loopback link): loopback addresses are the dialable ones.
    local = is_loopback_only(urllib.parse.urlsplit(info.url).hostname or "")

    async def announce_relay(_: DHT, node: DHTNode) -> RelayAnnouncer:
        announcer = RelayAnnouncer(
            node,
            run_id,
            identity,
            node.peer.get_visible_addresses,
            local=local,
            period=period or REFRESH_PERIOD,
        )
        announcer.start()
        return announcer

    try:
        announcer = dht.run_coroutine(announce_relay)
    except BaseException:
        dht.shutdown()
        if lock is not None:
            lock.release()
        raise
    return MemberRelay(info, dht, announcer, username, identity, lock)


def _login(
    info: RunInfo,
    hf_token: str | None,
    identity: Identity,
    ssl_context: ssl.SSLContext | None,
    allow_insecure_http: bool,
) -> tuple[AllowlistAuthorizer | None, str | None]:
    if info.authority_public_key is None:
        return None, None  # an open run: anyone may relay
    if not hf_token:
        raise KitUsageError(
            "this run is allowlisted: its peers refuse a relay without an access token - help: "
            "pass --hf-token (or set HF_TOKEN) of a Hugging Face user on the run's allowlist"
        )
    from kit.auth import authorizer_from_coordinator
    from kit.runtime import get_runtime

    authorizer = get_runtime().call(
        authorizer_from_coordinator(
            info.url,
            hf_token.strip(),
            identity,
            authority_public_key=info.authority_public_key,
            ssl_context=ssl_context,
            allow_insecure_http=allow_insecure_http,
            check_period=info.config.access.check_seconds,
        ),
        timeout=60.0,
    )
    token = authorizer.token
    return authorizer, token.username if token is not None else None


def add_command(subparsers: Any) -> None:
    """``kit dht --join URL --hf-token ...``: adds the member options to ``kit dht``."""
    parser = subparsers.choices["dht"]  # registered by kit.dht.cli, earlier in kit.cli's list
    parser.add_argument(
        "--join",
        default=None,
        metavar="URL",
        help="join the run at this coordinator link as a member relay (allowlisted runs: with "
        "--hf-token); the coordinator hands it out to NAT'd volunteers",
    )
    parser.add_argument(
        "--hf-token",
        default=None,
        help="--join an allowlisted run as this Hugging Face user (default: $HF_TOKEN)",
    )
    parser.add_argument(
        "--ca-file", default=None, help="--join: trust this CA for the coordinator's https"
    )
    plain = parser.get_default("handler")
    parser.set_defaults(handler=lambda args: serve_member_relay(args) if args.join else plain(args))


def serve_member_relay(args: argparse.Namespace, *, stop: threading.Event | None = None) -> int:
    """``kit dht --join URL``: run until Ctrl+C (or ``stop``); prints its addresses. Exit 1
    with the reason on stderr when it cannot join (nothing is left running)."""
    stop = stop or threading.Event()
    context = ssl.create_default_context(cafile=args.ca_file) if args.ca_file else None
    try:
        relay = start_member_relay(
            args.join,
            args.hf_token or os.environ.get("HF_TOKEN") or None,
            host=args.host,
            port=args.port,
            announce=tuple(args.announce or ()),
            identity_path=args.identity_path,
            ssl_context=context,
        )
    except KitError as error:
        logger.error("not started: %s", error)
        return 1
    try:
        who = f" as {relay.username}" if relay.username else ""
        print(
            f"kit relay {relay.dht.peer_id} joined run {relay.info.config.collaboration.run_id!r}{who}."
        )
        key = b58encode(relay.dht_identity.public_key)
        print(f"Its peer key (kit revoke --peer-key): {key}")
        print("The coordinator hands it out to volunteers at:")
        for address in relay.addresses:
            print(address)
        print("Press Ctrl+C to stop.", flush=True)
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        print("stopping")
    finally:
        relay.shutdown()
    return 0
