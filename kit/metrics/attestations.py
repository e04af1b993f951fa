"""Round attestations: what each member of an averaging round saw the others contribute.

A contribution record (``kit.metrics.records``) is what a peer says about ITSELF: nothing stops
it from claiming 777 samples it never computed. The samples that count are the ones that
entered gradient rounds, and every member of a round knows each member's weight in it (the
group's leader announces them and every member checks the group's hash, DeDLOC's averaging
weighted by samples). So after each round every member attests the weights of the whole group:
a :class:`RoundAttestor` keeps its recent rounds in one owner-signed DHT record under
:func:`attestations_key` (``f"{run_id}_attestations"``, subkey: its ``[owner:...]`` marker,
carrying its access token in authenticated runs), and the coordinator's book credits a peer
only with what the OTHER members of its rounds attested (``kit.metrics.ledger``).

Record: ``{"peer_id", "token", "members": [peer ids], "rounds": [[group id, epoch,
[[member index, weight], ...]], ...]}``, the newest :data:`MAX_ROUNDS` rounds. Everything that
arrives from the DHT is checked by :meth:`AttestationRecord.from_dict`.

What this module does not do: the accounting (``ledger``, ``book``), running rounds
(``kit.optim`` calls :meth:`RoundAttestor.record` through ``Optimizer.add_round_listener``).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kit.dht.node import DHTNode
from kit.errors import ConfigError, KitError, KitUsageError
from kit.metrics.records import MAX_PEER_ID_BYTES, MAX_SAMPLES, MAX_TOKEN_BYTES
from kit.metrics.signed_store import SignedStore
from kit.p2p.identity import Identity, PeerID

logger = logging.getLogger(__name__)

MAX_ROUNDS = 64  # rounds one record keeps (the newest): hours of a real run, ~6 KB
MAX_MEMBERS = 64  # distinct members one record names
MAX_GROUP = 64  # members of one attested round
GROUP_ID_BYTES = 16  # kit.averaging.group.GROUP_ID_BYTES


def attestations_key(run_id: str) -> str:
    """The DHT key under which the members of ``run_id``'s rounds attest each other's weights."""
    return f"{run_id}_attestations"


class AveragedRound(Protocol):
    """What a gradient round's result tells (``kit.averaging.averager.RoundResult``)."""

    group_id: bytes
    peers: Sequence[PeerID]
    weights: Sequence[float]


@dataclass(frozen=True)
class AttestedRound:
    group_id: bytes  # the round's random id: the same in every member's attestation
    epoch: int  # the global step the round averaged
    weights: tuple[tuple[bytes, float], ...]  # (member peer id, its weight in the round)


@dataclass(frozen=True)
class AttestationRecord:
    """One peer's attestation of the rounds it took part in (the newest ones)."""

    peer_id: bytes  # the attesting peer (must match the key that signed the record)
    token: bytes | None  # its access token (authenticated runs): who attests
    rounds: tuple[AttestedRound, ...]

    def to_dict(self) -> dict[str, Any]:
        members: dict[bytes, int] = {}
        rounds = []
        for attested in self.rounds:
            weights = [[members.setdefault(pid, len(members)), w] for pid, w in attested.weights]
            rounds.append([attested.group_id, attested.epoch, weights])
        return {
            "peer_id": self.peer_id,
            "token": self.token,
            "members": list(members),
            "rounds": rounds,
        }

    @classmethod
    def from_dict(cls, body: Any) -> AttestationRecord | None:
        """Parse a record from the DHT; None (and a debug line) for anything malformed."""
        try:
            return _parse(body)
        except (KeyError, TypeError, ValueError, IndexError) as e:
            logger.debug("ignoring a malformed attestation record (%s): %.200r", e, body)
            return None


def _parse(body: Any) -> AttestationRecord:
    if not isinstance(body, dict):
        raise TypeError("a record is a map")
    peer_id, token = body["peer_id"], body["token"]
    if not isinstance(peer_id, bytes) or not 0 < len(peer_id) <= MAX_PEER_ID_BYTES:
        raise ValueError("bad peer_id")
    if token is not None and (not isinstance(token, bytes) or len(token) > MAX_TOKEN_BYTES):
        raise ValueError("bad token")
    members, rounds = body["members"], body["rounds"]
    if not isinstance(members, list) or len(members) > MAX_MEMBERS:
        raise ValueError("bad members")
    if not all(isinstance(m, bytes) and 0 < len(m) <= MAX_PEER_ID_BYTES for m in members):
        raise ValueError("bad member id")
    if not isinstance(rounds, list) or len(rounds) > MAX_ROUNDS:
        raise ValueError("bad rounds")
    parsed = []
    for group_id, epoch, weights in rounds:
        if not isinstance(group_id, bytes) or len(group_id) != GROUP_ID_BYTES:
            raise ValueError("bad group id")
        if type(epoch) is not int or not 0 <= epoch < 2**40:
            raise ValueError("bad epoch")
        if not isinstance(weights, list) or not 0 < len(weights) <= MAX_GROUP:
            raise ValueError("bad group")
        pairs = []
        for index, weight in weights:
            if type(index) is not int or type(weight) not in (int, float):
                raise TypeError("a weight is [member index, number]")
            if not (math.isfinite(weight) and 0 <= weight <= MAX_SAMPLES):
                raise ValueError(f"weight {weight!r}")
            pairs.append((members[index], float(weight)))
        if len({pid for pid, _ in pairs}) != len(pairs):
            raise ValueError("a member twice in one round")
        parsed.append(AttestedRound(group_id, epoch, tuple(pairs)))
    return AttestationRecord(peer_id, token, tuple(parsed))


class RoundAttestor:
    """Publishes this peer's attestation of its recent rounds (a task on the runtime loop).

    Create and :meth:`start` it on the runtime loop; call :meth:`record` from any thread (the
    optimizer's, after a round): it only appends to a bounded deque and wakes the loop.

    Args:
        node: this peer's running DHT node.
        run_id: the run; records live under ``attestations_key(run_id)``.
        identity: this peer's key (signs the record; its token must name it).
        token: returns this peer's current access token bytes, or None in open runs.
        min_interval: seconds between two stores (rounds in between go out together).
        expiration: lifetime of a stored record. Increase this if the coordinator may be down
            longer (it reads the newest :data:`MAX_ROUNDS` rounds when it is back).

    Raises:
        ConfigError: an interval or expiration that is not positive.
    """

    def __init__(
        self,
        node: DHTNode,
        run_id: str,
        identity: Identity,
        *,
        token: Callable[[], bytes | None] | None = None,
        min_interval: float = 2.0,
        expiration: float = 3600.0,
    ) -> None:
        if not (min_interval > 0 and expiration > min_interval):
            raise ConfigError(
                f"RoundAttestor: min_interval={min_interval!r}, expiration={expiration!r} must "
                "satisfy 0 < min_interval < expiration - help: keep the defaults"
            )
        self.min_interval = min_interval
        self._store = SignedStore(
            node, attestations_key(run_id), identity, expiration=expiration, token=token
        )
        self._peer_id = identity.peer_id.to_bytes()
        self._rounds: collections.deque[AttestedRound] = collections.deque(maxlen=MAX_ROUNDS)
        self._recorded = 0  # rounds recorded so far (only the optimizer's thread adds)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def stores(self) -> int:
        """Successful stores (diagnostics, tests)."""
        return self._store.stores

    def start(self) -> None:
        if self._task is not None:
            raise KitUsageError("RoundAttestor.start() was called twice - help: call it once")
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._task = self._loop.create_task(self._run(), name="kit-round-attestor")

    async def shutdown(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def record(self, epoch: int, result: AveragedRound) -> None:
        """Attest one round: its members and their weights (any thread; never raises on a
        round that cannot be attested, it is skipped)."""
        members = [peer.to_bytes() for peer in result.peers]
        if len(result.weights) != len(members) or not 0 < len(members) <= MAX_GROUP:
            logger.debug("not attesting a round without one weight per member")
            return
        weights = tuple((pid, float(w)) for pid, w in zip(members, result.weights, strict=True))
        self._rounds.append(AttestedRound(bytes(result.group_id), int(epoch), weights))
        self._recorded += 1
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None and not loop.is_closed():
            loop.call_soon_threadsafe(wake.set)

    def current(self) -> AttestationRecord:
        """The record as it would be published now (newest rounds, at most MAX_MEMBERS)."""
        rounds: list[AttestedRound] = []
        members: set[bytes] = set()
        for attested in reversed(self._rounds):  # keep the newest that fit the member table
            names = {pid for pid, _ in attested.weights}
            if len(members | names) > MAX_MEMBERS:
                break
            members |= names
            rounds.append(attested)
        return AttestationRecord(self._peer_id, self._store.token(), tuple(reversed(rounds)))

    async def publish(self) -> bool:
        return await self._store.store(self.current().to_dict())

    async def _run(self) -> None:
        assert self._wake is not None
        published = 0
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self._recorded != published:
                published = self._recorded
                try:
                    await self.publish()
                except KitError as e:  # the DHT recovers; the next round publishes again
                    logger.debug("storing the attestation record failed: %s", e)
            await asyncio.sleep(self.min_interval)
