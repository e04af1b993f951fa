"""The allowlist authorizer: the ``kit.p2p`` handshake hook that admits token holders only.

Every peer of an allowlisted run (volunteers and the coordinator alike) runs an
:class:`AllowlistAuthorizer`. In its handshake hello it presents its own access token
(:meth:`~AllowlistAuthorizer.credentials`, refreshed shortly before expiry); of the remote side
it demands a token signed by the run's authority, issued for exactly the public key the remote
proved it holds, not expired, and not revoked (:meth:`~AllowlistAuthorizer.authorize`). The
handshake (``kit.p2p.handshake``) has already checked the remote's signature over both sides'
fresh nonces, so a recorded handshake cannot be replayed and a copied token cannot be used with
another key.

Tokens come from a *token source*, an async callable ``source(peer_public_key) -> AccessToken``:
:class:`~kit.auth.token_client.HttpTokenSource` asks the coordinator's token endpoint (volunteers),
:class:`IssuerTokenSource` signs in process (the coordinator's own peer).

Admission is checked at each handshake; established connections are checked by the peer's
:class:`~kit.auth.sessions.SessionGuard`, which :meth:`AllowlistAuthorizer.attach` starts with
every peer: every ``check_period`` seconds it reads the revocation list from the DHT (once the
peer's DHT node is attached, :meth:`AllowlistAuthorizer.follow_dht`), closes connections of
banned users and keys, and closes connections whose token expired without a renewal. The
session itself is protected by ``kit.p2p``: the authorizer is ``private``, which turns on
per-frame authentication with keys derived in the handshake (``kit.p2p.frame_auth``).

Over HTTP (the coordinator's served data in a private run) a client presents the same token as
``Authorization: Bearer ...`` (``kit.auth.tokens.bearer_header``); :meth:`~AllowlistAuthorizer.
check_bearer` checks the authority's signature, the run, the expiry and the bans, but cannot bind
the token to a key (HTTP has no proof of possession): a leaked bearer token lets its holder
download the data until it expires. Tokens are short-lived and TLS protects them in transit.

What this module does not do: HTTP (``kit.auth.endpoint``), signing tokens
(``kit.auth.authority``), the record format (``kit.auth.tokens``, ``kit.auth.revocation``).
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from kit.auth.authority import COORDINATOR_USERNAME, TokenIssuer
from kit.auth.revocation import RevocationList, fetch_revocations
from kit.auth.sessions import SessionGuard
from kit.auth.tokens import AccessToken, bearer_header, token_from_bearer, verify_token
from kit.errors import (
    AuthError,
    ConfigError,
    MalformedToken,
    MissingToken,
    Revoked,
    TokenExpired,
    TokenServiceUnavailable,
)
from kit.p2p.handshake import RemoteHello
from kit.p2p.identity import Identity, PeerID
from kit.p2p.wire import Refusal

if TYPE_CHECKING:
    from kit.dht.node import DHTNode
    from kit.p2p.peer import Peer

logger = logging.getLogger(__name__)

#: ``source(peer_public_key) -> AccessToken``: where an authorizer gets its own tokens.
TokenSource = Callable[[bytes], Awaitable[AccessToken]]
#: At most one background refresh per this many seconds (or refresh_before / 2 if shorter), so a
#: failing coordinator is not hammered by every handshake.
REFRESH_MIN_INTERVAL = 5.0
MAX_REVOCATION_RUNS = 8


class IssuerTokenSource:
    """Tokens for the coordinator's own peer, signed in process by its :class:`TokenIssuer`."""

    def __init__(
        self,
        issuer: TokenIssuer,
        username: str = COORDINATOR_USERNAME,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.issuer = issuer
        self.username = username
        self._clock = clock

    async def __call__(self, peer_public_key: bytes) -> AccessToken:
        return self.issuer.issue(self.username, peer_public_key, now=self._clock())


class AllowlistAuthorizer:
    """Admits peers with a valid access token of this run; presents this peer's own token.

    Implements ``kit.p2p.channel.Authorizer``: pass it as ``create_peer(..., authorizer=...)``.

    Example (a volunteer; ``authorizer_from_coordinator`` in ``kit.auth.endpoint`` does this)::

        source = HttpTokenSource("https://coordinator.example.org:31337", hf_token)
        authorizer = AllowlistAuthorizer(identity, authority_public_key, source)
        peer = await create_peer(initial_peers, identity=identity, authorizer=authorizer)

    Args:
        identity: this peer's identity (tokens are requested for its public key).
        authority_public_key: the run's authority key (raw 32 bytes), as the organizer published.
        token_source: ``async source(peer_public_key) -> AccessToken``.
        clock_skew: seconds by which the clocks of two peers may disagree; a token is accepted
            this long past its expiration. Increase this if you see TokenExpired right after
            joining on machines with a wrong clock (better: fix the clock with NTP).
        refresh_before: renew this peer's token this many seconds before it expires, in the
            background. Increase this if you see TokenServiceUnavailable / TokenExpired around
            token renewals (a slow or briefly unreachable coordinator).
        fetch_timeout: seconds one token request may take. Increase this on slow links.
        check_period: seconds between the session guard's checks (the revocation list from the
            DHT, expired tokens of established connections). Decrease this if banned peers stay
            connected too long; increase it if the DHT is busy on swarms of hundreds of peers.
        clock: returns the current Unix time (tests pass a fake one).
    """

    #: A private run: ``kit.p2p`` also authenticates every frame of the connections admitted
    #: here (session keys from the handshake), so an admitted session cannot be hijacked.
    private = True

    def __init__(
        self,
        identity: Identity,
        authority_public_key: bytes,
        token_source: TokenSource,
        *,
        clock_skew: float = 60.0,
        refresh_before: float = 120.0,
        fetch_timeout: float = 30.0,
        check_period: float = 30.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        for name, value in (("clock_skew", clock_skew), ("refresh_before", refresh_before)):
            if not 0 <= value < 24 * 3600:
                raise ConfigError(
                    f"AllowlistAuthorizer: {name}={value!r} must be in [0, 86400) s - help: "
                    "keep the default (clock_skew=60, refresh_before=120)"
                )
        for name, value in (("fetch_timeout", fetch_timeout), ("check_period", check_period)):
            if not 0 < value < 24 * 3600:
                raise ConfigError(
                    f"AllowlistAuthorizer: {name}={value!r} must be in (0, 86400) s - help: "
                    "keep the default (30)"
                )
        if len(authority_public_key) != 32:
            raise ConfigError(
                "AllowlistAuthorizer: authority_public_key must be the raw 32-byte Ed25519 key "
                "- help: decode the published base58 key with kit.p2p.identity.b58decode"
            )
        self.identity = identity
        self.authority_public_key = authority_public_key
        self.clock_skew = clock_skew
        self.refresh_before = refresh_before
        self.fetch_timeout = fetch_timeout
        self.check_period = check_period
        self._source = token_source
        self._clock = clock
        self._token: AccessToken | None = None
        self._token_bytes = b""
        self._refreshing: asyncio.Future[None] | None = None
        self._next_background_refresh = 0.0
        self._revocations: dict[str, RevocationList] = {}
        self._guards: weakref.WeakKeyDictionary[Peer, SessionGuard] = weakref.WeakKeyDictionary()

    @classmethod
    def for_coordinator(
        cls, identity: Identity, issuer: TokenIssuer, **settings: Any
    ) -> AllowlistAuthorizer:
        """The coordinator's own authorizer: tokens from ``issuer``, its revocations applied."""
        authorizer = cls(
            identity, issuer.authority_public_key, IssuerTokenSource(issuer), **settings
        )
        authorizer.update_revocations(issuer.revocations)
        return authorizer

    def clock(self) -> float:
        """The current Unix time, as this authorizer reads it."""
        return self._clock()

    # --- the peer's session guard ---------------------------------------------------------

    def attach(self, peer: Peer) -> SessionGuard:
        """Start checking ``peer``'s established connections (``kit.p2p.peer`` calls this when
        the peer starts): a :class:`~kit.auth.sessions.SessionGuard` task the peer owns."""
        guard = SessionGuard(peer, self, period=self.check_period)
        self._guards[peer] = guard
        peer.spawn(guard.run(), "session-guard")
        return guard

    def follow_dht(self, node: DHTNode) -> None:
        """Read the run's revocation list through ``node`` at every check (``kit.dht.node``
        calls this when the peer's DHT node starts)."""
        guard = self._guards.get(node.peer)  # type: ignore[call-overload]
        if guard is None:
            return
        run_id = guard.run_id

        def fetch() -> Awaitable[RevocationList | None]:
            return fetch_revocations(node, self.authority_public_key, run_id)

        guard.fetch = fetch
        guard.fetch_through = node

    def unfollow_dht(self, node: DHTNode) -> None:
        """``node`` shuts down while its peer may run on (``kit.dht.node`` calls this): stop
        reading the list through it, until another node of the peer starts. (Otherwise every
        check warned that it could not read the list, for as long as the peer ran.)"""
        guard = self._guards.get(node.peer)  # type: ignore[call-overload]
        if guard is not None and guard.fetch_through is node:
            guard.fetch = guard.fetch_through = None

    def session_guard(self, peer: Peer) -> SessionGuard | None:
        """The guard checking ``peer``'s connections (None if it was not started with it)."""
        return self._guards.get(peer)

    @property
    def token(self) -> AccessToken | None:
        """This peer's current access token (None before the first handshake)."""
        return self._token

    def bearer(self) -> str | None:
        """This peer's current token as an HTTP ``Authorization`` value (None before the first):
        what it sends to the coordinator's data routes. Renewed with the token."""
        token = self._token
        return None if token is None else bearer_header(token)

    # --- this peer's own token ------------------------------------------------------------

    async def credentials(self) -> bytes:
        """This peer's current token, renewed in the background ``refresh_before`` seconds
        before expiry; waits for a new one only when there is no usable token.

        Raises:
            TokenServiceUnavailable, InvalidHubToken, NotAllowlisted, Revoked, BadSignature,
            TokenExpired: no usable token could be obtained (the message says why).
        """
        now = self._clock()
        token = self._token
        if token is not None and now < token.expiration_time + self.clock_skew:
            if now >= token.expiration_time - self.refresh_before:
                self._refresh_in_background(now)
            return self._token_bytes
        await asyncio.shield(self._refresh_task())
        return self._token_bytes

    def accept_token(self, token: AccessToken) -> None:
        """Check a token this peer got and make it the current one.

        Raises:
            BadSignature: signed by another authority (wrong coordinator or authority key).
            TokenMismatch: issued for another peer key.
            TokenExpired: expired on arrival (this machine's clock is wrong?).
        """
        verify_token(
            token,
            self.authority_public_key,
            now=self._clock(),
            clock_skew=self.clock_skew,
            peer_public_key=self.identity.public_key,
        )
        self._token = token
        self._token_bytes = token.to_bytes()
        logger.debug(
            "new access token for %r, expires at %.0f", token.username, token.expiration_time
        )

    def keep_fresh(self) -> None:
        """Renew this peer's token in the background if it is due (never waits)."""
        now = self._clock()
        token = self._token
        if token is None or now >= token.expiration_time - self.refresh_before:
            self._refresh_in_background(now)

    def _refresh_task(self) -> asyncio.Future[None]:
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.ensure_future(self._refresh())
            self._refreshing.add_done_callback(self._refresh_done)
        return self._refreshing

    def _refresh_in_background(self, now: float) -> None:
        if now < self._next_background_refresh:
            return
        self._next_background_refresh = now + min(REFRESH_MIN_INTERVAL, self.refresh_before / 2)
        self._refresh_task()

    async def _refresh(self) -> None:
        try:
            token = await asyncio.wait_for(
                self._source(self.identity.public_key), self.fetch_timeout
            )
        except asyncio.TimeoutError:
            raise TokenServiceUnavailable(
                f"no access token within {self.fetch_timeout} s - help: check that the "
                "coordinator is up, or raise fetch_timeout on slow links"
            ) from None
        self.accept_token(token)

    def _refresh_done(self, task: asyncio.Future[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        token = self._token
        if token is not None and self._clock() < token.expiration_time:
            logger.warning("could not renew the access token (will retry): %s", task.exception())
        else:
            logger.debug("access token request failed: %r", task.exception())

    async def close(self) -> None:
        """Cancel a token request in flight (call at shutdown)."""
        task, self._refreshing = self._refreshing, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait([task], timeout=5.0)

    # --- checking remote peers ------------------------------------------------------------

    async def authorize(self, remote: RemoteHello) -> None:
        """Admit ``remote`` (its key possession is already verified) or raise an AuthError.

        Raises:
            MissingToken: no token presented. MalformedToken: not a token.
            BadSignature: forged (not signed by this run's authority).
            TokenMismatch: issued to another peer key (stolen) or for another run.
            TokenExpired: expired beyond ``clock_skew``. Revoked: banned by the organizer.
        """
        token = self._remote_token(remote)
        now = self._clock()
        verify_token(
            token,
            self.authority_public_key,
            now=now,
            clock_skew=self.clock_skew,
            peer_public_key=remote.public_key,
            run_id=remote.run_id,
        )
        self._check_revoked(token, remote, now)
        logger.debug("admitted %s (user %r)", remote.peer_id.short(), token.username)

    def check_revoked(self, remote: RemoteHello) -> None:
        """Raise :class:`~kit.errors.Revoked` if ``remote``'s user or key is banned now
        (whether its token is still valid or not: used for established connections)."""
        self._check_revoked(self._remote_token(remote), remote, self._clock())

    def _remote_token(self, remote: RemoteHello) -> AccessToken:
        if not remote.credentials:
            raise MissingToken(
                f"peer {remote.peer_id.short()} presented no access token, and this run admits "
                "allowlisted Hugging Face users only - help: join with the run's coordinator "
                "URL and your HF token (kit's allowlist authorizer), not as an open peer"
            )
        return AccessToken.from_bytes(remote.credentials)

    def _check_revoked(self, token: AccessToken, remote: RemoteHello, now: float) -> None:
        self.check_token_revoked(token, remote.public_key, now, run_id=remote.run_id)

    def check_token_revoked(
        self, token: AccessToken, peer_public_key: bytes, now: float, *, run_id: str | None = None
    ) -> None:
        """Raise :class:`~kit.errors.Revoked` if the user ``token`` names, or the key, is
        banned in the run (``run_id``, default the token's) at ``now``."""
        run = token.run_id if run_id is None else run_id
        revocations = self._revocations.get(run)
        if revocations is None:
            return
        reason = revocations.reason(token.username, peer_public_key, now)
        if reason is not None:
            raise Revoked(f"{reason} - help: ask the organizer of run {run!r} why")

    # --- HTTP clients ---------------------------------------------------------------------

    def check_bearer(self, authorization: str | None, *, run_id: str) -> AccessToken:
        """The token of an HTTP ``Authorization: Bearer`` header, if it admits to ``run_id`` now.

        Checks the authority's signature, the run, the expiry (with ``clock_skew``) and the bans
        of the user and of the key the token names. No key binding: HTTP proves no key.

        Raises:
            MissingToken, MalformedToken: no token, or not one. TokenExpired: expired.
            BadSignature: forged or another authority's. TokenMismatch: another run's.
            Revoked: the user or the key is banned.
        """
        token = token_from_bearer(authorization)
        now = self._clock()
        verify_token(
            token, self.authority_public_key, now=now, clock_skew=self.clock_skew, run_id=run_id
        )
        self.check_token_revoked(token, token.peer_public_key, now, run_id=run_id)
        return token

    def http_refusal(self, authorization: str | None, *, run_id: str) -> tuple[int, str] | None:
        """None if the bearer token admits to ``run_id``; else the HTTP status and the reason:
        401 for no token, a malformed or an expired one (get a fresh token), 403 otherwise
        (forged, another run's, banned, not allowlisted)."""
        try:
            self.check_bearer(authorization, run_id=run_id)
        except (MissingToken, MalformedToken, TokenExpired) as error:
            return 401, str(error)
        except AuthError as error:
            return 403, str(error)
        return None

    def request_guard(self, run_id: str) -> Callable[[Any], tuple[int, str] | None]:
        """``guard(request)`` for ``kit.data.serving.DataServer``: :meth:`http_refusal` of the
        request's ``Authorization`` header (``request.headers``, lower-case names)."""

        def guard(request: Any) -> tuple[int, str] | None:
            return self.http_refusal(request.headers.get("authorization"), run_id=run_id)

        return guard

    # --- revocations ----------------------------------------------------------------------

    def update_revocations(self, revocations: RevocationList) -> bool:
        """Use ``revocations`` if the authority signed it and it is newer than the one held.

        Returns:
            True if it replaced the list held for its run (False: older or the same).

        Raises:
            BadSignature: not signed by this run's authority.
        """
        revocations.verify(self.authority_public_key)
        held = self._revocations.get(revocations.run_id)
        if held is not None and held.issued_at >= revocations.issued_at:
            return False  # an old list replayed (or the same one again): never lift a ban
        if held is None and len(self._revocations) >= MAX_REVOCATION_RUNS:
            oldest = min(self._revocations.values(), key=lambda held: held.issued_at)
            del self._revocations[oldest.run_id]
        self._revocations[revocations.run_id] = revocations
        return True

    def revocations(self, run_id: str) -> RevocationList | None:
        """The newest verified revocation list held for ``run_id``."""
        return self._revocations.get(run_id)


def enforce_revocations(peer: Peer, authorizer: AllowlistAuthorizer) -> list[PeerID]:
    """Close ``peer``'s connections to revoked users and keys; returns whom it disconnected."""
    closed = []
    for connection in peer.all_connections():
        peer_id = connection.remote_peer
        try:
            authorizer.check_revoked(connection.remote)
        except Revoked as e:
            logger.info("closing the connection to revoked peer %s: %s", peer_id.short(), e)
            connection.close(Refusal.AUTH, str(e))
            closed.append(peer_id)
        except AuthError:
            continue  # admitted earlier; only revocations end established connections
    return closed
