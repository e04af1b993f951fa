"""Member relays of a run: who publishes them, how the coordinator lists them in ``/api/run``.

NAT'd volunteers (Colab, Kaggle) reach the swarm through relays. With the coordinator as the only
relay it forwards every NAT'd volunteer's traffic until hole punching takes over, and in an
allowlisted run a plain ``kit dht`` peer could not help: it has no access token, so every member
refuses it at the handshake. A member's machine with a public address can:

    kit dht --join https://run.example.org --hf-token hf_... --port 31337

logs in as a volunteer does (an allowlisted Hugging Face user; its peer key gets a token), joins
the run's DHT and relays. It publishes its addresses under ``relays_key(run_id)`` with its own
``[owner:...]`` subkey (:class:`RelayAnnouncer`: owner-signed, so nobody can list relays in its
name; they expire when it stops refreshing them). The coordinator reads them every
``REFRESH_PERIOD`` (:class:`RelayDirectory`) and ``/api/run`` hands them out twice: after its own
addresses in ``initial_peers`` (joining), and first, shuffled per request, in ``relays`` (so
volunteers spread their registrations over the member relays instead of all choosing the first
two). A relay whose key is banned is dropped from the list at once; one whose user is banned
loses its connections (every peer's session guard), and its record expires within
``RECORD_LIFETIME``.

What it does not do: relay (``kit.p2p.relay``), log in (``kit.auth``), choose among relays (the
volunteer's ``RelayClient`` registers with the first that accept it).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Collection, Sequence
from typing import Any

from kit.address import AddressError, parse_address
from kit.dht.node import DHTNode
from kit.dht.validation import owned_values
from kit.metrics.signed_store import SignedStore
from kit.p2p.identity import Identity
from kit.p2p.interfaces import Scope, scope
from kit.runtime import PeriodicTask

logger = logging.getLogger(__name__)

REFRESH_PERIOD = 30.0  # seconds between a relay's stores and the coordinator's reads
RECORD_LIFETIME = 3 * REFRESH_PERIOD  # a relay that stopped drops out within this
MAX_ADDRESSES_PER_RELAY = 4  # a record with more lists only the first ones
MAX_RELAYS = 32  # /api/run lists at most this many member relays


def relays_key(run_id: str) -> str:
    return f"{run_id}_relays"


def relay_record(addresses: Sequence[str], *, local: bool = False) -> dict[str, Any] | None:
    """The record a member relay stores: its dialable addresses (None: it has none).
    ``local``: a run on one machine, where loopback addresses are dialable too."""
    usable = [a for a in addresses if _dialable(a, local)][:MAX_ADDRESSES_PER_RELAY]
    return {"addresses": usable} if usable else None


def _dialable(text: Any, local: bool) -> bool:
    """A direct address a remote volunteer could dial: no relayed or wildcard one, and no
    loopback one unless the run is ``local`` (a member listing 127.0.0.1 to a remote volunteer
    would make it dial itself)."""
    if not isinstance(text, str) or len(text) > 512:
        return False
    try:
        address = parse_address(text)
    except AddressError:
        return False
    if address.relay is not None or address.peer_id is None:
        return False
    allowed = {Scope.GLOBAL, Scope.PRIVATE, Scope.NAME} | ({Scope.LOOPBACK} if local else set())
    return scope(address.host) in allowed


def relay_records(value: Any, *, local: bool = False) -> list[tuple[bytes, list[str]]]:
    """The member relays in a ``node.get(relays_key)`` answer (owner-verified by the DHT), each
    with its owner's key; at most ``MAX_RELAYS``. ``local``: the coordinator listens on loopback
    (a run on one machine): loopback relays count."""

    def parse(value: Any) -> list[str] | None:
        if not isinstance(value, dict) or not isinstance(value.get("addresses"), list):
            return None
        listed = value["addresses"][:MAX_ADDRESSES_PER_RELAY]
        return [a for a in listed if _dialable(a, local)] or None

    return owned_values(value, parse)[:MAX_RELAYS]


def relay_addresses(
    records: Sequence[tuple[bytes, list[str]]], banned_keys: Collection[bytes] = ()
) -> list[str]:
    """The addresses of ``records`` whose key is not banned, each once."""
    found: list[str] = []
    for owner, addresses in records:
        if owner not in banned_keys:
            found += [a for a in addresses if a not in found]
    return found


class RelayAnnouncer(PeriodicTask):
    """Keeps this relay's record in the DHT (a task on the runtime loop).

    Args:
        node: the relay's running DHT node.
        run_id: the run.
        identity: the relay peer's key (signs the record; its token was issued to it).
        addresses: returns the addresses to publish (asked at every store: they may change).
        local: a run on one machine (the coordinator's link is loopback): loopback addresses
            are published too.
    """

    def __init__(
        self,
        node: DHTNode,
        run_id: str,
        identity: Identity,
        addresses: Callable[[], Sequence[str]],
        *,
        local: bool = False,
        period: float = REFRESH_PERIOD,
    ) -> None:
        self.period, self.local = period, local
        self._addresses = addresses
        self._store = SignedStore(node, relays_key(run_id), identity, expiration=3 * period)

    @property
    def stores(self) -> int:
        return self._store.stores

    async def once(self) -> None:
        """Store the record now (a warning instead when there is no dialable address)."""
        record = relay_record(self._addresses(), local=self.local)
        if record is None:
            logger.warning(
                "this relay has no address volunteers can dial - help: pass --announce with "
                "its public IP or DNS name"
            )
            return
        await self._store.store(record)


class RelayDirectory(PeriodicTask):
    """The coordinator's view of the member relays, read every ``period`` seconds.

    Args:
        node: the coordinator's running DHT node.
        run_id: the run.
        banned_keys: returns the peer keys banned now (the coordinator's ban list).
        local: the coordinator listens on loopback only (a run on one machine).
    """

    def __init__(
        self,
        node: DHTNode,
        run_id: str,
        banned_keys: Callable[[], Collection[bytes]] = frozenset,
        *,
        local: bool = False,
        period: float = REFRESH_PERIOD,
    ) -> None:
        self.node, self.key, self.period, self.local = node, relays_key(run_id), period, local
        self._banned_keys = banned_keys
        self._records: list[tuple[bytes, list[str]]] = []

    @property
    def addresses(self) -> list[str]:
        """The member relays' addresses as last read, without the keys banned now (a ban
        applies at once, not at the next read)."""
        return relay_addresses(self._records, self._banned_keys())

    def shuffled(self) -> list[str]:
        """:attr:`addresses` in a fresh random order (one per ``/api/run`` answer)."""
        found = self.addresses
        return random.sample(found, len(found))

    async def once(self) -> None:
        """Read the records now.

        Raises:
            KitError: the DHT lookup failed.
        """
        result = await self.node.get(self.key, latest=True)
        self._records = relay_records(
            result.value if result is not None else None, local=self.local
        )
