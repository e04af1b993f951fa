"""Bans of a running coordinator from its state dir: the signed ban request and its two routes
(``kit.coordinator_file`` is how ``kit revoke`` finds the coordinator).

``kit revoke --state-dir coordinator --user alice`` (``kit.revoke_cli``) reads the authority key
in the state dir and sends the running coordinator a :class:`RevokeRequest`::

    GET /api/revoke
    Authorization: KitRevoke <base64url of the msgpack request>

    200 the ban list, as GET /api/bans answers it (after the ban)
    400 / 401 / 403 / 409 / 429 / 500 {"error": <code>, "message": <what happened - help: ...>}

The request is a msgpack map ``{"v": 1, "run", "users": [name...], "keys": [raw 32-byte peer
key...], "duration", "time", "nonce", "sig"}`` signed by the run's authority over
``REQUEST_DOMAIN || msgpack([run, users, keys, duration, time, nonce])``: its own domain prefix,
so its signature can never pass as an access token, a revocation list or a handshake. The
coordinator decodes it strictly (no pickle, exact keys and types, sizes), then checks the run
id, the authority's signature (run.yaml's ``access.authority_public_key``), the time (within
:data:`REQUEST_WINDOW` of its clock) and the nonce (never seen in that window), and only then
calls ``Coordinator.revoke``: the bans are saved in the state dir, enforced on its own peer and
published in the DHT for every other peer's session guard. A refused request changes nothing.
The nonces are kept in memory: a request recorded before a restart can be replayed in the few
minutes of its window after it, which bans the same people again, no one else.

``GET /api/bans`` answers anyone with the active bans (the dashboard shows them; the list is in
the DHT anyway) and the signed list itself, which ``kit revoke`` verifies with the authority key
rather than trust the answer.

What this module does not do: the ban list and its DHT transport (``kit.auth.revocation``), the
bookkeeping of the authority (``kit.run_authority``), the command line (``kit.revoke_cli``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import math
import re
import secrets
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgpack

from kit.auth.revocation import RevocationList
from kit.auth.tokens import MAX_RUN_ID, NAME_PATTERN, check_fields, unpack_strict
from kit.errors import ConfigError, KitError, MalformedToken
from kit.p2p.identity import (
    PUBLIC_KEY_SIZE,
    SIGNATURE_SIZE,
    Identity,
    PeerID,
    b58encode,
    verify_signature,
)
from kit.p2p.transport import HttpHandler, HttpRequest, HttpResponse

logger = logging.getLogger(__name__)

REVOKE_PATH = "/api/revoke"
BANS_PATH = "/api/bans"
REQUEST_DOMAIN = b"kit-revoke-request/1\0"
REQUEST_VERSION = 1
#: The scheme of the ``Authorization`` header that carries a request (a header, not a query
#: parameter: reverse proxies log URLs, rarely this header).
REQUEST_SCHEME = "KitRevoke"
#: Small enough for one HTTP header line once in base64url (websockets reads lines of 8 KiB).
MAX_REQUEST_BYTES = 4096
MAX_REQUEST_ENTRIES = 32
MAX_DURATION = 365 * 24 * 3600.0
#: Seconds a request's time may differ from the coordinator's clock (clocks disagree a little).
REQUEST_WINDOW = 300.0
NONCE_SIZE = 16
#: Nonces remembered at most: only requests with the authority's signature are remembered, so
#: this many in one window means a script gone wrong; further requests wait (HTTP 429).
MAX_NONCES = 4096
_MAX_HEADER_CHARS = len(REQUEST_SCHEME) + 1 + 4 * (MAX_REQUEST_BYTES + 2) // 3
_BASE64URL = re.compile(r"^[A-Za-z0-9_-]+={0,2}$")
_NO_CACHE = ("Cache-Control", "no-store")


# --- what may be banned ---------------------------------------------------------------------------


def ban_problem(
    usernames: Sequence[str], peer_public_keys: Sequence[bytes], duration: float
) -> str:
    """Why these bans cannot be requested ("" if they can): the checks both sides make."""
    if not usernames and not peer_public_keys:
        return "nobody to ban - help: name a user (--user NAME) or a peer key (--peer-key KEY)"
    if len(usernames) + len(peer_public_keys) > MAX_REQUEST_ENTRIES:
        return (
            f"{len(usernames) + len(peer_public_keys)} bans in one request, at most "
            f"{MAX_REQUEST_ENTRIES} - help: ban the others with another kit revoke"
        )
    for name in usernames:
        if not isinstance(name, str) or name.startswith("@") or not NAME_PATTERN.match(name):
            return (
                f"{str(name)[:100]!r} is not a Hugging Face user name - help: use the name as in "
                "the profile URL, e.g. alice for https://huggingface.co/alice"
            )
    for key in peer_public_keys:
        if not isinstance(key, bytes) or len(key) != PUBLIC_KEY_SIZE:
            return (
                f"a peer key is {PUBLIC_KEY_SIZE} bytes, got {key!r:.60} - help: give the "
                "peer's Ed25519 public key in base58"
            )
    if not (isinstance(duration, float) and math.isfinite(duration)):
        return f"duration {duration!r} is not a number of seconds - help: e.g. 1d, 12h, 3600"
    if not 0 < duration <= MAX_DURATION:
        return (
            f"duration of {duration:.0f} s - help: ban for more than 0 s and at most 365 days "
            "(e.g. 30m, 12h, 1d, 7d)"
        )
    return ""


# --- the signed request ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RevokeRequest:
    """The organizer's "ban these people now", signed with the run's authority key."""

    run_id: str  # the run whose coordinator must apply it
    usernames: tuple[str, ...]  # Hub user names to ban
    peer_public_keys: tuple[bytes, ...]  # raw 32-byte Ed25519 peer keys to ban
    duration: float  # seconds, from when the coordinator applies it
    time: float  # when it was signed (Unix time); the coordinator accepts it for a few minutes
    nonce: bytes  # random: the coordinator applies each request once
    signature: bytes = b""  # the authority's Ed25519 signature of signed_payload()

    @classmethod
    def sign(
        cls,
        authority: Identity,
        run_id: str,
        *,
        usernames: Iterable[str] = (),
        peer_public_keys: Iterable[bytes] = (),
        duration: float,
        now: float,
    ) -> RevokeRequest:
        """A request signed by ``authority`` with a fresh random nonce.

        Raises:
            ConfigError: nobody to ban, too many, a bad name, key or duration.
        """
        names, keys = tuple(usernames), tuple(peer_public_keys)
        problem = ban_problem(names, keys, float(duration))
        if problem:
            raise ConfigError(f"kit revoke: {problem}")
        if not 0 < len(run_id) <= MAX_RUN_ID:
            raise ConfigError(f"kit revoke: run id of {len(run_id)} characters")
        nonce = secrets.token_bytes(NONCE_SIZE)
        unsigned = cls(run_id, names, keys, float(duration), float(now), nonce)
        return cls(*unsigned.fields(), authority.sign(unsigned.signed_payload()))

    def fields(self) -> tuple[str, tuple[str, ...], tuple[bytes, ...], float, float, bytes]:
        return (
            self.run_id,
            self.usernames,
            self.peer_public_keys,
            self.duration,
            self.time,
            self.nonce,
        )

    def signed_payload(self) -> bytes:
        """The bytes the authority signs: the domain prefix, then the fields in a fixed order."""
        fields = [
            self.run_id,
            list(self.usernames),
            list(self.peer_public_keys),
            self.duration,
            self.time,
            self.nonce,
        ]
        return REQUEST_DOMAIN + msgpack.packb(fields, use_bin_type=True)

    def verify(self, authority_public_key: bytes) -> bool:
        return verify_signature(authority_public_key, self.signature, self.signed_payload())

    def to_bytes(self) -> bytes:
        body = {
            "v": REQUEST_VERSION,
            "run": self.run_id,
            "users": list(self.usernames),
            "keys": list(self.peer_public_keys),
            "duration": self.duration,
            "time": self.time,
            "nonce": self.nonce,
            "sig": self.signature,
        }
        return msgpack.packb(body, use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes) -> RevokeRequest:
        """Decode a received request (its signature is NOT checked here).

        Raises:
            MalformedToken: not a ban request (shape, types, sizes, version, bad entries).
        """
        what = "ban request"
        body = unpack_strict(data, what, MAX_REQUEST_BYTES)
        schema = {
            "v": int,
            "run": str,
            "users": list,
            "keys": list,
            "duration": float,
            "time": float,
            "nonce": bytes,
            "sig": bytes,
        }
        check_fields(body, what, schema)
        if body["v"] != REQUEST_VERSION:
            raise MalformedToken(f"{what} of version {body['v']} - help: upgrade kit on one side")
        if not 0 < len(body["run"]) <= MAX_RUN_ID or not math.isfinite(body["time"]):
            raise MalformedToken(f"{what}: bad run id or time")
        if len(body["nonce"]) != NONCE_SIZE or len(body["sig"]) != SIGNATURE_SIZE:
            raise MalformedToken(f"{what}: bad nonce or signature size")
        users, keys = body["users"], body["keys"]
        if any(type(name) is not str for name in users):
            raise MalformedToken(f"{what}: users are strings")
        if any(type(key) is not bytes for key in keys):
            raise MalformedToken(f"{what}: peer keys are raw bytes")
        problem = ban_problem(users, keys, body["duration"])
        if problem:
            raise MalformedToken(f"{what}: {problem}")
        return cls(
            body["run"],
            tuple(users),
            tuple(keys),
            body["duration"],
            body["time"],
            body["nonce"],
            body["sig"],
        )

    def header(self) -> str:
        """The ``Authorization`` header value that carries this request."""
        return f"{REQUEST_SCHEME} {base64.urlsafe_b64encode(self.to_bytes()).decode('ascii')}"

    @classmethod
    def from_header(cls, header: str) -> RevokeRequest:
        """Decode the request of an ``Authorization: KitRevoke ...`` header (size first).

        Raises:
            MalformedToken: no such header, too long, not base64url, or not a ban request.
        """
        if len(header) > _MAX_HEADER_CHARS:
            raise MalformedToken(f"the Authorization header has {len(header)} characters")
        scheme, _, value = header.strip().partition(" ")
        value = value.strip()
        if scheme != REQUEST_SCHEME or not _BASE64URL.match(value):
            raise MalformedToken(f"no 'Authorization: {REQUEST_SCHEME} <base64url>' header")
        try:
            data = base64.urlsafe_b64decode(value + "=" * (-len(value) % 4))
        except (binascii.Error, ValueError):
            raise MalformedToken("the ban request is not valid base64url") from None
        return cls.from_bytes(data)


# --- the ban list as JSON ------------------------------------------------------------------------


def describe_bans(run_id: str, revocations: RevocationList | None, now: float) -> dict[str, Any]:
    """``GET /api/bans``: the active bans (``revocations`` None: a run without an authority),
    and the signed list itself (base64url), for whoever wants to verify them."""
    body: dict[str, Any] = {
        "run_id": run_id,
        "authority": revocations is not None,
        "time": now,
        "users": [],
        "peer_keys": [],
    }
    if revocations is None:
        return body
    active = revocations.pruned(now)
    body["users"] = [{"username": name, "until": until} for name, until in active.usernames]
    body["peer_keys"] = [
        {
            "public_key": b58encode(key),
            "peer_id": PeerID.from_public_key(key).to_base58(),
            "until": until,
        }
        for key, until in active.peer_public_keys
    ]
    body["issued_at"] = revocations.issued_at
    body["list"] = base64.urlsafe_b64encode(revocations.to_bytes()).decode("ascii")
    return body


# --- the coordinator's side -----------------------------------------------------------------------


class HttpRoutes(Protocol):
    """What the routes need of a peer (``kit.p2p.peer.Peer`` has it)."""

    def add_http_route(self, path: str, handler: HttpHandler) -> None: ...


class Issuer(Protocol):
    """What the routes read of the run's authority (``kit.auth.TokenIssuer`` has it)."""

    @property
    def authority_public_key(self) -> bytes: ...

    @property
    def revocations(self) -> RevocationList: ...


#: ``Coordinator.revoke``: applies bans (blocking; it waits for the DHT).
Revoke = Callable[..., None]


def _error(status: int, code: str, message: str) -> HttpResponse:
    body = json.dumps({"error": code, "message": message}).encode()
    return HttpResponse(status, body, headers=(_NO_CACHE,))


class RevocationAdmin:
    """Answers ``GET /api/revoke`` and ``GET /api/bans``; create it with
    :func:`serve_revocation_admin`.

    Args:
        run_id: the coordinator's run.
        issuer: the run's authority (None: an open run without one, which cannot ban).
        revoke: applies bans: ``revoke(usernames=..., peer_public_keys=..., duration=...)``;
            blocking, so it runs in a worker thread.
        clock: the coordinator's clock (Unix time).
        window: seconds a request's time may differ from the clock.
        max_nonces: nonces remembered at most (see :data:`MAX_NONCES`).
    """

    def __init__(
        self,
        run_id: str,
        issuer: Issuer | None,
        revoke: Revoke,
        *,
        clock: Callable[[], float] = time.time,
        window: float = REQUEST_WINDOW,
        max_nonces: int = MAX_NONCES,
    ) -> None:
        self.run_id = run_id
        self.issuer = issuer
        self._revoke = revoke
        self._clock = clock
        self.window = window
        self.max_nonces = max_nonces
        self._nonces: dict[bytes, float] = {}  # nonce -> the time of its request
        self._lock = asyncio.Lock()  # one ban at a time: each builds on the list before it

    def bans(self) -> dict[str, Any]:
        issuer = self.issuer
        return describe_bans(
            self.run_id, None if issuer is None else issuer.revocations, self._clock()
        )

    async def handle_bans(self, request: HttpRequest) -> HttpResponse:
        body = json.dumps(self.bans(), separators=(",", ":")).encode()
        return HttpResponse(200, body, headers=(_NO_CACHE,))

    async def handle_revoke(self, request: HttpRequest) -> HttpResponse:
        """One ban request (never raises: every refusal is a JSON error answer)."""
        issuer = self.issuer
        if issuer is None:
            return _error(
                409,
                "open_run",
                f"run {self.run_id!r} has no authority, so nobody can be banned - help: create "
                "one (kit coordinator --create-authority), put its key in run.yaml's "
                "access.authority_public_key and restart the coordinator",
            )
        try:
            ban = RevokeRequest.from_header(request.headers.get("authorization", ""))
        except MalformedToken as e:
            return _error(400, "malformed", f"{e} - help: send it with kit revoke")
        if ban.run_id != self.run_id:
            return _error(
                403,
                "other_run",
                f"this coordinator runs {self.run_id!r}, not {ban.run_id!r} - help: pass the "
                f"--state-dir of the coordinator of {ban.run_id!r}",
            )
        if not ban.verify(issuer.authority_public_key):
            logger.warning("refused a ban request from %s: bad signature", request.remote_host)
            return _error(
                401,
                "bad_signature",
                "the ban request is not signed by this run's authority - help: use the "
                "authority.key of this run's state dir (its public key is run.yaml's "
                "access.authority_public_key)",
            )
        async with self._lock:
            refusal = self._admit(ban)
            if refusal is not None:
                return refusal
            try:
                await asyncio.to_thread(
                    self._revoke,
                    usernames=list(ban.usernames),
                    peer_public_keys=list(ban.peer_public_keys),
                    duration=ban.duration,
                )
            except ConfigError as e:  # e.g. more bans than one DHT record holds: none applied
                return _error(400, "refused", str(e))
            except KitError as e:
                logger.warning("a ban request failed: %s", e)
                return _error(500, "failed", f"{e} - help: see the coordinator's log")
        logger.info(
            "banned by kit revoke from %s for %.0f s: users %s, %d peer keys",
            request.remote_host,
            ban.duration,
            ", ".join(ban.usernames) or "none",
            len(ban.peer_public_keys),
        )
        return await self.handle_bans(request)

    def _admit(self, ban: RevokeRequest) -> HttpResponse | None:
        """None if ``ban`` is fresh and new (its nonce is then remembered), else the refusal."""
        now = self._clock()
        if abs(now - ban.time) > self.window:
            return _error(
                401,
                "stale",
                f"the ban request was signed {now - ban.time:+.0f} s from the coordinator's "
                f"clock, more than {self.window:.0f} s - help: sync the clocks (NTP) and retry",
            )
        for nonce, signed in list(self._nonces.items()):
            if abs(now - signed) > self.window:  # outside the window: refused by its time
                del self._nonces[nonce]
        if ban.nonce in self._nonces:
            return _error(
                409,
                "replayed",
                "this ban request was applied already (same nonce) - help: run kit revoke "
                "again for a new request",
            )
        if len(self._nonces) >= self.max_nonces:
            return _error(
                429, "too_many", "too many ban requests in a few minutes - help: retry later"
            )
        self._nonces[ban.nonce] = ban.time
        return None


def serve_revocation_admin(
    peer: HttpRoutes, run_id: str, issuer: Issuer | None, revoke: Revoke, **settings: Any
) -> RevocationAdmin:
    """Serve ``GET /api/revoke`` and ``GET /api/bans`` on the coordinator peer's port.

    ``settings``: ``clock``, ``window``, ``max_nonces`` (see :class:`RevocationAdmin`).
    """
    admin = RevocationAdmin(run_id, issuer, revoke, **settings)
    peer.add_http_route(REVOKE_PATH, admin.handle_revoke)
    peer.add_http_route(BANS_PATH, admin.handle_bans)
    return admin
