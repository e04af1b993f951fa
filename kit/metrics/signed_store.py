"""One peer's own signed record under a DHT key: what the metrics reporter and the round
attestor share.

Holds :class:`SignedStore`: the peer's subkey (its signature owner, so nobody else can overwrite
the record), the access token source read at each store, the record's lifetime, and a count of
successful stores. It does not decide what the record says nor when it is stored
(``kit.metrics.reporter``, ``kit.metrics.attestations``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kit.dht.node import DHTNode, get_dht_time
from kit.dht.validation import Ed25519SignatureValidator
from kit.p2p.identity import Identity

logger = logging.getLogger(__name__)


class SignedStore:
    """Stores ``identity``'s record under ``key`` (signed, ``expiration`` seconds long).

    Args:
        token: the access token to put in the record (None: an open run); it is the caller's
            code, so a failure only leaves the token out.
    """

    def __init__(
        self,
        node: DHTNode,
        key: str,
        identity: Identity,
        *,
        expiration: float,
        token: Callable[[], bytes | None] | None = None,
    ) -> None:
        self.node = node
        self.key = key
        self.expiration = expiration
        self._token = token
        validator = Ed25519SignatureValidator(identity)
        node.add_validators([validator])
        self._subkey = validator.local_owner
        self.stores = 0  # successful stores (diagnostics, tests)

    def token(self) -> bytes | None:
        """The current access token, or None (none given, or its source failed)."""
        if self._token is None:
            return None
        try:
            return self._token()
        except Exception as e:  # the token source is the caller's code; keep publishing
            logger.debug("no access token for the record under %r: %r", self.key, e)
            return None

    async def store(self, body: dict[str, Any], now: float | None = None) -> bool:
        """Store ``body`` now (on the runtime loop); True if a replica accepted it."""
        now = get_dht_time() if now is None else now
        stored: bool = await self.node.store(
            self.key, body, now + self.expiration, subkey=self._subkey
        )
        if stored:
            self.stores += 1
        return stored
