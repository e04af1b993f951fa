"""Access tokens: what the run's authority signs, how it travels, how it is checked (pure).

An :class:`AccessToken` says "HF user ``username`` may take part in run ``run_id`` with the peer
key ``peer_public_key`` until ``expiration_time``", signed by the run's authority key (an Ed25519
:class:`~kit.p2p.identity.Identity` held by the coordinator). A peer presents it in its handshake
hello; the other side checks it (:func:`verify_token`). Binding the token to the peer's public key
is what makes a stolen token useless: the handshake already proves that the presenter holds the
private key behind its public key, and the token names exactly one public key (the same design
as hivemind's ``AccessToken``, DeDLOC §3.3 / hivemind-api §2.6, with Ed25519 instead of RSA).

Wire format: one msgpack map ``{"v": 1, "user", "pk", "run", "exp", "sig"}``, no pickle, decoded
strictly (exact key set, exact types, size limits) into :class:`~kit.errors.MalformedToken`.
The signature covers ``TOKEN_DOMAIN || msgpack([user, pk, run, exp])``: the domain prefix keeps
an access-token signature from ever being valid as another kit signature (handshake transcripts,
DHT records, revocation lists) made with the same key.

What this module does not do: deciding who gets a token (``kit.auth.authority``), the handshake
hook (``kit.auth.authorizer``), revocation (``kit.auth.revocation``). It reads no clock: every
check takes ``now``.

Over HTTP (the coordinator's data routes in private runs) the same token travels as a bearer
header, ``Authorization: Bearer <base64url of to_bytes()>`` (:func:`bearer_header`,
:func:`token_from_bearer`). HTTP has no proof of key possession, so there the token is not
bound to its presenter: whoever holds a copy may use it until it expires.
"""

from __future__ import annotations

import base64
import binascii
import math
import re
from dataclasses import dataclass
from typing import Any

import msgpack

from kit.errors import BadSignature, MalformedToken, MissingToken, TokenExpired, TokenMismatch
from kit.p2p.identity import (
    PUBLIC_KEY_SIZE,
    SIGNATURE_SIZE,
    Identity,
    PeerID,
    b58encode,
    verify_signature,
)

TOKEN_DOMAIN = b"kit-access-token/1\0"
TOKEN_VERSION = 1
#: A token is ~200 bytes; anything much larger is not one (handshake credentials allow 16 KiB).
MAX_TOKEN_BYTES = 1024
MAX_RUN_ID = 256
#: Hub user and org names (letters, digits, ``-_.``, at most 96 characters). Names kit gives
#: itself start with "@", which no Hub name can, so they never collide with a real user.
NAME_PATTERN = re.compile(r"^@?[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
#: The scheme of the HTTP ``Authorization`` header that carries a token.
BEARER_SCHEME = "Bearer"
#: Longest accepted ``Authorization`` value: the scheme plus base64url of MAX_TOKEN_BYTES.
MAX_BEARER_CHARS = len(BEARER_SCHEME) + 1 + 4 * (MAX_TOKEN_BYTES + 2) // 3
_BASE64URL = re.compile(r"^[A-Za-z0-9_-]+={0,2}$")
_TOKEN_KEYS = frozenset({"v", "user", "pk", "run", "exp", "sig"})


def _reject_extension(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not allowed here")


def unpack_strict(data: bytes, what: str, max_bytes: int) -> Any:
    """Decode msgpack that came from elsewhere: plain data only, within ``max_bytes``.

    Raises:
        MalformedToken: too large, not msgpack, trailing bytes, extension types.
    """
    if not isinstance(data, (bytes, bytearray)):
        raise MalformedToken(f"{what} must be bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise MalformedToken(f"{what} is {len(data)} bytes, more than the limit of {max_bytes}")
    try:
        return msgpack.unpackb(
            bytes(data),
            raw=False,
            strict_map_key=True,
            ext_hook=_reject_extension,
        )
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise MalformedToken(f"{what} is not valid msgpack ({type(e).__name__})") from None


def check_fields(body: Any, what: str, schema: dict[str, type]) -> dict[str, Any]:
    """A decoded map with exactly the keys of ``schema``, each of its exact type."""
    if not isinstance(body, dict) or set(body) != set(schema):
        keys = sorted(map(str, body)) if isinstance(body, dict) else type(body).__name__
        raise MalformedToken(f"{what} must be a map with keys {sorted(schema)}, got {keys}")
    for key, expected in schema.items():
        value = body[key]
        if type(value) is not expected:  # exact: no bool for int, no int for float
            raise MalformedToken(f"{what}: field {key!r} has type {type(value).__name__}")
    return body


def check_name(name: str, what: str) -> None:
    if not NAME_PATTERN.match(name):
        raise MalformedToken(f"{what}: {name[:100]!r} is not a Hub user or org name")


@dataclass(frozen=True)
class AccessToken:
    """A signed permission for one user, one peer key and one run, until an expiration time.

    Create tokens with :meth:`sign` (the coordinator's :class:`~kit.auth.authority.TokenIssuer`
    does); read received ones with :meth:`from_bytes` and check them with :func:`verify_token`.
    """

    username: str  # the Hugging Face user name proved at the token endpoint
    peer_public_key: bytes  # raw 32-byte Ed25519 key of the one peer that may present it
    run_id: str  # the run it admits to (peers of other runs are refused anyway)
    expiration_time: float  # absolute Unix time (seconds) after which it is no longer valid
    signature: bytes = b""  # the authority's Ed25519 signature of signed_payload()

    @classmethod
    def sign(
        cls,
        authority: Identity,
        username: str,
        peer_public_key: bytes,
        run_id: str,
        expiration_time: float,
    ) -> AccessToken:
        """The token for these fields, signed by ``authority``.

        Raises:
            MalformedToken: a field is out of range (bad name, key size, run id, time).
        """
        unsigned = cls(username, peer_public_key, run_id, float(expiration_time))
        unsigned._check_fields()
        signature = authority.sign(unsigned.signed_payload())
        return cls(username, peer_public_key, run_id, float(expiration_time), signature)

    def signed_payload(self) -> bytes:
        """The bytes the authority signs: domain prefix, then the fields in a fixed order."""
        fields = [self.username, self.peer_public_key, self.run_id, self.expiration_time]
        return TOKEN_DOMAIN + msgpack.packb(fields, use_bin_type=True)

    @property
    def peer_id(self) -> PeerID:
        """The PeerID of the one peer this token admits."""
        return PeerID.from_public_key(self.peer_public_key)

    def to_bytes(self) -> bytes:
        """The wire form: a msgpack map (what travels in the handshake hello)."""
        body = {
            "v": TOKEN_VERSION,
            "user": self.username,
            "pk": self.peer_public_key,
            "run": self.run_id,
            "exp": self.expiration_time,
            "sig": self.signature,
        }
        return msgpack.packb(body, use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes) -> AccessToken:
        """Decode a token that came from a peer or a server (its signature is NOT checked here).

        Raises:
            MalformedToken: not a kit access token (shape, types, sizes, version).
        """
        body = unpack_strict(data, "access token", MAX_TOKEN_BYTES)
        schema = {"v": int, "user": str, "pk": bytes, "run": str, "exp": float, "sig": bytes}
        check_fields(body, "access token", schema)
        if body["v"] != TOKEN_VERSION:
            raise MalformedToken(
                f"access token of version {body['v']}, this kit reads version {TOKEN_VERSION} - "
                "help: upgrade kit on the older side (pip install -U kit-collab)"
            )
        token = cls(body["user"], body["pk"], body["run"], body["exp"], body["sig"])
        token._check_fields()
        if len(token.signature) != SIGNATURE_SIZE:
            raise MalformedToken(f"access token signature of {len(token.signature)} bytes")
        return token

    def _check_fields(self) -> None:
        check_name(self.username, "access token user")
        if len(self.peer_public_key) != PUBLIC_KEY_SIZE:
            raise MalformedToken(f"access token peer key of {len(self.peer_public_key)} bytes")
        if not 0 < len(self.run_id) <= MAX_RUN_ID:
            raise MalformedToken(f"access token run id of {len(self.run_id)} characters")
        if not (math.isfinite(self.expiration_time) and self.expiration_time > 0):
            raise MalformedToken(f"access token expiration {self.expiration_time!r}")

    def __repr__(self) -> str:  # short, and without the signature
        return (
            f"AccessToken({self.username!r}, peer {self.peer_id.short()}, run {self.run_id!r}, "
            f"expires {self.expiration_time:.0f})"
        )


def verify_token(
    token: AccessToken,
    authority_public_key: bytes,
    *,
    now: float,
    clock_skew: float = 60.0,
    peer_public_key: bytes | None = None,
    run_id: str | None = None,
) -> None:
    """Check a token's signature, binding and expiry; return None if it admits its holder.

    Args:
        token: a decoded token.
        authority_public_key: the run's authority key (raw 32 bytes).
        now: the current Unix time.
        clock_skew: seconds by which clocks of two machines may disagree; a token is still
            accepted this long after its expiration. Increase this if you see TokenExpired
            right after joining on machines with a wrong clock.
        peer_public_key: the key the presenter proved it holds; None = do not check.
        run_id: the run the presenter takes part in; None = do not check.

    Raises:
        BadSignature: not signed by this authority (forged, or from another run's coordinator).
        TokenMismatch: issued for another peer key (stolen) or another run.
        TokenExpired: expired more than ``clock_skew`` seconds ago.
    """
    if not verify_signature(authority_public_key, token.signature, token.signed_payload()):
        raise BadSignature(
            f"the access token of user {token.username!r} is not signed by this run's authority "
            f"{b58encode(authority_public_key)[:12]}… (forged, or issued by another coordinator) "
            "- help: get a token from this run's coordinator (its token endpoint), and check "
            "that coordinator URL and authority key are the ones the organizer published"
        )
    if peer_public_key is not None and token.peer_public_key != peer_public_key:
        raise TokenMismatch(
            f"the access token of user {token.username!r} was issued to peer "
            f"{token.peer_id.short()}, not to {PeerID.from_public_key(peer_public_key).short()} "
            "(a token works only for the peer key it names) - help: each peer gets its own "
            "token from the coordinator; do not copy tokens between machines"
        )
    if run_id is not None and token.run_id != run_id:
        raise TokenMismatch(
            f"the access token of user {token.username!r} is for run {token.run_id!r}, not "
            f"{run_id!r} - help: get a token from the coordinator of run {run_id!r}"
        )
    if now > token.expiration_time + clock_skew:
        raise TokenExpired(
            f"the access token of user {token.username!r} expired "
            f"{now - token.expiration_time:.0f} s ago (clock_skew allows {clock_skew:.0f} s) - "
            "help: tokens refresh by themselves; if this repeats right after joining, a clock is "
            "wrong: sync it (NTP), or raise clock_skew"
        )


def bearer_header(token: AccessToken) -> str:
    """The value of an HTTP ``Authorization`` header that presents ``token``."""
    return f"{BEARER_SCHEME} {base64.urlsafe_b64encode(token.to_bytes()).decode('ascii')}"


def token_from_bearer(header: str | None) -> AccessToken:
    """Decode the token of an ``Authorization: Bearer ...`` header (its signature NOT checked).

    The header's size is checked before anything is decoded.

    Raises:
        MissingToken: no header (or an empty one).
        MalformedToken: too long, another scheme, not base64url, or not a kit access token.
    """
    if header is None or not header.strip():
        raise MissingToken(
            "no access token: this run's data is for allowlisted users only - help: join with "
            "your Hugging Face token (kit join URL --hf-token ...), or check the run with "
            "kit preflight URL --hf-token ..."
        )
    if len(header) > MAX_BEARER_CHARS:
        raise MalformedToken(
            f"the Authorization header has {len(header)} characters, more than the "
            f"{MAX_BEARER_CHARS} of an access token - help: send the token kit's login gave you"
        )
    scheme, _, value = header.strip().partition(" ")
    value = value.strip()
    if scheme.lower() != BEARER_SCHEME.lower() or not _BASE64URL.match(value):
        raise MalformedToken(
            "the Authorization header is not 'Bearer <base64url access token>' - help: send "
            "the token kit's login gave you (kit.auth.tokens.bearer_header)"
        )
    try:
        data = base64.urlsafe_b64decode(value + "=" * (-len(value) % 4))
    except (binascii.Error, ValueError):
        raise MalformedToken(
            "the bearer token is not valid base64url - help: send the token kit's login gave "
            "you (kit.auth.tokens.bearer_header)"
        ) from None
    try:
        return AccessToken.from_bytes(data)
    except MalformedToken as error:
        if "help:" in str(error):
            raise
        raise MalformedToken(
            f"the bearer token is not a kit access token: {error} - help: log in again to get "
            "a fresh token from the coordinator"
        ) from None
