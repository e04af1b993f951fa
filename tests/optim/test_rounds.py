"""The gradient round of an epoch: who is expected, when it gives up, and what its result means.

The averager is a recorder (its step a ``StepControl`` the test completes from a thread); the
swarm tests in test_optimizer.py run real rounds.
"""

from __future__ import annotations

import logging
import threading
import types

import pytest
import torch

from kit.averaging.control import StepControl
from kit.averaging.deadlines import Deadlines
from kit.errors import AveragingFailed
from kit.optim.accumulation import GradientAccumulator
from kit.optim.epoch_actions import Judgement
from kit.optim.rounds import (
    POLL,
    GradientRounds,
    RoundOutcome,
    average_at_epoch,
    average_on_grid,
    expected_peers,
    group_bits,
)
from kit.optim.stepping import InnerOptimizer
from kit.p2p.identity import PeerID
from tests.optim.recorders import Averager, Result


class Tracker:
    def __init__(self, with_samples: int, at_epoch: int, epoch: int = 4) -> None:
        self.with_samples, self.at_epoch, self.epoch = with_samples, at_epoch, epoch

    def peers_at_epoch(self, epoch: int, *, with_samples: bool = False) -> int:
        return self.with_samples if with_samples else self.at_epoch

    @property
    def global_progress(self) -> types.SimpleNamespace:
        return types.SimpleNamespace(epoch=self.epoch)


def test_group_bits_separate_epochs() -> None:
    assert group_bits(5) == "00000000000000000101" and len(group_bits(2**20 + 5)) == 20
    assert group_bits(5) != group_bits(6) and group_bits(2**20 + 5) == group_bits(5)


@pytest.mark.parametrize(
    ("result", "expected", "exact", "judgement"),
    [
        (Result(3), 3, True, Judgement(True, True, False, 3)),
        (Result(2), 3, True, Judgement(True, False, False, 2)),  # the group split
        (Result(3), 3, False, Judgement(True, False, False, 3)),  # a lossy codec
        (Result(3, is_full=False), 3, True, Judgement(True, False, True, 3)),
        (None, 3, True, Judgement(False, False, True, 0)),
    ],
)
def test_an_outcome_is_judged(
    result: Result | None, expected: int, exact: bool, judgement: Judgement
) -> None:
    outcome = RoundOutcome(4, result, expected, exact)  # type: ignore[arg-type]
    assert outcome.judgement() == judgement


def test_failed_and_partial_rounds_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kit.optim.rounds"):
        RoundOutcome(4, None, 3, True).log()
        RoundOutcome(5, Result(3, is_full=False), 3, True).log()  # type: ignore[arg-type]
        RoundOutcome(6, Result(3), 3, True).log()  # type: ignore[arg-type]
    assert [r.getMessage() for r in caplog.records] == [
        "averaging failed at epoch 4: proceeding with the local gradients",
        "averaging at epoch 5 was partial: parts (1,) step with a zero gradient",
    ]


def test_a_round_expects_the_peers_with_samples_at_its_epoch() -> None:
    averager = Averager([torch.zeros(2)], lambda control: control.set_result(Result(3)))
    tracker = Tracker(with_samples=3, at_epoch=4)
    expected = expected_peers(tracker, 4, 0)  # type: ignore[arg-type]
    result = average_at_epoch(
        averager,  # type: ignore[arg-type]
        tracker,  # type: ignore[arg-type]
        4,
        32.0,
        expected=expected,
        matchmaking_time=0.5,
        averaging_timeout=5.0,
    )
    assert result is not None and len(result) == 3 and expected == 3
    assert (
        averager.bits == [group_bits(4)] and averager.targets == [3] and averager.weights == [32.0]
    )


@pytest.mark.parametrize(("at_epoch", "last", "target"), [(1, 4, 4), (2, 0, 2), (1, 0, None)])
def test_without_reports_of_samples_a_round_expects_the_last_group(
    at_epoch: int, last: int, target: int | None
) -> None:
    averager = Averager(
        [torch.zeros(2)], lambda control: control.set_exception(AveragingFailed("no group"))
    )
    tracker = Tracker(with_samples=1, at_epoch=at_epoch)
    result = average_at_epoch(
        averager,  # type: ignore[arg-type]
        tracker,  # type: ignore[arg-type]
        4,
        32.0,
        expected=expected_peers(tracker, 4, last),  # type: ignore[arg-type]
        matchmaking_time=0.5,
        averaging_timeout=5.0,
    )
    assert result is None and averager.targets == [target]


def test_a_round_still_looking_after_the_others_moved_on_gives_up() -> None:
    averager = Averager([torch.zeros(2)], lambda control: None)  # nobody ever comes
    result = average_at_epoch(
        averager,  # type: ignore[arg-type]
        Tracker(with_samples=3, at_epoch=3, epoch=5),  # type: ignore[arg-type]
        4,
        32.0,
        expected=3,
        matchmaking_time=30.0,  # it would otherwise wait this long
        averaging_timeout=60.0,
    )
    assert result is None


def test_gradient_rounds_feed_the_optimizer_and_tell_listeners() -> None:
    averager = Averager([torch.zeros(2)], lambda control: control.set_result(Result(2)))
    rounds = GradientRounds(
        averager,  # type: ignore[arg-type]
        Tracker(with_samples=2, at_epoch=2),  # type: ignore[arg-type]
        deadlines=Deadlines.create(0.5, 5.0, 8),
        target_group_size=None,
        me=PeerID(bytes(32)),
        exact_gradients=True,
    )
    heard: list[tuple[int, int]] = []
    rounds.listeners.append(lambda epoch, result: heard.append((epoch, len(result))))
    rounds.listeners.append(lambda epoch, result: 1 / 0)  # a listener's bug is only logged
    param = torch.nn.Parameter(torch.zeros(2))
    param.grad = torch.tensor([2.0, 4.0])
    accumulated = GradientAccumulator([param], reuse_grad_buffers=False, buffered=True)
    accumulated.add(2)
    rounds.take_mean(accumulated)
    assert torch.equal(averager.tensors[0], torch.tensor([2.0, 4.0]))
    outcome = rounds.average(4, 2, last_group_size=0, exact_steps=False)
    assert heard == [(4, 2)] and outcome.expected == 2 and not outcome.exact
    assert rounds.search_time == 2.0
    inner = InnerOptimizer(torch.optim.SGD([param], lr=1.0), None, copies=False, delay=False)
    rounds.give_to(inner, outcome, reuse_grad_buffers=False)
    assert param.grad is not None and torch.equal(param.grad, torch.tensor([2.0, 4.0]))


def test_a_grid_of_a_thousand_peers_shards_its_first_round_and_waits_for_its_pool() -> None:
    """1,024 expected peers in groups of 32: round 1 declares under 8 shard keys (one key of
    1,024 declarations is too much to poll: kit.averaging.grid.shards_for), round 2 may wait
    for the pool's groups (it searches that much longer), and the shards are reset after."""
    me = PeerID(bytes([1]) * 32)
    members = [me, *(PeerID(bytes([2, i]) + bytes(30)) for i in range(31))]

    def group_of_32(control: StepControl) -> None:
        result = Result(32)
        result.group_id = bytes([len(averager.steps)]) * 8  # type: ignore[attr-defined]
        result.peers = members  # type: ignore[attr-defined]
        result.weights = [averager.weights[-1]] * 32  # type: ignore[attr-defined]
        control.set_result(result)  # type: ignore[arg-type]

    averager = Averager([torch.zeros(2)], group_of_32)
    result, grid = average_on_grid(
        averager,  # type: ignore[arg-type]
        Tracker(with_samples=1024, at_epoch=4),  # type: ignore[arg-type]
        4,
        1.0,
        me=me,
        expected=1024,
        group_size=32,
        matchmaking_time=5.0,
        averaging_timeout=30.0,
    )
    assert result is not None and grid.completed == 2 and grid.weight == 1024.0
    assert averager.shards == [8, 1, 1]  # round 1 sharded, round 2 not, reset after
    assert averager.targets == [32, 32] and averager.bits[0] == group_bits(4)
    assert averager.scheduled[0] is None and averager.scheduled[1] is not None
    # round 2 searches as long again as the pool may take (2 x 5 s + request_timeout 3 s)
    first, second = averager.timeouts
    assert second - first == pytest.approx(13.0, abs=0.5)


def test_a_later_grid_round_still_looking_after_others_stepped_waits_for_its_key() -> None:
    """12 peers in groups of 4: round 2's key holds one peer of each round-1 group. Another
    key's group finished first and its members stepped (the global epoch moved on) while ours
    waited for a member whose round 1 ended late: ours must not give up (it used to, at the
    next poll, and the late member's group then began with peers that had left: a flaky
    test_moshpit). Round 1's key holds everyone, so there the early give-up stays."""
    me = PeerID(bytes([1]) * 32)
    tracker = Tracker(with_samples=12, at_epoch=12)

    def rounds(control: StepControl) -> None:
        result = Result(4 if len(averager.steps) == 1 else 3)
        result.group_id = bytes([len(averager.steps)]) * 8  # type: ignore[attr-defined]
        result.peers = [me, *(PeerID(bytes([2, i]) + bytes(30)) for i in range(len(result) - 1))]  # type: ignore[attr-defined]
        result.weights = [1.0] * len(result)  # type: ignore[attr-defined]
        if len(averager.steps) == 1:
            tracker.epoch = 5  # another key's group: averaged, stepped, published
        else:
            threading.Event().wait(20 * POLL)  # our key's last member is still in round 1
        control.set_result(result)  # type: ignore[arg-type]

    averager = Averager([torch.zeros(2)], rounds)
    result, grid = average_on_grid(
        averager,  # type: ignore[arg-type]
        tracker,  # type: ignore[arg-type]
        4,
        1.0,
        me=me,
        expected=12,
        group_size=4,
        matchmaking_time=3.0,
        averaging_timeout=30.0,
    )
    assert len(averager.steps) == 2 and not averager.steps[1].cancelled()
    assert result is not None and grid.completed == 2 and grid.weight == 3.0
    # Round 1 (everyone's key) still gives up once the others stepped without us.
    late = Averager([torch.zeros(2)], lambda control: None)  # nobody ever comes
    result, grid = average_on_grid(
        late,  # type: ignore[arg-type]
        Tracker(with_samples=12, at_epoch=12, epoch=5),  # type: ignore[arg-type]
        4,
        1.0,
        me=me,
        expected=12,
        group_size=4,
        matchmaking_time=30.0,  # it would otherwise wait this long
        averaging_timeout=60.0,
    )
    assert result is None and grid.completed == 0 and late.steps[0].cancelled()
    assert len(late.steps) == 1  # nor does it look for round 2: every group formed already
