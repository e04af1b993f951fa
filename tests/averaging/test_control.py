"""A step under the caller's control: stages, trigger, cancel, scheduled time, typed failures.

The pure ``StepControl`` first (its transition table and thread-facing methods), then the
blocking facade on an in-process network, as hivemind scripts drive it: ``step(wait=False,
require_trigger=True)``, ``allow_allreduce()``, ``cancel()``, ``scheduled_time``, and a step with
no group raising ``AveragingFailed``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import pytest
import torch

from kit.averaging.allreduce import AveragingMode
from kit.averaging.control import STAGE_TRANSITIONS, AveragingStage, StepControl
from kit.dht.node import get_dht_time
from kit.errors import AveragingFailed, ConfigError, KitUsageError
from tests.averaging.facades import averagers
from tests.conftest import MS


def test_every_stage_can_end_and_only_listed_moves_are_allowed() -> None:
    for stage, targets in STAGE_TRANSITIONS.items():
        assert stage is AveragingStage.FINISHED or AveragingStage.FINISHED in targets
    control = StepControl(scheduled_time=1.0, deadline=2.0, allow_retries=True, weight=1.0)
    assert control.stage is AveragingStage.IDLE and not control.began_allreduce
    with pytest.raises(KitUsageError):
        control.advance(AveragingStage.RUNNING_ALLREDUCE)  # not before looking for a group
    control.advance(AveragingStage.LOOKING_FOR_GROUP)
    control.advance(AveragingStage.RUNNING_ALLREDUCE)
    assert control.began_allreduce
    assert control.cancel() is False and not control.cancelled()  # a running round goes on
    control.finish("the result")
    assert control.result(0) == "the result" and control.stage is AveragingStage.FINISHED
    with pytest.raises(KitUsageError):
        control.advance(AveragingStage.LOOKING_FOR_GROUP)


def test_cancel_before_the_allreduce_runs_the_hooks_and_stops_the_step() -> None:
    async def scenario() -> None:
        control = StepControl(scheduled_time=1.0, deadline=2.0, allow_retries=True, weight=1.0)
        hooks: list[str] = []
        control.attach(lambda: hooks.append("cancelled"))
        control.advance(AveragingStage.LOOKING_FOR_GROUP)
        assert control.cancel() is True and control.cancelled() and hooks == ["cancelled"]
        assert control.stage is AveragingStage.FINISHED
        with pytest.raises(asyncio.CancelledError):
            control.advance(AveragingStage.RUNNING_ALLREDUCE)
        control.finish(error=AveragingFailed("late"))  # ignored: cancelled already
        assert control.cancelled()

    asyncio.run(scenario())


def test_the_trigger_set_before_attach_or_twice_is_kept() -> None:
    async def scenario() -> None:
        control = StepControl(scheduled_time=1.0, deadline=2.0, allow_retries=True, weight=1.0)
        control.allow_allreduce()
        control.allow_allreduce()  # harmless
        control.attach()
        assert control.triggered and await control.wait_for_trigger(1.0)
        other = StepControl(scheduled_time=1.0, deadline=2.0, allow_retries=True, weight=1.0)
        other.attach()
        assert not await other.wait_for_trigger(50 * MS)

    asyncio.run(scenario())
    with pytest.raises(ConfigError, match="help:"):
        StepControl(1.0, 2.0, True, 1.0).weight = -1.0


def test_peers_that_require_a_trigger_find_their_group_then_wait_for_it() -> None:
    with averagers(3, target_group_size=3, min_matchmaking_time=5.0) as group:
        started = time.monotonic()
        controls = [
            a.step(wait=False, require_trigger=i > 0, weight=1.0 + i) for i, a in enumerate(group)
        ]
        assert all(isinstance(c, StepControl) for c in controls)
        deadline = time.monotonic() + 5.0
        while controls[1].stage is not AveragingStage.AWAITING_TRIGGER:
            assert time.monotonic() < deadline, controls
            time.sleep(0.01)
        time.sleep(0.3)  # longer than request_timeout: the others' streams wait for us
        assert controls[0].stage is AveragingStage.RUNNING_ALLREDUCE and not controls[0].done()
        assert controls[2].stage is AveragingStage.AWAITING_TRIGGER
        for control in controls[1:]:
            control.allow_allreduce()  # type: ignore[union-attr]
        results = [c.result(10) for c in controls]  # type: ignore[union-attr]
        assert time.monotonic() - started < 4.0  # the full group began at once (not after 5 s)
        assert all(r.is_full and len(r) == 3 for r in results)
        assert all(a.peer_id in results[0] for a in group)
        expected = sum((1.0 + i) * i for i in range(3)) / sum(1.0 + i for i in range(3))
        for averager in group:
            with averager.get_tensors() as tensors:
                torch.testing.assert_close(tensors[0], torch.full((100,), expected))
        assert all(c.stage is AveragingStage.FINISHED for c in controls)  # type: ignore[union-attr]


def test_a_cancelled_step_is_cancelled_and_the_others_average_without_it() -> None:
    with averagers(3, target_group_size=2) as group:
        controls = [a.step(wait=False, require_trigger=True) for a in group]
        assert controls[0].cancel()  # type: ignore[union-attr]
        for control in controls[1:]:
            control.allow_allreduce()  # type: ignore[union-attr]
        assert controls[0].cancelled()  # type: ignore[union-attr]
        with pytest.raises(concurrent.futures.CancelledError):
            controls[0].result(0)  # type: ignore[union-attr]
        results = [c.result(10) for c in controls[1:]]  # type: ignore[union-attr]
        assert all(len(r) == 2 and group[0].peer_id not in r for r in results)
        # The cancelled averager is free for its next step.
        assert not group[0].is_looking_for_group


def test_giving_up_a_search_never_leaves_a_group_that_formed() -> None:
    """give_up_search cancels a step that is still looking, and refuses (returns False) once
    its group formed: the members count on it, unlike control.cancel() before the trigger.
    (Checking is_looking_for_group, then cancelling, let a group begin in between: its
    members then waited for a peer that had left, and averaged without it.)"""
    with averagers(3, target_group_size=2, min_matchmaking_time=5.0) as group:
        pair = [a.step(wait=False, require_trigger=True) for a in group[:2]]
        deadline = time.monotonic() + 5.0
        while any(c.stage is not AveragingStage.AWAITING_TRIGGER for c in pair):  # type: ignore[union-attr]
            assert time.monotonic() < deadline, pair
            time.sleep(0.01)
        assert not any(group[i].give_up_search(pair[i]) for i in range(2))  # type: ignore[arg-type]
        for control in pair:
            control.allow_allreduce()  # type: ignore[union-attr]
        results = [c.result(10) for c in pair]  # type: ignore[union-attr]
        assert all(r.is_full and len(r) == 2 for r in results)
        alone = group[2].step(wait=False)  # nobody else looks: it leads nobody, still looking
        while not group[2].is_looking_for_group:
            assert time.monotonic() < deadline + 5.0
            time.sleep(0.01)
        assert group[2].give_up_search(alone)  # type: ignore[arg-type]
        with pytest.raises(concurrent.futures.CancelledError):
            alone.result(5)  # type: ignore[union-attr]
        assert group[2].give_up_search(alone) is False  # over: nothing to give up


def test_a_step_without_a_group_raises_and_changes_nothing() -> None:
    with averagers(1) as (alone,):
        started = time.monotonic()
        with pytest.raises(AveragingFailed, match="help:"):
            alone.step(timeout=0.5)
        assert time.monotonic() - started < 2.0
        control = alone.step(wait=False, timeout=0.5)
        assert isinstance(control.exception(5), AveragingFailed)  # type: ignore[union-attr]
        assert control.stage is AveragingStage.FINISHED  # type: ignore[union-attr]
        with alone.get_tensors() as tensors:
            assert torch.equal(tensors[0], torch.zeros(100))
        assert alone.statistics()["no_group"] == 2


def test_scheduled_time_is_when_the_round_begins() -> None:
    with averagers(2, min_matchmaking_time=30.0) as group:  # no target size: the time decides
        started = time.monotonic()
        begin = get_dht_time() + 0.5
        controls = [a.step(wait=False, scheduled_time=begin, timeout=10.0) for a in group]
        results = [c.result(10) for c in controls]  # type: ignore[union-attr]
        assert 0.4 < time.monotonic() - started < 3.0  # not min_matchmaking_time
        assert all(len(r) == 2 and r.is_full for r in results)
        with pytest.raises(ConfigError, match="help:"):
            group[0].step(wait=False, scheduled_time=get_dht_time() + 5.0, timeout=1.0)


def test_hivemind_calls_that_cannot_work_are_refused() -> None:
    with averagers(1) as (alone,):
        with pytest.raises(KitUsageError, match="help:"):
            alone.step(require_trigger=True)  # wait=True: nobody could trigger it
        with pytest.raises(ConfigError, match="help:"):
            alone.step(gather={"batch_size": 32})
        assert alone.last_step is None  # nothing was started


def test_mode_and_peer_id_name_each_averager_as_hivemind_does() -> None:
    with averagers(2, clients=(1,)) as (node, client):
        assert (node.mode, client.mode) == (AveragingMode.NODE, AveragingMode.CLIENT)
        assert node.peer_id != client.peer_id and node.is_alive()
    with averagers(1, auxiliary=True) as (auxiliary,):
        assert auxiliary.mode is AveragingMode.AUX and not auxiliary.allow_state_sharing
    assert not auxiliary.is_alive()  # shut down
