"""The attestation ledger: a peer's credit is what the OTHER members of its rounds attested (pure).

Members of a gradient round attest the weight (samples) of every member
(``kit.metrics.attestations``). The ledger collects those attestations per round (by the round's
random group id) and credits each member with:

* the weight a *trusted* attester saw, if one took part (the coordinator's auxiliary peer, whose
  tokens name ``@coordinator``: it joins the rounds, and it is the organizer's own);
* else the lower median of the weights attested by members of OTHER users: the member's own
  attestation, and those of other peers of its own user, never count. With two such attesters
  that is the smaller value; with three or more, what most of them saw.

An attestation counts only if its attester is a member of the round it attests, so nobody can
attest rounds it did not take part in. Rounds are folded into per-peer totals ``settle_after``
seconds after they were first seen (late attestations of a settled round are ignored), which
bounds memory on long runs. The book (``kit.metrics.book``) caps each user's claimed samples at
the sum of its peers' credit and flags larger claims.

What remains trusted (say so to volunteers): members of two different users who collude can
attest each other whatever weight they like in a round of their own (or outvote one honest
member); a member can declare a larger weight in the round itself than it computed (its
gradient then counts for more in the average, visibly so in the loss) and is credited with it;
one dishonest member of a two-user round without the auxiliary peer can lower the other's
credit for that round. The auxiliary peer's presence in a round settles all three.

Nothing here reads a clock or does I/O: methods take ``now``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kit.metrics.attestations import AttestationRecord

#: The user name of the coordinator's own peer (kit.auth.authority.COORDINATOR_USERNAME).
TRUSTED_USERS = frozenset({"@coordinator"})
MAX_PEERS = 100_000  # peer → user entries kept
#: Settled rounds are remembered this long (longer than attestation records live in the DHT,
#: kit.metrics.attestations), so that their attestations are never counted twice.
REMEMBER_SETTLED = 2 * 3600.0
MAX_SETTLED_IDS = 200_000


@dataclass
class _Round:
    epoch: int
    first_seen: float
    members: frozenset[bytes]
    #: attester peer id → (its user, {member peer id: weight})
    attestations: dict[bytes, tuple[str, dict[bytes, float]]] = field(default_factory=dict)


class AttestationLedger:
    """Per-peer credit from round attestations (see the module docstring).

    Args:
        settle_after: seconds after which a round's credit is final (its members publish their
            attestations within seconds; the coordinator reads them every metrics period).
        trusted_users: users whose attestation decides a round alone (the coordinator's).
    """

    def __init__(
        self, *, settle_after: float = 900.0, trusted_users: frozenset[str] = TRUSTED_USERS
    ) -> None:
        self.settle_after = settle_after
        self.trusted_users = trusted_users
        self._rounds: dict[bytes, _Round] = {}
        self._settled: dict[bytes, float] = {}  # peer id → credit of its settled rounds
        self._largest: dict[bytes, float] = {}  # peer id → its largest credited round weight
        self._users: dict[bytes, str] = {}  # peer id → its (verified) user
        self._settled_ids: dict[bytes, float] = {}  # settled round → when (oldest first)

    # --- ingest ---------------------------------------------------------------------------

    def note_user(self, peer_id: bytes, user: str) -> None:
        """``peer_id`` belongs to ``user`` (from a verified record of that peer)."""
        self._users[peer_id] = user
        if len(self._users) > MAX_PEERS:
            self._users.pop(next(iter(self._users)))

    def add(self, attester: bytes, user: str, record: AttestationRecord, now: float) -> int:
        """Take the attestations of ``attester`` (a peer of ``user``, verified by the caller);
        returns how many round attestations were new."""
        self.note_user(attester, user)
        added = 0
        for attested in record.rounds:
            weights = dict(attested.weights)
            if attester not in weights:
                continue  # only members attest a round
            held = self._rounds.get(attested.group_id)
            if held is None:
                if attested.group_id in self._settled_ids:
                    continue
                held = _Round(attested.epoch, now, frozenset(weights))
                self._rounds[attested.group_id] = held
            elif attester in held.attestations or frozenset(weights) != held.members:
                continue  # seen already, or another membership: ignore (first one wins)
            held.attestations[attester] = (user, weights)
            added += 1
        self._settle(now)
        return added

    # --- outputs --------------------------------------------------------------------------

    def credit(self, peer_id: bytes) -> float:
        """The samples ``peer_id`` is credited with, settled and open rounds together."""
        total = self._settled.get(peer_id, 0.0)
        for held in self._rounds.values():
            if peer_id in held.members:
                total += self._credit(held, peer_id)
        return total

    def largest_round(self, peer_id: bytes) -> float:
        """The largest weight ``peer_id`` was credited with in one round (0 if none)."""
        largest = self._largest.get(peer_id, 0.0)
        for held in self._rounds.values():
            if peer_id in held.members:
                largest = max(largest, self._credit(held, peer_id))
        return largest

    def users(self) -> dict[bytes, str]:
        """Peer id → user, for every peer the ledger knows the user of."""
        return dict(self._users)

    # --- internals ------------------------------------------------------------------------

    def _credit(self, held: _Round, member: bytes) -> float:
        member_user = self._users.get(member)
        trusted: list[float] = []
        others: list[float] = []
        for attester, (user, weights) in held.attestations.items():
            if attester == member or (member_user is not None and user == member_user):
                continue  # nobody attests for itself, nor for its own user's peers
            if member in weights:
                (trusted if user in self.trusted_users else others).append(weights[member])
        if trusted:
            return min(trusted)
        if not others:
            return 0.0
        others.sort()
        return others[(len(others) - 1) // 2]  # the lower median

    def _settle(self, now: float) -> None:
        due = [g for g, held in self._rounds.items() if now - held.first_seen > self.settle_after]
        for group_id in due:
            held = self._rounds.pop(group_id)
            for member in held.members:
                credit = self._credit(held, member)
                self._settled[member] = self._settled.get(member, 0.0) + credit
                self._largest[member] = max(self._largest.get(member, 0.0), credit)
            self._settled_ids[group_id] = now  # its attestations stay in the DHT a while
        for group_id in [g for g, t in self._settled_ids.items() if now - t > REMEMBER_SETTLED]:
            del self._settled_ids[group_id]
        while len(self._settled_ids) > MAX_SETTLED_IDS:
            self._settled_ids.pop(next(iter(self._settled_ids)))

    # --- persistence ----------------------------------------------------------------------

    def to_state(self) -> dict[str, Any]:
        """JSON-ready state (settled totals and open rounds), for :meth:`load_state`."""
        return {
            "settled": {pid.hex(): credit for pid, credit in self._settled.items()},
            "largest": {pid.hex(): weight for pid, weight in self._largest.items()},
            "users": {pid.hex(): user for pid, user in self._users.items()},
            "settled_rounds": {gid.hex(): when for gid, when in self._settled_ids.items()},
            "rounds": {
                group_id.hex(): {
                    "epoch": held.epoch,
                    "first_seen": held.first_seen,
                    "members": [pid.hex() for pid in held.members],
                    "attestations": {
                        attester.hex(): [user, {pid.hex(): w for pid, w in weights.items()}]
                        for attester, (user, weights) in held.attestations.items()
                    },
                }
                for group_id, held in self._rounds.items()
            },
        }

    def load_state(self, state: dict[str, Any]) -> None:
        """Replace this ledger's state with one from :meth:`to_state` (raises on bad input:
        ValueError, TypeError, KeyError, AttributeError)."""
        settled = {bytes.fromhex(k): float(v) for k, v in state["settled"].items()}
        largest = {bytes.fromhex(k): float(v) for k, v in state["largest"].items()}
        users = {bytes.fromhex(k): str(v) for k, v in state["users"].items()}
        settled_ids = {bytes.fromhex(k): float(v) for k, v in state["settled_rounds"].items()}
        rounds = {}
        for group_id, held in state["rounds"].items():
            attestations = {
                bytes.fromhex(attester): (
                    str(user),
                    {bytes.fromhex(pid): float(w) for pid, w in weights.items()},
                )
                for attester, (user, weights) in held["attestations"].items()
            }
            rounds[bytes.fromhex(group_id)] = _Round(
                int(held["epoch"]),
                float(held["first_seen"]),
                frozenset(bytes.fromhex(pid) for pid in held["members"]),
                attestations,
            )
        self._settled, self._largest, self._users, self._rounds = settled, largest, users, rounds
        self._settled_ids = settled_ids
