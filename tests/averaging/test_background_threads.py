"""Torch work on kit's background threads runs with one intra-op thread, the training thread's
setting stays as it was: the loop thread of a real round, CenteredClip's worker, the delayed step.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from kit.averaging.background_threads import (
    BACKGROUND_TORCH_THREADS,
    limit_torch_threads,
    team_size_is_per_thread,
    with_limited_torch_threads,
)
from kit.optim.stepping import InnerOptimizer
from tests.averaging.facades import averagers

pytestmark = pytest.mark.skipif(
    not team_size_is_per_thread(), reason="torch's thread count is process-wide here"
)
TRAINING_THREADS = 2  # what the training thread uses (torch's default on a 2-vCPU box)


@pytest.fixture(autouse=True)
def training_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(TRAINING_THREADS)  # threads started from now on take this too
    try:
        yield
    finally:
        torch.set_num_threads(before)


def in_new_thread(function: object) -> int:
    seen: list[int] = []

    def run() -> None:
        function()  # type: ignore[operator]
        seen.append(torch.get_num_threads())

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(10)
    return seen[0]


def test_a_background_thread_takes_one_thread_and_the_training_thread_keeps_its_own() -> None:
    assert in_new_thread(lambda: None) == TRAINING_THREADS  # without it: a full team
    assert in_new_thread(limit_torch_threads) == BACKGROUND_TORCH_THREADS
    assert in_new_thread(with_limited_torch_threads(lambda: None)) == BACKGROUND_TORCH_THREADS
    assert torch.get_num_threads() == TRAINING_THREADS


def test_the_loop_thread_of_a_round_uses_one_thread() -> None:
    async def loop_threads(_dht: object, _node: object) -> int:
        return torch.get_num_threads()

    with averagers(2, target_group_size=2) as (first, second):
        dht = first._dht  # the facade's DHT: its runtime runs the round
        assert dht.run_coroutine(loop_threads) == TRAINING_THREADS
        futures = [a.step(wait=False) for a in (first, second)]
        assert all(f.result(10) is not None for f in futures)  # type: ignore[union-attr]
        assert dht.run_coroutine(loop_threads) == BACKGROUND_TORCH_THREADS
        assert torch.get_num_threads() == TRAINING_THREADS


def test_the_delayed_optimizer_step_uses_one_thread() -> None:
    net = torch.nn.Linear(3, 2)
    inner = InnerOptimizer(
        lambda params: torch.optim.SGD(params, lr=1.0), net.parameters(), copies=False, delay=True
    )
    seen: list[int] = []
    try:
        inner.step(
            True,
            None,
            reuse_grad_buffers=False,
            before=lambda: seen.append(torch.get_num_threads()),
        )
        assert inner.finish(wait=5.0) is True
        assert seen == [BACKGROUND_TORCH_THREADS]
        assert torch.get_num_threads() == TRAINING_THREADS
    finally:
        inner.shutdown()
