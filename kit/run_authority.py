"""The run's authority as the coordinator keeps it: its key, the token issuer, the ban list.

Holds :func:`create_authority` (the organizer's one-time step: the key whose public half goes in
run.yaml as ``access.authority_public_key``), :func:`open_issuer` (at start: that key, checked
against run.yaml, signing the access tokens), and the ban list's life: kept in ``state_dir``
across restarts (:func:`save_revocations`, :func:`load_revocations`), enforced on the
coordinator's own peer and published in the DHT for every other peer's session guard
(:func:`apply_revocations`). ``kit revoke`` reads the key and the kept list without the
coordinator's lock (:func:`read_authority`, :func:`read_revocations`): it runs beside it.

Separate from ``coordinator`` because it is the authority's bookkeeping (key files, signed
lists, their checks) with no lifecycle of its own: the coordinator starts, serves and stops
everything, and calls these when it opens the authority and when the organizer bans someone.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, cast

from kit.config import RunConfig
from kit.dht.config import get_dht_time
from kit.errors import ConfigError, IdentityError, KitError, KitUsageError
from kit.p2p.identity import Identity, b58decode, b58encode, load_identity

if TYPE_CHECKING:  # imported late where used: the services load only when the coordinator starts
    from kit.auth import AllowlistAuthorizer, RevocationList, TokenIssuer
    from kit.dht import DHTNode
    from kit.p2p.identity import IdentityLock
    from kit.p2p.peer import Peer

logger = logging.getLogger(__name__)


def authority_key_path(state_dir: str | Path) -> Path:
    return Path(state_dir) / "authority.key"


def create_authority(state_dir: str | Path) -> str:
    """Create (or read) the run's authority key; return its public key for run.yaml (base58).

    Keep ``authority.key`` secret and backed up: whoever holds it can let anyone in.
    """
    identity, lock = load_identity(authority_key_path(state_dir))
    lock.release()
    return b58encode(identity.public_key)


def read_authority(state_dir: str | Path) -> Identity:
    """The authority key in ``state_dir``, read WITHOUT the lock that the running coordinator
    holds on it (the key never changes once created: reading it beside the coordinator is safe).

    Raises:
        KitUsageError: there is no key: an open run, or not the coordinator's state dir.
        IdentityError: the file cannot be read, or is not a key.
    """
    path = authority_key_path(state_dir)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise KitUsageError(
            f"there is no authority key in {state_dir} ({path.name} is missing): an open run "
            "(no access.authority_public_key in run.yaml) cannot ban anyone - help: pass the "
            "--state-dir the coordinator runs from; to ban in an open run, create an authority "
            "(kit coordinator --create-authority), put its key in run.yaml and restart"
        ) from None
    except OSError as e:
        raise IdentityError(
            f"cannot read the authority key {path}: {e.strerror} - help: run this as the user "
            "who runs the coordinator"
        ) from None
    try:
        return Identity.from_private_bytes(raw)
    except (IdentityError, ValueError):
        raise IdentityError(
            f"{path} is not an authority key ({len(raw)} bytes, not a 32-byte Ed25519 key) - "
            "help: restore it from your backup (the key in run.yaml is its public half)"
        ) from None


def open_issuer(
    config: RunConfig, state_dir: Path, locks: list[IdentityLock]
) -> TokenIssuer | None:
    """The token issuer of a run with an authority (None: an open run without one).

    The authority key's lock is appended to ``locks`` (the coordinator releases them at
    shutdown), also when the key turns out to be the wrong one.

    Raises:
        ConfigError: ``state_dir`` holds another key than run.yaml's authority_public_key.
    """
    published = config.access.authority_public_key
    if published is None:
        return None
    from kit.auth import TokenIssuer

    identity, lock = load_identity(authority_key_path(state_dir))
    locks.append(lock)
    if identity.public_key != b58decode(published):
        raise ConfigError(
            f"access.authority_public_key in run.yaml is not the key in "
            f"{authority_key_path(state_dir)} - help: put "
            f"{b58encode(identity.public_key)} in run.yaml, or point state_dir at the "
            "folder that holds the right authority.key"
        )
    return TokenIssuer(identity, config.collaboration.run_id, lifetime=config.access.token_lifetime)


# --- the ban list ---------------------------------------------------------------------------------


def revocations_path(state_dir: Path) -> Path:
    return state_dir / "revocations.msgpack"


def save_revocations(state_dir: Path, issuer: TokenIssuer) -> None:
    """Keep the issuer's ban list in ``state_dir`` (replaced in one rename)."""
    path = revocations_path(state_dir)
    partial = path.with_suffix(".partial")
    partial.write_bytes(issuer.revocations.to_bytes())
    os.replace(partial, path)


def load_revocations(state_dir: Path, issuer: TokenIssuer) -> None:
    """Give ``issuer`` the ban list kept in ``state_dir`` (nothing kept: nothing changes).

    Raises:
        ConfigError: the kept list is unreadable or not signed by this authority.
    """
    saved = read_revocations(state_dir, issuer.authority_public_key)
    if saved is not None:
        issuer.revocations = saved


def read_revocations(state_dir: str | Path, authority_public_key: bytes) -> RevocationList | None:
    """The ban list kept in ``state_dir``, verified (None: none is kept).

    Raises:
        ConfigError: the kept list is unreadable or not signed by this authority.
    """
    from kit.auth import RevocationList

    path = revocations_path(Path(state_dir))
    if not path.exists():
        return None
    try:
        saved = RevocationList.from_bytes(path.read_bytes())
        saved.verify(authority_public_key)
    except (KitError, OSError) as e:
        raise ConfigError(
            f"{path} is unreadable ({e}) - help: restore it from a backup, or delete it to "
            "lift every ban"
        ) from e
    return saved


async def apply_revocations(
    node: DHTNode,
    authorizer: AllowlistAuthorizer | None,
    issuer: TokenIssuer,
    revocations: RevocationList,
) -> None:
    """Enforce ``revocations`` on our peer (its ``authorizer``) and publish them for everyone
    else's."""
    from kit.auth import enforce_revocations, publish_revocations
    from kit.auth.revocation import DEFAULT_PUBLISH_TTL

    if authorizer is not None and authorizer.update_revocations(revocations):
        enforce_revocations(cast("Peer", node.peer), authorizer)
    expiration = get_dht_time() + DEFAULT_PUBLISH_TTL
    if not await publish_revocations(
        node, issuer.authority, revocations, expiration_time=expiration
    ):
        logger.warning("the revocation list reached no DHT node yet (peers poll the DHT)")
