"""Who a metrics record belongs to: the user its access token names (pure).

Records the coordinator reads from the DHT (contributions, ``kit.metrics.records``; round
attestations, ``kit.metrics.attestations``) are owner-signed by a peer key. In authenticated runs
:func:`token_verifier` maps such a record to the Hugging Face user its access token names, if
the token is the authority's, for this run, unexpired, issued to the very key that signed the
record, and neither the user nor the key is revoked; otherwise the record is dropped.

What this module does not do: the accounting (``kit.metrics.book``, ``kit.metrics.ledger``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from kit.auth.revocation import RevocationList
from kit.auth.tokens import AccessToken, verify_token
from kit.errors import AuthError

logger = logging.getLogger(__name__)


class SignedRecord(Protocol):
    """A record that names its peer and carries its access token (contribution, attestation)."""

    @property
    def peer_id(self) -> bytes: ...

    @property
    def token(self) -> bytes | None: ...


#: ``verify(owner_public_key, record, now)`` → the verified user name, or None to drop the record.
Verifier = Callable[[bytes, SignedRecord, float], "str | None"]


def token_verifier(
    authority_public_key: bytes,
    run_id: str,
    *,
    clock_skew: float = 60.0,
    revocations: Callable[[], RevocationList | None] | None = None,
) -> Verifier:
    """The verifier of authenticated runs: the user named by a valid access token, or None.

    A record is credited only if its token is signed by the run's authority, is for ``run_id``,
    has not expired (at ``now``, give or take ``clock_skew``), and names the very public key that
    signed the record (its ``[owner:...]`` subkey). So a peer that copies another user's token
    gains nothing: the token names the other user's key, not its own. ``revocations`` gives the
    run's current (verified) revocation list: a revoked user or key is credited nothing more,
    even while its token is still valid (what it contributed before stays).
    """

    def verify(owner: bytes, record: SignedRecord, now: float) -> str | None:
        if record.token is None:
            logger.debug("dropping a metrics record without a token (peer %s)", _short(record))
            return None
        try:
            token = AccessToken.from_bytes(record.token)
            verify_token(
                token,
                authority_public_key,
                now=now,
                clock_skew=clock_skew,
                peer_public_key=owner,
                run_id=run_id,
            )
        except AuthError as e:
            logger.debug("dropping a metrics record of peer %s: %s", _short(record), e)
            return None
        banned = revocations() if revocations is not None else None
        reason = banned.reason(token.username, owner, now) if banned is not None else None
        if reason is not None:
            logger.debug("dropping a metrics record of peer %s: %s", _short(record), reason)
            return None
        return token.username

    return verify


def _short(record: SignedRecord) -> str:
    return record.peer_id.hex()[:12]
