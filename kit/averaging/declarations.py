"""What matchmaking peers tell each other, and the actions of the state machine.

Holds ``MatchmakingSettings`` (how groups form), ``Declaration`` (what a looking peer publishes
in the DHT, parsed from untrusted values), ``MemberInfo`` (what a follower tells its leader),
``Refusal``, and the actions the pure ``Matchmaker`` (``kit.averaging.matchmaking``) asks its
driver to carry out: ``AskLeader``, ``Release``, ``Begin``, ``Invite``, ``Pool``. No logic, no I/O.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from kit.errors import ConfigError
from kit.p2p.identity import PeerID

MAX_ADDRESSES = 8  # addresses kept per peer (declarations, join requests, groups)
MAX_ADDRESS_LENGTH = 1024  # characters of one address


@dataclasses.dataclass(frozen=True)
class MatchmakingSettings:
    """How groups form; every field is an argument of ``DecentralizedAverager``."""

    target_group_size: int | None = None  # begin at once with this many members (None: no cap)
    min_group_size: int = 2  # fewer members than this never begin a round
    min_matchmaking_time: float = 5.0  # a leader waits this long for followers before beginning
    request_timeout: float = 3.0  # a leader must answer a join request within this; retry after it

    def __post_init__(self) -> None:
        if self.min_group_size < 2:
            raise ConfigError(
                f"min_group_size={self.min_group_size} must be >= 2"
                " - help: a round needs at least two peers"
            )
        if self.target_group_size is not None and self.target_group_size < self.min_group_size:
            raise ConfigError(
                f"target_group_size={self.target_group_size} < min_group_size="
                f"{self.min_group_size} - help: raise target_group_size or leave it None"
            )
        if not (self.min_matchmaking_time >= 0 and self.request_timeout > 0):
            raise ConfigError(
                "min_matchmaking_time must be >= 0 and request_timeout > 0 seconds"
                " - help: e.g. min_matchmaking_time=5 (internet: 10-15), request_timeout=3"
            )


@dataclasses.dataclass(frozen=True)
class Declaration:
    """A looking peer's entry under the group key: it leads if it is the best one around."""

    peer_id: PeerID
    expiration: float  # DHT time by which it begins a round, if it has enough followers
    addresses: tuple[str, ...]  # where to dial it

    @property
    def rank(self) -> tuple[float, bytes]:
        """Peers are ordered by this: the earliest expiration, then the smallest id."""
        return (self.expiration, self.peer_id.to_bytes())

    @property
    def can_lead(self) -> bool:
        """Others can dial it (client-mode peers declare no address)."""
        return bool(self.addresses)

    def to_value(self) -> dict[str, Any]:
        return {"expiration": self.expiration, "addresses": list(self.addresses)}

    @classmethod
    def parse_entries(cls, entries: Any, now: float) -> list[Declaration]:
        """Declarations from a DHT dictionary value ``{subkey: (value, expiration)}``.

        Entries of other shapes (tombstones, hostile or corrupted values) are skipped.
        """
        declarations: list[Declaration] = []
        if not isinstance(entries, Mapping):
            return declarations
        for subkey, item in entries.items():
            value = getattr(item, "value", None)
            expiration_time = getattr(item, "expiration_time", 0.0)
            if not isinstance(subkey, bytes) or len(subkey) != PeerID.SIZE:
                continue
            if not isinstance(value, Mapping) or not expiration_time >= now:
                continue
            expiration, addresses = value.get("expiration"), value.get("addresses")
            if not (isinstance(expiration, float | int) and math.isfinite(expiration)):
                continue
            parsed = parse_addresses(addresses)
            if parsed is not None:
                declarations.append(cls(PeerID(subkey), float(expiration), parsed))
        return declarations


def parse_addresses(addresses: Any) -> tuple[str, ...] | None:
    """Untrusted addresses as a tuple of at most MAX_ADDRESSES strings, or None if malformed."""
    if not isinstance(addresses, list | tuple) or len(addresses) > MAX_ADDRESSES:
        return None
    if not all(isinstance(a, str) and 0 < len(a) <= MAX_ADDRESS_LENGTH for a in addresses):
        return None
    return tuple(addresses)


@dataclasses.dataclass(frozen=True)
class MemberInfo:
    """What a peer brings to a group (a follower sends it in its join request)."""

    peer_id: PeerID
    client_mode: bool  # aggregates nothing, never leads (others cannot connect to it directly)
    auxiliary: bool  # aggregates, but contributes no vector (weight 0)
    weight: float  # this round's weight of its vector (e.g. samples); 0 for auxiliary peers
    bandwidth: float | None  # for load balancing; None = unknown (the group's mean is used)
    addresses: tuple[str, ...]  # where to dial it (empty for client-mode peers)


@dataclasses.dataclass(frozen=True)
class AskLeader:
    """Open a join request to ``leader`` (its addresses are in ``declaration``)."""

    declaration: Declaration


@dataclasses.dataclass(frozen=True)
class Release:
    """Tell these followers the group will not happen here; ``suggested``: who to ask instead.
    ``reason``: "released" (this peer stops leading), or "misplaced" (it leads another chunk:
    a follower refused by ``suggested`` may come back)."""

    followers: tuple[PeerID, ...]
    suggested: Declaration | None
    reason: str = "released"


@dataclasses.dataclass(frozen=True)
class Begin:
    """This peer leads the group ``members`` (itself first, then followers in join order)."""

    members: tuple[MemberInfo, ...]


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Why a join request was refused, and who the asker should try instead."""

    reason: str  # not_looking | following | full | not_a_leader | unreachable | duplicate | ...
    suggested: Declaration | None = None


@dataclasses.dataclass(frozen=True)
class Invite:
    """Tell ``peer`` (of this leader's chunk, not joined) which peers ahead of it are gone."""

    peer: Declaration
    gone: tuple[PeerID, ...]


@dataclasses.dataclass(frozen=True)
class Pool:
    """This peer's shard cannot fill its chunk: withdraw from the shard's key and declare
    ``declaration`` under the pool key, where the remainders of every shard meet."""

    declaration: Declaration


Action = AskLeader | Release | Begin | Invite | Pool
MAX_GONE = 64  # gone peers named in one invitation
