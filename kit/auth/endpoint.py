"""The token endpoint: ``GET /api/token`` on the coordinator, and the volunteer's client for it.

A volunteer's peer asks the coordinator for an access token::

    GET /api/token?peer_public_key=<base58 Ed25519 key>
    Authorization: Bearer <Hugging Face user access token>

    200 {"token": <base64 msgpack AccessToken>, "authority_public_key": <base58>,
         "run_id": ..., "username": ..., "expires_at": <Unix time>}
    400 / 401 / 403 / 503 {"error": <code>, "message": <what happened - help: what to do>}

The coordinator asks the Hub who owns the HF token (``whoami``, in a thread, with a timeout),
checks the allowlist and the revocation list, and signs a token for that user and peer key. The
endpoint is a plain HTTP route on the coordinator peer's own port (``Peer.add_http_route``), so
it shares the peer's TLS certificate: serve ``wss://`` (``tls_certfile``/``tls_keyfile``) and
the endpoint is ``https://``.

**Where the HF token goes.** The volunteer's HF token leaves their machine only in this request,
to the coordinator URL they were given, which passes it on to the Hub's ``whoami`` and forgets
it (only a SHA-256 of it is kept, for a short whoami cache). It is never logged, never stored on
disk by kit, never sent to other peers: the handshake carries the signed access token, not the
HF token. :class:`HttpTokenSource` refuses plain ``http://`` to a non-loopback host unless told
otherwise, and a *read* token is all the coordinator needs, so use one.

What this module does not do: token format (``kit.auth.tokens``), allowlist and signing
(``kit.auth.authority``), the handshake hook (``kit.auth.authorizer``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import ipaddress
import json
import logging
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kit.auth.authority import Allowlist, HubUser, TokenIssuer, hub_user
from kit.auth.authorizer import AllowlistAuthorizer
from kit.auth.tokens import AccessToken
from kit.errors import (
    AuthError,
    BadSignature,
    ConfigError,
    InvalidHubToken,
    MalformedToken,
    NotAllowlisted,
    Revoked,
    TokenServiceUnavailable,
)
from kit.p2p.identity import PUBLIC_KEY_SIZE, Identity, b58decode, b58encode
from kit.p2p.peer import HttpRequest, HttpResponse, Peer

logger = logging.getLogger(__name__)

TOKEN_PATH = "/api/token"
MAX_HF_TOKEN = 512
MAX_RESPONSE_BYTES = 64 * 1024
#: HTTP status and error code for each refusal, so that the client can raise the same type.
_STATUS = {
    InvalidHubToken: (401, "invalid_hf_token"),
    NotAllowlisted: (403, "not_allowlisted"),
    Revoked: (403, "revoked"),
    TokenServiceUnavailable: (503, "hub_unavailable"),
}
_ERRORS: dict[str, type[AuthError]] = {code: kind for kind, (_, code) in _STATUS.items()}


def _error(status: int, code: str, message: str) -> HttpResponse:
    body = json.dumps({"error": code, "message": message}).encode()
    return HttpResponse(status, body, headers=(("Cache-Control", "no-store"),))


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
        whoami_cache_ttl: float = 60.0,
        max_concurrent_whoami: int = 4,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not whoami_timeout > 0 or whoami_cache_ttl < 0 or max_concurrent_whoami < 1:
            raise ConfigError(
                "TokenEndpoint: whoami_timeout > 0, whoami_cache_ttl >= 0 and "
                "max_concurrent_whoami >= 1 - help: keep the defaults"
            )
        self.issuer = issuer
        self.allowlist = allowlist
        self.hf_endpoint = hf_endpoint
        self.whoami_timeout = whoami_timeout
        self.whoami_cache_ttl = whoami_cache_ttl
        self._clock = clock
        self._whoami_slots = asyncio.Semaphore(max_concurrent_whoami)
        self._known: OrderedDict[bytes, tuple[HubUser, float]] = OrderedDict()

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
        try:
            user = await self._whoami(hf_token)
            self.allowlist.check(user)
            token = self.issuer.issue(user.username, peer_public_key, now=self._clock())
        except tuple(_STATUS) as e:
            status, code = next(_STATUS[kind] for kind in _STATUS if isinstance(e, kind))
            logger.info("token refused to %s (%s): %s", request.remote_host, code, e)
            return _error(status, code, str(e))
        logger.info(
            "issued a token to %r for peer key %s… from %s",
            user.username,
            b58encode(peer_public_key)[:8],
            request.remote_host,
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

    async def _whoami(self, hf_token: str) -> HubUser:
        # Keyed by a hash: the HF token itself is never kept. The cache spares the Hub's
        # rate-limited whoami when a peer renews its token or retries.
        key = hashlib.sha256(hf_token.encode()).digest()
        now = self._clock()
        known = self._known.get(key)
        if known is not None and now - known[1] < self.whoami_cache_ttl:
            return known[0]
        async with self._whoami_slots:
            try:
                user = await asyncio.wait_for(
                    asyncio.to_thread(hub_user, hf_token, endpoint=self.hf_endpoint),
                    self.whoami_timeout,
                )
            except asyncio.TimeoutError:
                raise TokenServiceUnavailable(
                    f"the Hugging Face Hub did not answer whoami within {self.whoami_timeout} s "
                    "- help: retry in a minute"
                ) from None
        if self.whoami_cache_ttl > 0:
            self._known[key] = (user, now)
            while len(self._known) > 1024:
                self._known.popitem(last=False)
        return user


def _bearer(header: str) -> str | None:
    scheme, _, value = header.strip().partition(" ")
    value = value.strip()
    if scheme.lower() != "bearer" or not 0 < len(value) <= MAX_HF_TOKEN:
        return None
    if not value.isascii() or not value.isprintable() or " " in value:
        return None
    return value


class _RedactAuthorization(logging.Filter):
    """Hides the value of Authorization headers in websockets' DEBUG logs of HTTP requests
    (``"< %s: %s"``, header name and value): with DEBUG logging on, the coordinator would
    otherwise write every volunteer's HF token to its log."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if (
            isinstance(args, tuple)
            and len(args) == 2
            and isinstance(args[0], str)
            and args[0].lower() in ("authorization", "proxy-authorization")
        ):
            record.args = (args[0], "<redacted>")
        return True


def _redact_server_logs() -> None:
    server_logger = logging.getLogger("websockets.server")  # what kit.p2p.peer's server logs to
    if not any(isinstance(f, _RedactAuthorization) for f in server_logger.filters):
        server_logger.addFilter(_RedactAuthorization())


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
            slow link), ``whoami_cache_ttl``, ``max_concurrent_whoami``, ``clock``.

    Returns:
        The endpoint (change ``endpoint.allowlist`` to update the allowlist live).
    """
    _redact_server_logs()
    endpoint = TokenEndpoint(issuer, allowlist, hf_endpoint=hf_endpoint, **settings)
    peer.add_http_route(path, endpoint.handle)
    return endpoint


# --- the volunteer's client -------------------------------------------------------------------


@dataclass(frozen=True)
class TokenResponse:
    """What the token endpoint answered (the token is decoded, not yet verified)."""

    token: AccessToken
    authority_public_key: bytes  # raw 32 bytes
    run_id: str
    username: str
    expires_at: float


class HttpTokenSource:
    """A token source that asks the coordinator's token endpoint (what volunteers use).

    Args:
        coordinator_url: the coordinator's URL as the organizer published it, e.g.
            ``https://coordinator.example.org:31337`` (``ws(s)://`` URLs are accepted too).
        hf_token: the volunteer's Hugging Face user access token (read role is enough). Sent
            only to ``coordinator_url``; never logged.
        timeout: seconds one request may take; increase this on slow links.
        ssl_context: for ``https://`` with a private CA (default: the system's CAs).
        allow_insecure_http: allow ``http://`` to a host that is not this machine. The HF token
            would cross the network unencrypted: only on a network you trust.

    Raises:
        ConfigError: a malformed URL, or plain http to a remote host without the flag.
    """

    def __init__(
        self,
        coordinator_url: str,
        hf_token: str,
        *,
        timeout: float = 15.0,
        ssl_context: ssl.SSLContext | None = None,
        allow_insecure_http: bool = False,
    ) -> None:
        self.url = _token_url(coordinator_url, allow_insecure_http)
        self._hf_token = hf_token
        self.timeout = timeout
        self.ssl_context = ssl_context
        self.last_response: TokenResponse | None = None

    def __repr__(self) -> str:  # never show the HF token
        return f"HttpTokenSource({self.url!r})"

    async def __call__(self, peer_public_key: bytes) -> AccessToken:
        return (await self.request(peer_public_key)).token

    async def request(self, peer_public_key: bytes) -> TokenResponse:
        """Ask for a token for ``peer_public_key``.

        Raises:
            InvalidHubToken (401), NotAllowlisted / Revoked (403): refused, with the
            coordinator's message. TokenServiceUnavailable: unreachable, timeout, 5xx.
            MalformedToken: the answer is not a token endpoint's answer.
        """
        query = urllib.parse.urlencode({"peer_public_key": b58encode(peer_public_key)})
        try:
            # urllib bounds each socket operation by ``timeout``; this bounds the whole request.
            status, body = await asyncio.wait_for(
                asyncio.to_thread(self._get, f"{self.url}?{query}"), self.timeout + 5.0
            )
        except asyncio.TimeoutError:
            raise TokenServiceUnavailable(
                f"no answer from the token endpoint {self.url} within {self.timeout} s - help: "
                "check the coordinator URL and that the coordinator is running"
            ) from None
        response = _decode_answer(status, body, self.url)
        self.last_response = response
        return response

    def _get(self, url: str) -> tuple[int, bytes]:
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {self._hf_token}"})
        handlers: list[urllib.request.BaseHandler] = []
        if _is_loopback(urllib.parse.urlsplit(url).hostname or ""):
            handlers.append(urllib.request.ProxyHandler({}))  # never via a proxy to ourselves
        if self.ssl_context is not None:
            handlers.append(urllib.request.HTTPSHandler(context=self.ssl_context))
        opener = urllib.request.build_opener(*handlers)
        try:
            with opener.open(request, timeout=self.timeout) as answer:
                return answer.status, answer.read(MAX_RESPONSE_BYTES)
        except urllib.error.HTTPError as e:
            return e.code, e.read(MAX_RESPONSE_BYTES)
        except (OSError, ValueError) as e:  # URLError, timeouts, TLS failures, refused
            raise TokenServiceUnavailable(
                f"cannot reach the token endpoint {self.url}: {type(e).__name__}: "
                f"{getattr(e, 'reason', e)} - help: check the coordinator URL (https://host:port) "
                "and your connection; kit retries by itself"
            ) from None


def _token_url(coordinator_url: str, allow_insecure_http: bool) -> str:
    parts = urllib.parse.urlsplit(coordinator_url.strip())
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme)
    if scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            f"coordinator_url {coordinator_url!r} is not an http(s) URL - help: use the URL the "
            "organizer published, e.g. https://coordinator.example.org:31337"
        )
    if scheme == "http" and not allow_insecure_http and not _is_loopback(parts.hostname):
        raise ConfigError(
            f"coordinator_url {coordinator_url!r} is plain http: your Hugging Face token would "
            "cross the network unencrypted - help: use the coordinator's https:// URL, or pass "
            "allow_insecure_http=True on a network you trust"
        )
    return urllib.parse.urlunsplit((scheme, parts.netloc, TOKEN_PATH, "", ""))


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _decode_answer(status: int, body: bytes, url: str) -> TokenResponse:
    try:
        answer = json.loads(body)
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        answer = {}
    if status != 200:
        message = str(answer.get("message", ""))[:2000] or f"HTTP {status} from {url}"
        kind = _ERRORS.get(str(answer.get("error", "")))
        if kind is not None:
            raise kind(message)
        if status >= 500:
            raise TokenServiceUnavailable(f"{message} - help: retry later")
        raise AuthError(f"the token endpoint refused the request: {message}")
    try:
        token = AccessToken.from_bytes(base64.b64decode(answer["token"], validate=True))
        authority = b58decode(answer["authority_public_key"])
        response = TokenResponse(
            token,
            authority,
            str(answer["run_id"]),
            str(answer["username"]),
            float(answer["expires_at"]),
        )
    except (KeyError, TypeError, ValueError, binascii.Error) as e:
        raise MalformedToken(
            f"{url} did not answer like a kit token endpoint ({type(e).__name__}) - help: check "
            "the coordinator URL"
        ) from None
    if len(authority) != PUBLIC_KEY_SIZE:
        raise MalformedToken(f"{url} sent an authority key of {len(authority)} bytes")
    return response


async def authorizer_from_coordinator(
    coordinator_url: str,
    hf_token: str,
    identity: Identity,
    *,
    authority_public_key: bytes | None = None,
    timeout: float = 15.0,
    ssl_context: ssl.SSLContext | None = None,
    allow_insecure_http: bool = False,
    **settings: Any,
) -> AllowlistAuthorizer:
    """Get a first token from the coordinator and return a ready :class:`AllowlistAuthorizer`.

    Args:
        coordinator_url, hf_token, timeout, ssl_context, allow_insecure_http: see
            :class:`HttpTokenSource`.
        identity: this peer's identity (the token is bound to its public key).
        authority_public_key: the run's authority key as the organizer published it. None
            trusts the key the coordinator sends, which is only as safe as the connection to
            it: prefer passing it, or an ``https://`` URL.
        **settings: ``clock_skew``, ``refresh_before``, ``fetch_timeout`` of the authorizer.

    Raises:
        BadSignature: the coordinator's authority key is not ``authority_public_key``.
        InvalidHubToken, NotAllowlisted, Revoked, TokenServiceUnavailable: no token.
    """
    source = HttpTokenSource(
        coordinator_url,
        hf_token,
        timeout=timeout,
        ssl_context=ssl_context,
        allow_insecure_http=allow_insecure_http,
    )
    first = await source.request(identity.public_key)
    if authority_public_key is None:
        logger.info(
            "trusting authority key %s sent by %s",
            b58encode(first.authority_public_key),
            source.url,
        )
        authority_public_key = first.authority_public_key
    elif first.authority_public_key != authority_public_key:
        raise BadSignature(
            f"the coordinator at {source.url} signs with authority key "
            f"{b58encode(first.authority_public_key)}, not the published "
            f"{b58encode(authority_public_key)} - help: check the coordinator URL and the "
            "authority key with the organizer"
        )
    authorizer = AllowlistAuthorizer(identity, authority_public_key, source, **settings)
    authorizer.accept_token(first.token)
    return authorizer
