"""The volunteer's client of the token endpoint: an access token for an HF token.

:class:`HttpTokenSource` asks the coordinator's ``GET /api/token`` (``kit.auth.endpoint``) for a
token bound to this peer's key, and raises the same typed errors the endpoint refused with
(``429`` and ``503`` are transient: :class:`~kit.errors.TokenServiceUnavailable`, retried by
the authorizer). :func:`authorizer_from_coordinator` gets the first token and returns a ready
:class:`~kit.auth.authorizer.AllowlistAuthorizer`.

**Where the HF token goes.** Only in this request, to the coordinator URL the volunteer was given
(plain ``http://`` to another machine is refused unless explicitly allowed); never logged, never
stored on disk by kit, never sent to other peers.

What this module does not do: serving tokens (``kit.auth.endpoint``), checking them
(``kit.auth.tokens``, ``kit.auth.authorizer``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import ipaddress
import json
import logging
import ssl
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from kit.auth.authorizer import AllowlistAuthorizer
from kit.auth.endpoint import ERRORS, TOKEN_PATH
from kit.auth.tokens import AccessToken
from kit.errors import (
    AuthError,
    BadSignature,
    ConfigError,
    MalformedToken,
    TokenServiceUnavailable,
)
from kit.p2p.identity import PUBLIC_KEY_SIZE, Identity, b58decode, b58encode

logger = logging.getLogger(__name__)

MAX_RESPONSE_BYTES = 64 * 1024


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
        kind = ERRORS.get(str(answer.get("error", "")))
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
