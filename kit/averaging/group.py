"""An assembled averaging group and the join messages that assemble it, as they travel (no pickle).

Holds ``GroupInfo`` (members in order, their roles and weights, the part sizes the leader's load
balancing chose, the group id that numbers the round, and the hash every member checks), the
join request and the leader's answers, and ``schema_hash`` (what peers must share to average
together). Everything a peer receives is checked field by field before use. It does not hold the
state machine (``kit.averaging.matchmaking``) or any I/O.

Why the leader broadcasts the part sizes instead of letting every member solve the LP: scipy
versions may round differently, and members that disagree on who aggregates which slice would
average garbage. One solution, hashed with the rest of the group, is agreed on by construction.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

from kit.averaging.declarations import (
    MAX_GONE,
    Declaration,
    MemberInfo,
    Refusal,
    parse_addresses,
)
from kit.averaging.partition import MAX_CHUNK_SCALE
from kit.errors import GroupMismatch, MalformedFrame
from kit.p2p import wire
from kit.p2p.identity import PeerID

GROUP_ID_BYTES = 16  # random per round: data of two rounds can never be mixed
MAX_GROUP_SIZE = 256  # more members than any DeDLOC-style run puts in one group
MAX_MESSAGE = 256 * 1024  # bytes of one join message (a full group's addresses included)


def schema_hash(descriptors: Sequence[tuple[Sequence[int], str, int]]) -> bytes:
    """What members must share: each tensor's shape, dtype and elements per streamed chunk.

    The chunk size enters because sender and aggregator must cut a part at the same places.
    """
    body = [[list(shape), dtype, chunk] for shape, dtype, chunk in descriptors]
    return hashlib.sha256(wire.packb(["kit.averaging/1", body])).digest()[:20]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class GroupInfo:
    """One round's group, as its leader announced it (the same on every member)."""

    group_id: bytes  # random per round; every all-reduce message carries it
    schema_hash: bytes  # what the members' tensors look like (``schema_hash``)
    peers: tuple[PeerID, ...]  # members in order: the leader first; peer i aggregates part i
    client_mode: tuple[bool, ...]  # per member: accepts no connections (part size 0)
    auxiliary: tuple[bool, ...]  # per member: aggregates but sends no vector (weight 0)
    weights: tuple[float, ...]  # per member: weight of its vector in the average
    part_sizes: tuple[int, ...]  # per member: elements of the flat vector it aggregates
    addresses: tuple[tuple[str, ...], ...]  # per member: where to dial it
    chunk_scale: int = 1  # chunks of this round hold chunk_scale x part_size_bytes (partition)

    @classmethod
    def assemble(
        cls,
        group_id: bytes,
        schema: bytes,
        members: Sequence[MemberInfo],
        part_sizes: Sequence[int],
        chunk_scale: int = 1,
    ) -> GroupInfo:
        return cls(
            group_id,
            schema,
            tuple(m.peer_id for m in members),
            tuple(m.client_mode for m in members),
            tuple(m.auxiliary for m in members),
            tuple(0.0 if m.auxiliary else float(m.weight) for m in members),
            tuple(part_sizes),
            tuple(m.addresses for m in members),
            chunk_scale,
        )

    def to_wire(self) -> dict[str, Any]:
        return {
            "group_id": self.group_id,
            "schema_hash": self.schema_hash,
            "peers": [p.to_bytes() for p in self.peers],
            "client_mode": list(self.client_mode),
            "auxiliary": list(self.auxiliary),
            "weights": list(self.weights),
            "part_sizes": list(self.part_sizes),
            "addresses": [list(a) for a in self.addresses],
            "chunk_scale": self.chunk_scale,
        }

    @functools.cached_property
    def hash(self) -> bytes:
        """SHA-256 of the canonical encoding: members compare it on every all-reduce stream."""
        return hashlib.sha256(wire.packb(self.to_wire())).digest()

    @functools.cached_property
    def _index(self) -> dict[PeerID, int]:
        return {peer: i for i, peer in enumerate(self.peers)}

    def index(self, peer_id: PeerID) -> int | None:
        return self._index.get(peer_id)

    @property
    def senders(self) -> tuple[int, ...]:
        """Indices of the members that contribute a vector (all but auxiliary peers)."""
        return tuple(i for i, aux in enumerate(self.auxiliary) if not aux)

    def __len__(self) -> int:
        return len(self.peers)

    @classmethod
    def from_wire(
        cls, body: Any, *, leader: PeerID, me: MemberInfo, schema: bytes, total_size: int
    ) -> GroupInfo:
        """Check a group announced by ``leader`` before this member acts on it.

        Raises:
            GroupMismatch: malformed, another schema, this member missing or misdescribed,
                part sizes that do not cover the vector, or weights that are not usable.
        """
        if not isinstance(body, Mapping):
            raise GroupMismatch(f"the group from {leader.short()} is not a map")
        try:
            peers = tuple(PeerID(raw) for raw in body["peers"])
            n = len(peers)
            group = cls(
                body["group_id"],
                body["schema_hash"],
                peers,
                tuple(_bools(body["client_mode"], n)),
                tuple(_bools(body["auxiliary"], n)),
                tuple(float(w) if _is_real(w) else math.nan for w in body["weights"]),
                tuple(s if _is_int(s) else -1 for s in body["part_sizes"]),
                tuple(parse_addresses(a) or () for a in body["addresses"]),
                body["chunk_scale"] if _is_int(body["chunk_scale"]) else -1,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise GroupMismatch(
                f"the group from {leader.short()} is malformed: {e!r:.200}"
            ) from None
        group._check(leader=leader, me=me, schema=schema, total_size=total_size)
        return group

    def _check(self, *, leader: PeerID, me: MemberInfo, schema: bytes, total_size: int) -> None:
        n = len(self.peers)
        problems = []
        if not isinstance(self.group_id, bytes) or len(self.group_id) != GROUP_ID_BYTES:
            problems.append("a group id of the wrong size")
        if self.schema_hash != schema:
            problems.append("another tensor schema (shapes, dtypes or part_size_bytes)")
        if not 2 <= n <= MAX_GROUP_SIZE or len(set(self.peers)) != n:
            problems.append(f"{n} members, or duplicates")
        lengths = {len(self.weights), len(self.part_sizes), len(self.addresses)}
        if lengths != {n}:
            problems.append("per-member lists of different lengths")
        if n and self.peers[0] != leader:
            problems.append("a leader that is not its first member")
        mine = self.index(me.peer_id)
        if mine is None:
            problems.append("no place for this peer")
        elif (self.client_mode[mine], self.auxiliary[mine]) != (me.client_mode, me.auxiliary):
            problems.append("this peer's role misdescribed")
        for i in range(min(n, len(self.weights), len(self.part_sizes))):
            weight, size = self.weights[i], self.part_sizes[i]
            if self.client_mode[i] and self.auxiliary[i]:
                problems.append(f"member {i} both client-mode and auxiliary")
            if not (weight == 0 if self.auxiliary[i] else 0 < weight < math.inf):
                problems.append(f"member {i} with weight {weight}")
            if size < 0 or (self.client_mode[i] and size > 0):
                problems.append(f"member {i} aggregating {size} elements")
        if not 1 <= self.chunk_scale <= MAX_CHUNK_SCALE:
            problems.append(f"chunks scaled by {self.chunk_scale} (1 to {MAX_CHUNK_SCALE})")
        if sum(self.part_sizes) != total_size:
            problems.append(f"part sizes summing to {sum(self.part_sizes)}, not {total_size}")
        if problems:
            raise GroupMismatch(
                f"the group from {leader.short()} has {'; '.join(problems[:4])}"
                " - help: this round is skipped; if it repeats, the leader runs another version"
            )


def _bools(values: Any, n: int) -> list[bool]:
    if (
        not isinstance(values, list)
        or len(values) != n
        or not all(isinstance(v, bool) for v in values)
    ):
        raise ValueError("flags must be one bool per member")
    return values


# --- join messages ---------------------------------------------------------------------------


def encode_join_request(prefix: str, group_key: str, schema: bytes, me: MemberInfo) -> bytes:
    return wire.packb(
        {
            "prefix": prefix,
            "group_key": group_key,
            "schema_hash": schema,
            "client_mode": me.client_mode,
            "auxiliary": me.auxiliary,
            "weight": me.weight,
            "bandwidth": me.bandwidth,
            "addresses": list(me.addresses),
        }
    )


def decode_join_request(payload: bytes, caller: PeerID) -> tuple[str, str, bytes, MemberInfo]:
    """(prefix, group key, schema hash, member) of a join request from ``caller``.

    Raises:
        MalformedFrame: not a join request, or fields of the wrong types.
    """
    body = wire.decode_map(
        payload,
        "join request",
        {"prefix": str, "group_key": str, "schema_hash": bytes, "client_mode": bool},
    )
    auxiliary: Any = body.get("auxiliary")
    weight: Any = body.get("weight")
    bandwidth: Any = body.get("bandwidth")
    addresses = parse_addresses(body.get("addresses"))
    if not isinstance(auxiliary, bool) or addresses is None:
        raise MalformedFrame("join request: bad auxiliary flag or addresses")
    if not (_is_real(weight) and (weight == 0 if auxiliary else 0 < weight < math.inf)):
        raise MalformedFrame(f"join request: weight {weight!r:.30} is not usable")
    if bandwidth is not None and not (_is_real(bandwidth) and 0 <= bandwidth < math.inf):
        raise MalformedFrame(f"join request: bandwidth {bandwidth!r:.30} is not usable")
    if auxiliary and body["client_mode"]:
        raise MalformedFrame("join request: a client-mode peer cannot be auxiliary")
    member = MemberInfo(
        caller,
        body["client_mode"],
        auxiliary,
        float(weight),
        None if bandwidth is None else float(bandwidth),
        addresses,
    )
    return body["prefix"], body["group_key"], body["schema_hash"], member


def _declaration_to_wire(declaration: Declaration | None) -> dict[str, Any] | None:
    if declaration is None:
        return None
    return {"peer_id": declaration.peer_id.to_bytes(), **declaration.to_value()}


def _declaration_from_wire(body: Any) -> Declaration | None:
    if not isinstance(body, Mapping) or not isinstance(body.get("peer_id"), bytes):
        return None
    try:
        peer_id = PeerID(body["peer_id"])
    except ValueError:
        return None
    entries = {peer_id.to_bytes(): _Item(body, math.inf)}
    found = Declaration.parse_entries(entries, 0.0)
    return found[0] if found else None


@dataclasses.dataclass(frozen=True)
class _Item:  # the (value, expiration_time) shape parse_entries reads
    value: Any
    expiration_time: float


def encode_answer(refusal: Refusal | None) -> bytes:
    """The leader's answer to a join request."""
    if refusal is None:
        return wire.packb({"code": "accepted"})
    suggested = _declaration_to_wire(refusal.suggested)
    return wire.packb({"code": "refused", "reason": refusal.reason, "suggested": suggested})


def encode_begin(group: GroupInfo) -> bytes:
    return wire.packb({"code": "begin", "group": group.to_wire()})


def encode_release(suggested: Declaration | None, reason: str = "released") -> bytes:
    suggestion = _declaration_to_wire(suggested)
    return wire.packb({"code": "released", "reason": reason, "suggested": suggestion})


def decode_leader_message(payload: bytes) -> tuple[str, Refusal | None, Any]:
    """(code, refusal, group body) of a leader's message: accepted, refused, begin or released.

    Raises:
        MalformedFrame: anything else.
    """
    body = wire.decode_map(payload, "leader message", {"code": str})
    code = body["code"]
    if code in ("refused", "released"):
        reason = body.get("reason", "released")
        reason = reason[:64] if isinstance(reason, str) else "?"
        return code, Refusal(reason, _declaration_from_wire(body.get("suggested"))), None
    if code == "begin":
        return code, None, body.get("group")
    if code == "accepted":
        return code, None, None
    raise MalformedFrame(f"leader message: unknown code {code[:32]!r}")


def encode_invite(
    prefix: str, group_key: str, inviter: Declaration, gone: Sequence[PeerID]
) -> bytes:
    """A leader's invitation: these peers ahead of you are gone (see ``Matchmaker.invited_by``)."""
    return wire.packb(
        {
            "prefix": prefix,
            "group_key": group_key,
            "inviter": _declaration_to_wire(inviter),
            "gone": [p.to_bytes() for p in gone[:MAX_GONE]],
        }
    )


def decode_invite(payload: bytes, caller: PeerID) -> tuple[str, str, Declaration, list[PeerID]]:
    """(prefix, group key, inviter, gone peers) of an invitation from ``caller``.

    Raises:
        MalformedFrame: not an invitation, an inviter other than the caller, or bad peer ids.
    """
    body = wire.decode_map(payload, "invitation", {"prefix": str, "group_key": str, "gone": list})
    inviter = _declaration_from_wire(body.get("inviter"))
    if inviter is None or inviter.peer_id != caller:
        raise MalformedFrame("invitation: the inviter must be the caller")
    gone = body["gone"]
    if len(gone) > MAX_GONE or not all(
        isinstance(p, bytes) and len(p) == PeerID.SIZE for p in gone
    ):
        raise MalformedFrame("invitation: bad list of gone peers")
    return body["prefix"], body["group_key"], inviter, [PeerID(p) for p in gone]
