"""The session guard: every peer of a private run keeps its established connections honest.

The handshake admits a peer once (``kit.auth.authorizer``). A connection can outlive that check:
its user may be banned an hour later, its access token may expire. A :class:`SessionGuard` runs
at EVERY peer of an allowlisted run, volunteers and coordinator alike (the authorizer starts it
with the peer: ``kit.p2p.peer`` calls ``authorizer.attach(peer)``), and every ``period`` seconds:

1. reads the run's signed revocation list from the DHT, when the peer has a DHT node
   (``kit.dht.node`` calls ``authorizer.follow_dht(node)``, and ``unfollow_dht(node)`` when that
   node shuts down and the peer runs on), and adopts it if it is newer;
2. renews this peer's own access token when it is due (``refresh_before`` its expiry);
3. closes every connection whose user or key is banned (GOAWAY ``unauthorized`` with the reason;
   the handshake refuses their new dials with the same list), and every connection whose token
   expired more than ``clock_skew`` ago without a renewal;
4. asks the remote side of each connection whose token expires within ``refresh_before / 2`` for
   its current token (protocol ``kit/auth/1/token``), and keeps it if it verifies: signed by the
   authority, for this run, for the very key the handshake proved. A remote that renewed stays
   connected; one that cannot renew (revoked at the token endpoint, coordinator unreachable, an
   old kit) is closed once its token is over, and redials with a new token if it gets one.

So a ban takes effect at every peer within one ``period`` plus a DHT read, and a token admits
a session for its lifetime only. Revoked peers cannot store in the DHT, average or download
state from this peer either: all of that travels over connections that are closed and refused.

What this module does not do: the handshake check (``kit.auth.authorizer``), the list format and
its DHT transport (``kit.auth.revocation``), deciding whom to ban (``kit.auth.authority``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

from kit.auth.revocation import RevocationList
from kit.auth.tokens import MAX_TOKEN_BYTES, AccessToken, verify_token
from kit.errors import AuthError, KitError, KitTimeout, PeerError, Revoked
from kit.p2p.identity import PeerID
from kit.p2p.wire import Refusal

if TYPE_CHECKING:
    from kit.p2p.connection import Connection
    from kit.p2p.peer import Peer

logger = logging.getLogger(__name__)

#: Asks the remote side of a connection for its current access token (request: empty).
TOKEN_PROTOCOL = "kit/auth/1/token"
TOKEN_REQUEST_TIMEOUT = 10.0  # seconds one token request may take


class GuardedAuthorizer(Protocol):
    """What the guard reads of its authorizer (``kit.auth.authorizer.AllowlistAuthorizer``)."""

    authority_public_key: bytes
    clock_skew: float
    refresh_before: float

    def clock(self) -> float: ...

    def keep_fresh(self) -> None: ...

    def update_revocations(self, revocations: RevocationList) -> bool: ...

    def check_token_revoked(
        self, token: AccessToken, peer_public_key: bytes, now: float, *, run_id: str | None = None
    ) -> None: ...

    async def credentials(self) -> bytes: ...


class SessionGuard:
    """Checks one peer's connections against bans and token lifetimes (see the module docstring).

    Created by :meth:`AllowlistAuthorizer.attach`; :meth:`run` is a task the peer owns.

    Args:
        peer: the running peer whose connections to check.
        authorizer: its authorizer (the list, this peer's own token, clock and clock skew).
        period: seconds between checks. Decrease this if banned peers stay connected too long.
    """

    def __init__(self, peer: Peer, authorizer: GuardedAuthorizer, *, period: float) -> None:
        self.peer = peer
        self.authorizer = authorizer
        self.period = period
        self.run_id = peer.options.run_id
        #: Reads the newest revocation list (from the DHT); None until a DHT node is attached.
        self.fetch: Callable[[], Awaitable[RevocationList | None]] | None = None
        self.fetch_through: object | None = None  # the DHT node ``fetch`` reads through
        self._renewed: dict[PeerID, AccessToken] = {}  # newer tokens that remote peers sent
        self._asking: set[PeerID] = set()
        self.checks = 0  # completed checks (diagnostics, tests)
        peer.add_unary_handler(TOKEN_PROTOCOL, self._serve_token, max_request=64)

    async def run(self) -> None:
        while True:
            try:
                await self.check()
            except Exception:  # a bug here must not end the checks for good: say it, go on
                logger.exception("the session check of %s failed", self.peer.peer_id.short())
            await asyncio.sleep(self.period)

    async def check(self) -> list[PeerID]:
        """One round of the checks; returns the peers whose connections it closed."""
        if self.fetch is not None:
            try:
                found = await asyncio.wait_for(self.fetch(), self.period)
                if found is not None:
                    self.authorizer.update_revocations(found)
            except (KitError, asyncio.TimeoutError) as e:
                logger.warning("could not read the revocation list of %r: %s", self.run_id, e)
        self.authorizer.keep_fresh()
        closed = self.enforce()
        self.checks += 1
        return closed

    def enforce(self) -> list[PeerID]:
        """Close the connections of banned users and keys and of expired tokens (no I/O wait)."""
        now = self.authorizer.clock()
        skew = self.authorizer.clock_skew
        closed = []
        connected = set()
        for connection in self.peer.all_connections():
            remote = connection.remote_peer
            connected.add(remote)
            token = self.token_of(connection)
            if token is None:
                continue  # not admitted with a token (never happens with this authorizer)
            try:
                self.authorizer.check_token_revoked(token, connection.remote.public_key, now)
            except Revoked as e:
                self._close(connection, str(e))
                closed.append(remote)
                continue
            left = token.expiration_time - now
            if left < -skew:
                self._close(
                    connection,
                    f"the access token of user {token.username!r} expired {-left:.0f} s ago and "
                    "was not renewed - help: the peer reconnects with a new token when it gets one",
                )
                closed.append(remote)
            elif left < self.authorizer.refresh_before / 2 and remote not in self._asking:
                self._asking.add(remote)
                self.peer.spawn(self._ask_for_token(connection), "token-renewal")
        for stale in set(self._renewed) - connected:
            del self._renewed[stale]
        return closed

    def token_of(self, connection: Connection) -> AccessToken | None:
        """The newest token this peer holds for ``connection``'s remote (renewed or from the
        handshake)."""
        renewed = self._renewed.get(connection.remote_peer)
        if renewed is not None:
            return renewed
        try:
            return AccessToken.from_bytes(connection.remote.credentials)
        except AuthError:
            return None

    def _close(self, connection: Connection, reason: str) -> None:
        logger.info("closing the connection to %s: %s", connection.remote_peer.short(), reason)
        connection.close(Refusal.AUTH, reason)
        self._renewed.pop(connection.remote_peer, None)

    async def _ask_for_token(self, connection: Connection) -> None:
        remote = connection.remote_peer
        try:
            stream = await connection.open_stream(TOKEN_PROTOCOL)
            try:
                await stream.send_message(b"", timeout=TOKEN_REQUEST_TIMEOUT)
                await stream.close()
                data = await stream.receive_message(
                    max_size=MAX_TOKEN_BYTES, timeout=TOKEN_REQUEST_TIMEOUT
                )
            except BaseException:
                stream.reset()
                raise
            if data is None:
                raise AuthError(f"{remote.short()} closed the token request without a token")
            token = AccessToken.from_bytes(data)
            verify_token(
                token,
                self.authorizer.authority_public_key,
                now=self.authorizer.clock(),
                clock_skew=self.authorizer.clock_skew,
                peer_public_key=connection.remote.public_key,
                run_id=connection.remote.run_id,
            )
            held = self.token_of(connection)
            if held is None or token.expiration_time > held.expiration_time:
                self._renewed[remote] = token
                logger.debug(
                    "%s renewed its token until %.0f", remote.short(), token.expiration_time
                )
        except (AuthError, PeerError, KitTimeout) as e:
            logger.debug("no renewed token from %s: %s", remote.short(), e)
        finally:
            self._asking.discard(remote)

    async def _serve_token(self, caller: PeerID, request: bytes) -> bytes:
        """This peer's current token, for a remote side whose copy is about to expire."""
        return await self.authorizer.credentials()
