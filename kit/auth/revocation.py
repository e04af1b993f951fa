"""Revocation: the organizer's signed list of banned users and peer keys, and its DHT transport.

Access tokens are short-lived (30 min by default), so a user removed from the allowlist is out
once their token expires. A :class:`RevocationList` is for "out now": the coordinator signs one
msgpack record naming users and/or peer keys, each banned until a time of its own: every
authorizer refuses them at the handshake (``kit.auth.authorizer``), and every peer's session
guard closes their current connections within one check period (``kit.auth.sessions``). A
list replaces an older one only if its ``issued_at`` is later, so a replayed old list can never
lift a ban.

Record format: msgpack ``{"v": 1, "run", "issued", "users": [[name, until]...], "keys": [[pk,
until]...], "sig"}``; the signature covers ``REVOCATION_DOMAIN || msgpack([run, issued, users,
keys])``, with its own domain prefix so it can never pass as an access token.

Transport: :func:`publish_revocations` stores the signed record in the DHT under
``"<run_id>_revocations"`` with the subkey ``[owner:<authority key>]``, so that storing nodes
accept it only with the authority's DHT-record signature (``kit.dht.validation``);
:func:`fetch_revocations` reads it back and verifies the authority's signature on the list
itself too (a storing node could still lie). Peers can also get the list in process
(``AllowlistAuthorizer.update_revocations``).

What this module does not do: deciding what to revoke (``kit.auth.authority.TokenIssuer``),
checking peers against the list (``kit.auth.authorizer``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import msgpack

from kit.auth.tokens import MAX_RUN_ID, check_fields, check_name, unpack_strict
from kit.dht.validation import Ed25519SignatureValidator, owner_marker
from kit.errors import BadSignature, ConfigError, MalformedToken
from kit.p2p.identity import PUBLIC_KEY_SIZE, SIGNATURE_SIZE, Identity, PeerID, verify_signature

if TYPE_CHECKING:
    from kit.dht.node import DHTNode

logger = logging.getLogger(__name__)

REVOCATION_DOMAIN = b"kit-revocations/1\0"
REVOCATION_VERSION = 1
#: Fits one DHT value (64 KiB by default) with room for the record signature.
MAX_REVOCATION_BYTES = 48 * 1024
MAX_REVOCATION_ENTRIES = 1024
#: How long a published list stays in the DHT; the coordinator republishes before that.
DEFAULT_PUBLISH_TTL = 24 * 3600.0


def revocation_key(run_id: str) -> str:
    """The DHT key of a run's revocation list (hivemind-style ``<run_id>_<what>`` naming)."""
    return f"{run_id}_revocations"


@dataclass(frozen=True)
class RevocationList:
    """Users and peer keys banned from a run, each until a time; signed by the run's authority.

    Build new lists with :meth:`revoke` (and :meth:`pruned`) and sign them with :meth:`sign`;
    the coordinator's :class:`~kit.auth.authority.TokenIssuer` does both in ``revoke``.
    """

    run_id: str  # the run it applies to
    issued_at: float  # when it was signed (Unix time); a later list replaces an earlier one
    usernames: tuple[tuple[str, float], ...] = ()  # (Hub user name, banned until), sorted
    peer_public_keys: tuple[tuple[bytes, float], ...] = ()  # (raw peer key, banned until), sorted
    signature: bytes = b""  # the authority's Ed25519 signature of signed_payload()

    def revoke(
        self,
        *,
        usernames: Iterable[str] = (),
        peer_public_keys: Iterable[bytes] = (),
        until: float,
    ) -> RevocationList:
        """A new, unsigned list with these users and keys banned until ``until`` (Unix time).

        A name or key already banned keeps the later of its two times.

        Raises:
            ConfigError: a user name that no Hub account can have, or a key of the wrong size.
        """
        users = dict(self.usernames)
        for name in usernames:
            if not isinstance(name, str):
                raise ConfigError(f"revoke: user names are strings, got {name!r:.60}")
            try:
                check_name(name, "revoked user")
            except MalformedToken as e:
                raise ConfigError(f"{e} - help: pass Hub user names, e.g. 'alice'") from None
            users[name] = max(users.get(name, until), until)
        keys = dict(self.peer_public_keys)
        for key in peer_public_keys:
            if not isinstance(key, bytes) or len(key) != PUBLIC_KEY_SIZE:
                raise ConfigError(
                    f"revoke: a peer key is {PUBLIC_KEY_SIZE} raw bytes, got {key!r:.60} - "
                    "help: pass remote.public_key (not a PeerID: it is a hash of the key)"
                )
            keys[key] = max(keys.get(key, until), until)
        return RevocationList(
            self.run_id, self.issued_at, tuple(sorted(users.items())), tuple(sorted(keys.items()))
        )

    def pruned(self, now: float) -> RevocationList:
        """A new, unsigned list without the bans that have ended by ``now``."""
        return RevocationList(
            self.run_id,
            self.issued_at,
            tuple((name, until) for name, until in self.usernames if until > now),
            tuple((key, until) for key, until in self.peer_public_keys if until > now),
        )

    def signed_payload(self) -> bytes:
        fields = [
            self.run_id,
            self.issued_at,
            [list(entry) for entry in self.usernames],
            [list(entry) for entry in self.peer_public_keys],
        ]
        return REVOCATION_DOMAIN + msgpack.packb(fields, use_bin_type=True)

    def sign(self, authority: Identity, issued_at: float) -> RevocationList:
        """This list, issued at ``issued_at`` and signed by ``authority``.

        Raises:
            ConfigError: too many entries to fit one DHT record.
        """
        unsigned = RevocationList(
            self.run_id, float(issued_at), self.usernames, self.peer_public_keys
        )
        signature = authority.sign(unsigned.signed_payload())
        signed = RevocationList(
            self.run_id, float(issued_at), self.usernames, self.peer_public_keys, signature
        )
        entries = len(self.usernames) + len(self.peer_public_keys)
        if entries > MAX_REVOCATION_ENTRIES or len(signed.to_bytes()) > MAX_REVOCATION_BYTES:
            raise ConfigError(
                f"a revocation list of {entries} entries does not fit one record (at most "
                f"{MAX_REVOCATION_ENTRIES} entries, {MAX_REVOCATION_BYTES} bytes) - help: revoke "
                "for shorter durations, or remove users from the allowlist instead"
            )
        return signed

    def verify(self, authority_public_key: bytes) -> None:
        """Raise :class:`~kit.errors.BadSignature` unless the authority signed this list."""
        if not verify_signature(authority_public_key, self.signature, self.signed_payload()):
            raise BadSignature(
                f"the revocation list of run {self.run_id!r} is not signed by this run's "
                "authority - help: ignore it; only the coordinator can revoke"
            )

    def reason(self, username: str, peer_public_key: bytes, now: float) -> str | None:
        """Why this user / key is banned at ``now``, or None if it is not."""
        for name, until in self.usernames:
            if name == username and until > now:
                return f"user {username!r} is revoked for {until - now:.0f} more seconds"
        for key, until in self.peer_public_keys:
            if key == peer_public_key and until > now:
                peer = PeerID.from_public_key(key).short()
                return f"peer {peer} is revoked for {until - now:.0f} more seconds"
        return None

    def to_bytes(self) -> bytes:
        body = {
            "v": REVOCATION_VERSION,
            "run": self.run_id,
            "issued": self.issued_at,
            "users": [list(entry) for entry in self.usernames],
            "keys": [list(entry) for entry in self.peer_public_keys],
            "sig": self.signature,
        }
        return msgpack.packb(body, use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes) -> RevocationList:
        """Decode a list received from the DHT or a peer (the signature is NOT checked here).

        Raises:
            MalformedToken: not a revocation list (shape, types, sizes, version).
        """
        what = "revocation list"
        body = unpack_strict(data, what, MAX_REVOCATION_BYTES)
        schema = {"v": int, "run": str, "issued": float, "users": list, "keys": list, "sig": bytes}
        check_fields(body, what, schema)
        if body["v"] != REVOCATION_VERSION:
            raise MalformedToken(f"{what} of version {body['v']} - help: upgrade kit")
        if not 0 < len(body["run"]) <= MAX_RUN_ID or not math.isfinite(body["issued"]):
            raise MalformedToken(f"{what}: bad run id or issue time")
        if len(body["users"]) + len(body["keys"]) > MAX_REVOCATION_ENTRIES:
            raise MalformedToken(f"{what}: more than {MAX_REVOCATION_ENTRIES} entries")
        if len(body["sig"]) != SIGNATURE_SIZE:
            raise MalformedToken(f"{what}: signature of {len(body['sig'])} bytes")
        users = tuple((cast(str, name), until) for name, until in _pairs(body["users"], str))
        for name, _ in users:
            check_name(name, what)
        keys = tuple((cast(bytes, key), until) for key, until in _pairs(body["keys"], bytes))
        if any(len(key) != PUBLIC_KEY_SIZE for key, _ in keys):
            raise MalformedToken(f"{what}: a peer key is not {PUBLIC_KEY_SIZE} bytes")
        return cls(body["run"], body["issued"], users, keys, body["sig"])


def _pairs(entries: list[object], kind: type) -> list[tuple[object, float]]:
    pairs = []
    for entry in entries:
        if (
            not isinstance(entry, list)
            or len(entry) != 2
            or type(entry[0]) is not kind
            or type(entry[1]) is not float
            or not math.isfinite(entry[1])
        ):
            raise MalformedToken(f"revocation list: entries are [{kind.__name__}, float] pairs")
        pairs.append((entry[0], entry[1]))
    return pairs


# --- the DHT transport ----------------------------------------------------------------------


async def publish_revocations(
    node: DHTNode,
    authority: Identity,
    revocations: RevocationList,
    *,
    expiration_time: float,
) -> bool:
    """Store the signed list in the DHT, where every peer's authorizer can fetch it.

    Adds ``Ed25519SignatureValidator(authority)`` to ``node`` so that it can sign the record's
    ``[owner:...]`` subkey (run this on the coordinator, which holds the authority key).

    Args:
        node: a running DHT node (on the runtime loop, or the test's loop).
        authority: the run's authority key; must be the key that signed ``revocations``.
        revocations: a signed list (from ``TokenIssuer.revoke``).
        expiration_time: when the DHT may drop it (Unix time); republish before then, e.g.
            every few hours with ``get_dht_time() + DEFAULT_PUBLISH_TTL``.

    Returns:
        True if at least one DHT node stored it.

    Raises:
        BadSignature: ``revocations`` is not signed by ``authority``.
    """
    revocations.verify(authority.public_key)
    node.add_validators([Ed25519SignatureValidator(authority)])
    stored: bool = await node.store(
        revocation_key(revocations.run_id),
        revocations.to_bytes(),
        expiration_time,
        subkey=owner_marker(authority.public_key),
    )
    logger.info(
        "published the revocation list of %r issued at %.0f (%d users, %d keys): %s",
        revocations.run_id,
        revocations.issued_at,
        len(revocations.usernames),
        len(revocations.peer_public_keys),
        "stored" if stored else "not stored (a later record is held)",
    )
    return stored


async def fetch_revocations(
    node: DHTNode, authority_public_key: bytes, run_id: str
) -> RevocationList | None:
    """The run's revocation list from the DHT, verified; None if none was published.

    Raises:
        MalformedToken: the stored record is not a revocation list.
        BadSignature: the list is not signed by ``authority_public_key``.
    """
    found = await node.get(revocation_key(run_id), latest=True)
    if found is None or not isinstance(found.value, dict):
        return None
    entry = found.value.get(owner_marker(authority_public_key))
    if entry is None:
        return None
    if not isinstance(entry.value, bytes):
        raise MalformedToken("the DHT record of the revocation list does not hold bytes")
    revocations = RevocationList.from_bytes(entry.value)
    revocations.verify(authority_public_key)
    if revocations.run_id != run_id:
        raise MalformedToken(
            f"the revocation list stored for run {run_id!r} is for run {revocations.run_id!r}"
        )
    return revocations
