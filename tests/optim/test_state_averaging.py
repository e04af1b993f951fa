"""Parameter rounds: what they average, and the delayed round applied as a delta.

The averager is a recorder here (its step a ``StepControl`` the test completes); the swarm tests
in test_options.py run real rounds.
"""

from __future__ import annotations

from typing import Any

import torch

from kit.errors import AveragingFailed
from kit.optim.state_averaging import (
    AveragedTensors,
    DelayedStateAveraging,
    default_statistics,
    initialize_statistics,
)
from kit.optim.stepping import InnerOptimizer
from kit.training.lamb import Lamb
from tests.optim.recorders import Averager, Result


def adam_inner() -> tuple[torch.nn.Module, InnerOptimizer]:
    torch.manual_seed(0)
    net = torch.nn.Linear(2, 2)
    inner = InnerOptimizer(
        lambda p: torch.optim.Adam(p, lr=0.1), net.parameters(), copies=True, delay=False
    )
    initialize_statistics(inner.opt, ("exp_avg_sq",))
    return net, inner


def test_averaged_tensors_are_parameters_then_statistics_then_extras() -> None:
    net, inner = adam_inner()
    extra = torch.zeros(4)
    averaged = AveragedTensors(inner, ("exp_avg_sq",), [extra])
    current = averaged.current()
    assert len(current) == 2 + 2 + 1
    assert current[0] is net.weight and current[-1] is extra
    assert current[2] is inner.opt.state[inner.master[0]]["exp_avg_sq"]
    averaged.add([torch.ones_like(t) for t in current])
    assert torch.all(extra == 1.0) and torch.all(current[2] == 1.0)
    torch.testing.assert_close(inner.master[0], net.weight.detach())  # the copies moved too


def test_a_delayed_round_applies_its_delta_on_top_of_what_happened_meanwhile() -> None:
    buffers = [torch.zeros(3)]
    averager = Averager(buffers)
    applied: list[list[torch.Tensor]] = []
    rounds = DelayedStateAveraging(averager, applied.append)  # type: ignore[arg-type]
    param = torch.tensor([1.0, 2.0, 3.0])
    rounds.start([param], "0101", expected=3, timeout=5.0)
    assert rounds.running and averager.bits == ["0101"] and averager.targets == [3]
    assert torch.equal(buffers[0], param)  # a copy of the parameters when it started
    assert rounds.finish(wait=0.0) == (False, None)  # still running
    buffers[0].copy_(torch.tensor([2.0, 2.0, 2.0]))  # the group's average
    result = Result(3)
    averager.steps[0].set_result(result)
    over, got = rounds.finish(wait=0.0)
    assert over and got is result and not rounds.running
    torch.testing.assert_close(applied[0][0], torch.tensor([1.0, 0.0, -1.0]))
    assert rounds.complete(result) and not rounds.complete(Result(2))
    assert not rounds.complete(Result(3, is_full=False)) and not rounds.complete(None)


def test_a_round_without_a_group_applies_nothing() -> None:
    averager = Averager([torch.zeros(2)])
    applied: list[Any] = []
    rounds = DelayedStateAveraging(averager, applied.append)  # type: ignore[arg-type]
    rounds.start([torch.ones(2)], "0", expected=1, timeout=5.0)
    assert averager.targets == [None]  # alone: no target size
    averager.steps[0].set_exception(AveragingFailed("no group"))
    assert rounds.finish(wait=0.0) == (True, None) and applied == []
    assert rounds.finish(wait=0.0) == (True, None)  # nothing running


def test_a_forgotten_round_runs_on_and_lands_without_a_result() -> None:
    buffers = [torch.zeros(2)]
    averager = Averager(buffers)
    applied: list[Any] = []
    rounds = DelayedStateAveraging(averager, applied.append)  # type: ignore[arg-type]
    rounds.forget()  # nothing running: nothing to forget
    rounds.start([torch.ones(2)], "0", expected=2, timeout=5.0)
    assert rounds.moves_parameters
    rounds.forget()  # a state was loaded meanwhile
    assert rounds.running and not rounds.moves_parameters
    assert not averager.steps[0].cancelled()  # the others' group keeps its member
    buffers[0].fill_(3.0)
    averager.steps[0].set_result(Result(2))
    assert rounds.finish(wait=0.0) == (True, None) and applied == []
    rounds.start([torch.ones(2)], "0", expected=2, timeout=5.0)  # the next one applies again
    averager.steps[1].set_result(Result(2))
    assert rounds.finish(wait=0.0)[1] is not None and len(applied) == 1


def test_a_rebased_round_takes_its_delta_from_the_loaded_tensors() -> None:
    buffers = [torch.zeros(2)]
    averager = Averager(buffers)
    applied: list[Any] = []
    rounds = DelayedStateAveraging(averager, applied.append)  # type: ignore[arg-type]
    rounds.start([torch.ones(2)], "0", expected=2, timeout=5.0, epoch=4)
    assert rounds.epoch == 4 and not rounds.rebased
    rounds.rebase([torch.full((2,), 7.0)])  # a state averaging in this round was loaded
    assert rounds.rebased and rounds.moves_parameters
    buffers[0].fill_(3.0)
    averager.steps[0].set_result(Result(2))
    assert rounds.finish(wait=0.0)[1] is not None and not rounds.rebased
    torch.testing.assert_close(applied[0][0], torch.full((2,), -4.0))  # 3 - 7, not 3 - 1


def test_a_round_still_looking_for_its_group_can_be_given_up() -> None:
    buffers = [torch.zeros(2)]
    averager = Averager(buffers)
    applied: list[Any] = []
    rounds = DelayedStateAveraging(averager, applied.append)  # type: ignore[arg-type]
    assert rounds.give_up_search()  # nothing running
    rounds.start([torch.ones(2)], "0", expected=2, timeout=5.0, epoch=3)
    rounds.rebase([torch.ones(2)])
    assert rounds.give_up_search()
    assert averager.steps[0].cancelled() and not rounds.running and not rounds.rebased
    assert rounds.finish(wait=0.0) == (True, None) and applied == []
    rounds.start([torch.ones(2)], "0", expected=2, timeout=5.0, epoch=4)
    averager.is_looking_for_group = False  # its group formed: members count on it
    assert not rounds.give_up_search() and rounds.running
    buffers[0].fill_(2.0)
    averager.steps[1].set_result(Result(2))
    assert rounds.finish(wait=0.0)[1] is not None
    torch.testing.assert_close(applied[0][0], torch.ones(2))


def test_by_default_adam_and_lamb_average_their_moments_and_others_nothing() -> None:
    net = torch.nn.Linear(2, 2)
    for factory in (torch.optim.Adam, torch.optim.AdamW, Lamb):
        assert default_statistics(factory(net.parameters())) == ("exp_avg", "exp_avg_sq")

    class Counting(torch.optim.SGD):  # a user's optimizer: its step is not called for this
        def step(self, closure: Any = None) -> Any:
            raise AssertionError("stepped")

    assert default_statistics(Counting(net.parameters(), lr=0.1, momentum=0.9)) == ()
    assert default_statistics(torch.optim.SGD(net.parameters(), lr=0.1)) == ()
