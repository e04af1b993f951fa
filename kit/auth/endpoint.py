"""The token endpoint: ``GET /api/token`` on the coordinator (the client: ``token_client``).

A volunteer's peer asks the coordinator for an access token::

    GET /api/token?peer_public_key=<base58 Ed25519 key>
    Authorization: Bearer <Hugging Face user access token>

    200 {"token": <base64 msgpack AccessToken>, "authority_public_key": <base58>,
         "run_id": ..., "username": ..., "expires_at": <Unix time>}
    400 / 401 / 403 / 429 / 503 {"error": <code>, "message": <what happened - help: what to do>}

The coordinator asks the Hub who owns the HF token (``whoami``, in a thread, with a timeout),
checks the allowlist and the revocation list, and signs a token for that user and peer key.
What a login may cost the Hub is bounded (``kit.auth.login_limits``): answers are cached by the
HF token's SHA-256 (users for a token lifetime, refused tokens for 5 minutes), concurrent
requests for one HF token share one lookup, at most ``max_concurrent_whoami`` lookups run and
``max_waiting_whoami`` wait, and each client address (``X-Forwarded-For`` when the request
comes through a trusted reverse proxy) gets a burst of lookups, then a steady rate. Anything
over a limit is answered ``429`` with ``Retry-After``, without asking the Hub. The
endpoint is a plain HTTP route on the coordinator peer's own port (``Peer.add_http_route``), so
it shares the peer's TLS certificate: serve ``wss://`` (``tls_certfile``/``tls_keyfile``) and
the endpoint is ``https://``.

**Where the HF token goes.** The volunteer's HF token leaves their machine only in this request,
to the coordinator URL they were given, which passes it on to the Hub's ``whoami`` and forgets
it (only a SHA-256 of it is kept, for the whoami cache). It is never logged (``websockets``
never logs request headers either: ``kit.p2p.websockets_log``), never stored on disk by kit,
never sent to other peers: the handshake carries the signed access token, not the HF token.
The client (``kit.auth.token_client``) refuses plain ``http://`` to a non-loopback host unless
told otherwise, and a *read* token is all the coordinator needs, so use one.

What this module does not do: token format (``kit.auth.tokens``), allowlist and signing
(``kit.auth.authority``), the handshake hook (``kit.auth.authorizer``), the client.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import math
import time
from collections.abc import Callable
from typing import Any

from kit.auth.authority import Allowlist, HubUser, TokenIssuer, hub_user
from kit.auth.login_limits import LoginLimits, WhoamiCache
from kit.errors import (
    AuthError,
    ConfigError,
    InvalidHubToken,
    NotAllowlisted,
    Revoked,
    TokenServiceUnavailable,
)
from kit.p2p.identity import PUBLIC_KEY_SIZE, b58decode, b58encode
from kit.p2p.peer import Peer
from kit.p2p.transport import HttpRequest, HttpResponse

logger = logging.getLogger(__name__)

TOKEN_PATH = "/api/token"
MAX_HF_TOKEN = 512
#: HTTP status and error code for each refusal, so that the client can raise the same type.
_STATUS = {
    InvalidHubToken: (401, "invalid_hf_token"),
    NotAllowlisted: (403, "not_allowlisted"),
    Revoked: (403, "revoked"),
    TokenServiceUnavailable: (503, "hub_unavailable"),
}
#: Error code → the type the client raises (``kit.auth.token_client``).
ERRORS: dict[str, type[AuthError]] = {code: kind for kind, (_, code) in _STATUS.items()}
ERRORS["rate_limited"] = TokenServiceUnavailable  # 429: transient, retry after a while


#: Seconds a client is told to wait when every lookup slot and waiting place is taken.
BUSY_RETRY_AFTER = 5.0


def _error(status: int, code: str, message: str, retry_after: float | None = None) -> HttpResponse:
    body = json.dumps({"error": code, "message": message}).encode()
    headers: tuple[tuple[str, str], ...] = (("Cache-Control", "no-store"),)
    if retry_after is not None:
        headers += (("Retry-After", str(max(1, math.ceil(retry_after)))),)
    return HttpResponse(status, body, headers=headers)


class _Throttled(Exception):
    """A Hub lookup over a limit (answered 429; never leaves this module)."""

    def __init__(self, retry_after: float, why: str) -> None:
        super().__init__(why)
        self.retry_after = retry_after


class TokenEndpoint:
    """Answers ``GET /api/token``; create it with :func:`serve_token_endpoint`.

    ``allowlist`` is a public attribute: assign a new :class:`Allowlist` to change who may join
    while the run goes on (tokens already issued stay valid until they expire; revoke to cut
    them short).
    """

    def __init__(
        self,
        issuer: TokenIssuer,
        allowlist: Allowlist,
        *,
        hf_endpoint: str | None = None,
        whoami_timeout: float = 10.0,
        whoami_cache_ttl: float | None = None,
        invalid_cache_ttl: float = 300.0,
        max_concurrent_whoami: int = 4,
        max_waiting_whoami: int = 16,
        limits: LoginLimits | None = None,
        trusted_proxies: tuple[str, ...] = ("127.0.0.1", "::1"),
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not whoami_timeout > 0 or max_concurrent_whoami < 1 or max_waiting_whoami < 0:
            raise ConfigError(
                "TokenEndpoint: whoami_timeout > 0, max_concurrent_whoami >= 1 and "
                "max_waiting_whoami >= 0 - help: keep the defaults"
            )
        self.issuer = issuer
        self.allowlist = allowlist
        self.hf_endpoint = hf_endpoint
        self.whoami_timeout = whoami_timeout
        self.cache = WhoamiCache(
            issuer.lifetime if whoami_cache_ttl is None else whoami_cache_ttl, invalid_cache_ttl
        )
        self.limits = limits or LoginLimits()
        self.trusted_proxies = frozenset(trusted_proxies)
        self.max_pending = max_concurrent_whoami + max_waiting_whoami
        self._clock = clock
        self._whoami_slots = asyncio.Semaphore(max_concurrent_whoami)
        self._pending = 0  # lookups running or waiting for a slot
        self._lookups: dict[bytes, asyncio.Future[HubUser]] = {}  # by HF token digest

    @property
    def whoami_cache_ttl(self) -> float:
        """Seconds a user's whoami answer is reused (default: the token lifetime)."""
        return self.cache.valid_ttl

    @whoami_cache_ttl.setter
    def whoami_cache_ttl(self, value: float) -> None:
        self.cache.valid_ttl = value

    async def handle(self, request: HttpRequest) -> HttpResponse:
        """One token request (never raises: every refusal is a JSON error answer)."""
        hf_token = _bearer(request.headers.get("authorization", ""))
        if hf_token is None:
            return _error(
                401,
                "missing_hf_token",
                "send your Hugging Face access token as 'Authorization: Bearer hf_...' - help: "
                "join with kit's allowlist authorizer, which sends it for you",
            )
        try:
            peer_public_key = b58decode(request.query.get("peer_public_key", ""))
        except ValueError:
            peer_public_key = b""
        if len(peer_public_key) != PUBLIC_KEY_SIZE:
            return _error(
                400,
                "bad_peer_key",
                "query parameter peer_public_key must be a base58 Ed25519 public key - help: "
                "upgrade kit on the volunteer's machine",
            )
        client = self._client(request)
        try:
            user = await self._whoami(hf_token, client)
            self.allowlist.check(user)
            token = self.issuer.issue(user.username, peer_public_key, now=self._clock())
        except _Throttled as e:
            logger.debug("token request from %s throttled: %s", client, e)
            return _error(
                429,
                "rate_limited",
                f"{e} - help: retry in {math.ceil(e.retry_after)} s (kit retries by itself)",
                retry_after=e.retry_after,
            )
        except tuple(_STATUS) as e:
            status, code = next(_STATUS[kind] for kind in _STATUS if isinstance(e, kind))
            logger.info("token refused to %s (%s): %s", client, code, e)
            return _error(status, code, str(e))
        logger.info(
            "issued a token to %r for peer key %s… from %s",
            user.username,
            b58encode(peer_public_key)[:8],
            client,
        )
        body = {
            "token": base64.b64encode(token.to_bytes()).decode(),
            "authority_public_key": b58encode(self.issuer.authority_public_key),
            "run_id": token.run_id,
            "username": token.username,
            "expires_at": token.expiration_time,
        }
        return HttpResponse(
            200, json.dumps(body).encode(), headers=(("Cache-Control", "no-store"),)
        )

    def _client(self, request: HttpRequest) -> str:
        """Who asks: the remote address, or the last hop a trusted reverse proxy names."""
        if request.remote_host in self.trusted_proxies:
            forwarded = request.headers.get("x-forwarded-for", "").split(",")[-1].strip()
            if forwarded:
                return forwarded[:64]
        return request.remote_host

    async def _whoami(self, hf_token: str, client: str) -> HubUser:
        # Keyed by a hash: the HF token itself is never kept.
        digest = hashlib.sha256(hf_token.encode()).digest()
        known = self.cache.get(digest, self._clock())
        if isinstance(known, HubUser):
            return known
        if known is not None:
            raise InvalidHubToken(str(known))
        lookup = self._lookups.get(digest)
        if lookup is None:  # requests for one HF token share one lookup
            wait = self.limits.admit(client, self._clock())
            if wait > 0:
                raise _Throttled(wait, f"too many logins from {client}")
            if self._pending >= self.max_pending:
                raise _Throttled(BUSY_RETRY_AFTER, "too many logins at once")
            self._pending += 1  # counted now: many requests are checked before lookups start
            lookup = asyncio.ensure_future(self._lookup(hf_token, digest))
            self._lookups[digest] = lookup
            lookup.add_done_callback(lambda _: self._lookup_done(digest))
        return await asyncio.shield(lookup)  # one caller giving up does not cancel the others'

    def _lookup_done(self, digest: bytes) -> None:
        self._pending -= 1
        self._lookups.pop(digest, None)

    async def _lookup(self, hf_token: str, digest: bytes) -> HubUser:
        async with self._whoami_slots:
            try:
                user = await asyncio.wait_for(
                    asyncio.to_thread(hub_user, hf_token, endpoint=self.hf_endpoint),
                    self.whoami_timeout,
                )
            except asyncio.TimeoutError:
                raise TokenServiceUnavailable(
                    f"the Hugging Face Hub did not answer whoami within "
                    f"{self.whoami_timeout} s - help: retry in a minute"
                ) from None
            except InvalidHubToken as e:
                self.cache.put(digest, e, self._clock())
                raise
        self.cache.put(digest, user, self._clock())
        return user


def _bearer(header: str) -> str | None:
    scheme, _, value = header.strip().partition(" ")
    value = value.strip()
    if scheme.lower() != "bearer" or not 0 < len(value) <= MAX_HF_TOKEN:
        return None
    if not value.isascii() or not value.isprintable() or " " in value:
        return None
    return value


def serve_token_endpoint(
    peer: Peer,
    issuer: TokenIssuer,
    allowlist: Allowlist,
    *,
    hf_endpoint: str | None = None,
    path: str = TOKEN_PATH,
    **settings: Any,
) -> TokenEndpoint:
    """Serve ``GET /api/token`` on the coordinator peer's listening port.

    Args:
        peer: the coordinator's running peer (serve it with TLS on the Internet).
        issuer: the run's authority.
        allowlist: who may get tokens.
        hf_endpoint: the Hub to ask; None = ``$HF_ENDPOINT`` (read at each request) or
            https://huggingface.co.
        path: the route (keep the default: clients ask for ``/api/token``).
        **settings: ``whoami_timeout`` (increase this if you see hub_unavailable errors on a
            slow link), ``whoami_cache_ttl`` (default: the token lifetime),
            ``invalid_cache_ttl``, ``max_concurrent_whoami``, ``max_waiting_whoami``,
            ``limits`` (a :class:`~kit.auth.login_limits.LoginLimits`; raise its per-client
            burst if volunteers behind one address get 429 together), ``trusted_proxies``
            (addresses whose ``X-Forwarded-For`` names the client), ``clock``.

    Returns:
        The endpoint (change ``endpoint.allowlist`` to update the allowlist live).
    """
    endpoint = TokenEndpoint(issuer, allowlist, hf_endpoint=hf_endpoint, **settings)
    peer.add_http_route(path, endpoint.handle)
    return endpoint
