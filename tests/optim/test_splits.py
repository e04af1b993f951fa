"""Gradient rounds that split into groups at one epoch: which side copies whose state (pure)."""

from __future__ import annotations

import pytest

from kit.optim.splits import ROUND_HISTORY, RoundTag, SplitWatch, winning_group


def tags(*rounds: tuple[int, bytes, int]) -> tuple[RoundTag, ...]:
    return tuple(RoundTag(*r) for r in rounds)


def test_the_largest_group_wins_then_the_smallest_id() -> None:
    assert winning_group({b"b": 3, b"a": 2}) == b"b"
    assert winning_group({b"b": 2, b"a": 2, b"c": 1}) == b"a"  # every peer picks the same


def test_the_smaller_side_of_a_split_copies_the_larger_and_only_once() -> None:
    # The churn test's split: four peers averaged 2 + 2 at epoch 0.
    watch = SplitWatch()
    ours = tags((0, b"B", 2), (1, b"C", 4))
    others = [(b"p1", tags((0, b"A", 2), (1, b"C", 4))), (b"p2", tags((0, b"A", 2)))]
    assert watch.check(ours, others) == (0, frozenset({b"p1", b"p2"}))
    assert watch.check(ours, others) is None  # followed: not again
    winners = SplitWatch()  # the other side, seeing us: it won the tie
    assert winners.check(others[0][1], [(b"p0", ours)]) is None


def test_nothing_to_do_without_a_split() -> None:
    watch = SplitWatch()
    ours = tags((3, b"G", 3), (4, b"H", 3))
    others = [(b"p1", tags((3, b"G", 3), (4, b"H", 3))), (b"p2", tags((5, b"I", 2)))]
    assert watch.check(ours, others) is None
    assert watch.check((), others) is None  # no round of ours (joined by a download)


def test_a_larger_group_seen_later_is_followed_instead() -> None:
    # Groups of 2, 2 and 3 at epoch 6: a peer of the second saw only the first at first.
    watch = SplitWatch()
    ours = tags((6, b"B", 2))
    first = [(b"p1", tags((6, b"A", 2)))]
    assert watch.check(ours, first) == (6, frozenset({b"p1"}))
    later = [*first, (b"p5", tags((6, b"C", 3))), (b"p6", tags((6, b"C", 3)))]
    assert watch.check(ours, later) == (6, frozenset({b"p5", b"p6"}))
    assert watch.check(ours, later) is None


def test_the_newest_split_is_copied_first_and_old_epochs_are_forgotten() -> None:
    watch = SplitWatch()
    ours = tags((1, b"B", 2), (2, b"D", 2))
    others = [(b"p1", tags((1, b"A", 3), (2, b"C", 3)))]
    assert watch.check(ours, others) == (2, frozenset({b"p1"}))  # its state is newer
    assert watch.check(ours, others) == (1, frozenset({b"p1"}))  # (once that one landed)
    newer = tags(*[(e, b"E", 4) for e in range(3, 3 + ROUND_HISTORY)])
    assert watch.check(newer, others) is None and watch.followed == {}


def test_round_tags_travel_as_plain_values_and_malformed_ones_are_refused() -> None:
    tag = RoundTag(12, b"\x01" * 8, 5)
    assert RoundTag.from_wire(tag.to_wire()) == tag
    for bad in ([12, b"", 5], [12, b"x" * 9, 5], [-1, b"x", 5], [3, b"x", 0], [3, "x", 2], [1, 2]):
        with pytest.raises((ValueError, TypeError)):
            RoundTag.from_wire(bad)
