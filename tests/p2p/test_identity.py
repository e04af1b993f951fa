"""Identities: PeerIDs, signatures, key files and their lock."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kit.errors import IdentityError, IdentityInUse
from kit.p2p.identity import Identity, PeerID, load_identity, verify_signature


def test_peer_id_derives_from_public_key_and_round_trips() -> None:
    identity = Identity.generate()
    assert identity.peer_id == PeerID.from_public_key(identity.public_key)
    assert PeerID.from_base58(str(identity.peer_id)) == identity.peer_id
    assert Identity.generate().peer_id != identity.peer_id
    with pytest.raises(ValueError):
        PeerID.from_base58("not-base58!")


def test_signatures() -> None:
    identity = Identity.generate()
    signature = identity.sign(b"data")
    assert verify_signature(identity.public_key, signature, b"data")
    assert not verify_signature(identity.public_key, signature, b"other")
    assert not verify_signature(Identity.generate().public_key, signature, b"data")
    assert not verify_signature(identity.public_key, b"short", b"data")


def test_key_file_is_owner_only_and_stable(tmp_path: Path) -> None:
    path = tmp_path / "keys" / "peer.key"
    identity, lock = load_identity(path)
    lock.release()
    if os.name == "posix":
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again, lock = load_identity(path)
    lock.release()
    assert again.peer_id == identity.peer_id


def test_two_peers_cannot_share_an_identity_file(tmp_path: Path) -> None:
    path = tmp_path / "peer.key"
    _, lock = load_identity(path)
    with pytest.raises(IdentityInUse, match="help:"):
        load_identity(path)
    # ...not even from another process
    script = textwrap.dedent(
        f"""
        from kit.errors import IdentityInUse
        from kit.p2p.identity import load_identity
        try:
            load_identity({str(path)!r})
        except IdentityInUse:
            raise SystemExit(3)
        """
    )
    assert subprocess.run([sys.executable, "-c", script], timeout=60).returncode == 3
    lock.release()
    _, lock = load_identity(path)  # free again once released
    lock.release()


def test_corrupt_key_file(tmp_path: Path) -> None:
    path = tmp_path / "peer.key"
    path.write_bytes(b"not a key")
    with pytest.raises(IdentityError):
        load_identity(path)
