"""Gradient rounds that split into several groups at one epoch, and which side catches up.

Holds :class:`RoundTag` (what a peer publishes about each of its last gradient rounds) and
:class:`SplitWatch` (pure: given our tags and the others', is there a group we must copy?). It
does not fetch the records (``kit.optim.progress``) nor download the state (``kit.optim.sharing``).

Why. A gradient round begins as soon as the peers it expects are in (``rounds.expected_peers``);
when that count is low (peers that just joined had not reported samples yet), or two leaders
gather at once, one epoch's peers average in two groups. Each group's members end identical to
each other and judge their round full and exact, so nobody is flagged drifted, yet the two groups
stepped with different gradients: parameters *and* optimizer statistics differ. Later rounds give
everyone the same gradient, but different Adam moments turn it into different updates, so the
groups never meet again; parameter averaging would not help either (it leaves the statistics
apart). Seen in tests/netsim/test_churn.py: four peers split 2 + 2 at epoch 0 and ended 168
epochs later 2.5e-3 apart, every round "full".

So every peer publishes, with its progress, a tag of each of its last :data:`ROUND_HISTORY`
gradient rounds (epoch, the group's id, its size). Where the tags of one epoch disagree, the
largest group wins (ties: the smallest id, so every peer picks the same one); the members of
the others flag themselves drifted and download the state from the winners' peers (an exact
copy, statistics included). One record per group suffices to know its size, so a peer need not
see every record; should a larger group show up later, the peer follows it instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

ROUND_HISTORY = 4  # gradient rounds each peer tags in its progress record
TAG_BYTES = 8  # of the group id: enough to tell one epoch's groups apart


@dataclasses.dataclass(frozen=True)
class RoundTag:
    """One gradient round a peer went through: its epoch, its group and the group's size."""

    epoch: int
    group: bytes
    size: int

    def to_wire(self) -> list[int | bytes]:
        return [self.epoch, self.group, self.size]

    @classmethod
    def from_wire(cls, body: object) -> RoundTag:
        """Parse one tag of a progress record (raises ValueError/TypeError when malformed)."""
        if not isinstance(body, list | tuple) or len(body) != 3:
            raise ValueError(f"a round tag is [epoch, group, size], not {body!r:.80}")
        epoch, group, size = body
        if not isinstance(group, bytes) or not 0 < len(group) <= TAG_BYTES:
            raise ValueError(f"a round tag's group is 1-{TAG_BYTES} bytes")
        tag = cls(int(epoch), bytes(group), int(size))
        if tag.epoch < 0 or tag.size < 1:
            raise ValueError(f"a round tag needs epoch >= 0 and size >= 1, not {tag}")
        return tag


def winning_group(groups: dict[bytes, int]) -> bytes:
    """The group every peer follows: the largest, then the smallest id."""
    return min(groups, key=lambda group: (-groups[group], group))


class SplitWatch:
    """Our recent rounds against the others': is there a larger group of one of them to copy?"""

    def __init__(self) -> None:
        self.followed: dict[int, bytes] = {}  # epoch -> the winning group we copied the state of

    def check(
        self, ours: Sequence[RoundTag], others: Iterable[tuple[bytes, Sequence[RoundTag]]]
    ) -> tuple[int, frozenset[bytes]] | None:
        """The newest of our rounds that lost a split, with the peers of the winning group.

        Args:
            ours: our tags (``ROUND_HISTORY`` at most).
            others: per other peer, its id and its tags, as last fetched.

        Returns:
            ``(epoch, peer ids)``: copy the state of one of these peers; None: nothing to do.
            A winner is returned once per epoch (unless a larger group shows up later).
        """
        others = list(others)
        epochs = {tag.epoch for tag in ours}
        self.followed = {e: g for e, g in self.followed.items() if e in epochs}
        for mine in sorted(ours, key=lambda tag: -tag.epoch):
            groups = {mine.group: mine.size}
            members: dict[bytes, set[bytes]] = {}
            for peer_id, tags in others:
                for tag in tags:
                    if tag.epoch == mine.epoch:
                        groups[tag.group] = max(groups.get(tag.group, 0), tag.size)
                        members.setdefault(tag.group, set()).add(peer_id)
            winner = winning_group(groups)
            if winner == mine.group or self.followed.get(mine.epoch) == winner:
                continue
            self.followed[mine.epoch] = winner
            return mine.epoch, frozenset(members[winner])
        return None
