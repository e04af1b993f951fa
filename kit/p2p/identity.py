"""Peer identity: an Ed25519 key pair, the PeerID derived from its public key, and the key file.

A PeerID is the SHA-256 of the raw 32-byte Ed25519 public key, shown in base58 (like libp2p's
and hivemind's PeerIDs). Whoever claims a PeerID must prove possession of the matching private
key during the handshake (``kit.p2p.handshake``), so PeerIDs cannot be impersonated. The class
and the base58 codec live in ``kit.address`` (config validates addresses without the p2p layer)
and are importable from here too.

Key files hold the raw 32-byte private key (owner-only permissions, 0600). A running peer keeps
an exclusive lock on its key file: two peers started with the same identity file would fight over
one PeerID (hivemind users hit this by copying key files), so the second one gets
:class:`~kit.errors.IdentityInUse` at once.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import IO

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from kit.address import PeerID
from kit.address import b58decode as b58decode  # re-exported: importers of kit.p2p.identity
from kit.address import b58encode as b58encode  # (auth, dht, coordinator) find them here
from kit.errors import IdentityError, IdentityInUse

PUBLIC_KEY_SIZE = 32
SIGNATURE_SIZE = 64


def verify_signature(public_key: bytes, signature: bytes, data: bytes) -> bool:
    """True if ``signature`` is a valid Ed25519 signature of ``data`` by ``public_key``."""
    if len(public_key) != PUBLIC_KEY_SIZE or len(signature) != SIGNATURE_SIZE:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, data)
    except (InvalidSignature, ValueError):
        return False
    return True


class Identity:
    """An Ed25519 private key and what derives from it (public key, PeerID, signatures)."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._private_key = private_key
        self.public_key: bytes = private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.peer_id = PeerID.from_public_key(self.public_key)

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_private_bytes(cls, raw: bytes) -> Identity:
        if len(raw) != 32:
            raise IdentityError(f"an Ed25519 private key is 32 bytes, got {len(raw)}")
        return cls(Ed25519PrivateKey.from_private_bytes(raw))

    def private_bytes(self) -> bytes:
        return self._private_key.private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )

    def sign(self, data: bytes) -> bytes:
        return self._private_key.sign(data)

    def __repr__(self) -> str:
        return f"Identity({self.peer_id})"


class IdentityLock:
    """An exclusive lock on an identity file, held while a peer runs; ``release()`` frees it."""

    def __init__(self, path: Path, handle: IO[bytes]) -> None:
        self.path = path
        self._handle: IO[bytes] | None = handle

    def release(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            _unlock(handle)
            handle.close()


def load_identity(path: str | os.PathLike[str]) -> tuple[Identity, IdentityLock]:
    """Load the identity at ``path`` (creating it, owner-only, if missing) and lock it.

    Raises:
        IdentityInUse: another running peer holds this identity file.
        IdentityError: the file exists but is not a kit identity.
    """
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fresh = Identity.generate()
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
        try:
            fd = os.open(path, flags, 0o600)
        except FileExistsError:
            pass  # created by a concurrent peer a moment ago: read it below
        else:
            with os.fdopen(fd, "wb") as file:
                file.write(fresh.private_bytes())
    handle = open(path, "rb")  # noqa: SIM115 - kept open: it carries the lock
    try:
        _lock(handle, path)
        raw = handle.read()
        identity = Identity.from_private_bytes(raw)
    except BaseException:
        handle.close()
        raise
    return identity, IdentityLock(path, handle)


if sys.platform == "win32":  # pragma: no cover - exercised on Windows only
    import msvcrt

    def _lock(handle: IO[bytes], path: Path) -> None:
        try:
            msvcrt.locking(handle.fileno(), msvcrt.LK_NBLCK, 1)
        except OSError:
            raise IdentityInUse(str(path)) from None
        handle.seek(0)

    def _unlock(handle: IO[bytes]) -> None:
        handle.seek(0)
        msvcrt.locking(handle.fileno(), msvcrt.LK_UNLCK, 1)

else:
    import fcntl

    def _lock(handle: IO[bytes], path: Path) -> None:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise IdentityInUse(str(path)) from None

    def _unlock(handle: IO[bytes]) -> None:
        fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
