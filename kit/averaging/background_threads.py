"""Torch on kit's background threads uses one intra-op thread: the training thread owns the cores.

PyTorch's CPU ops split their work over an OpenMP team, and with OpenMP the team size is a
setting of the calling thread (``torch.set_num_threads`` there sets it for that thread only;
threads started later take the process's setting, by default one per core). kit runs torch work
next to the training thread: the codecs and sums of every all-reduce on the runtime's loop
thread, CenteredClip in a worker thread, the delayed optimizer step in its own thread. With
torch's default each of them forks a team as large as the machine, and on a 2-vCPU Colab or
Kaggle box the teams oversubscribe the cores: every op then ends at a barrier that waits for a
descheduled team member's time slice. Measured on this 2-core machine while other work held the
cores: ``Uniform8BitQuantization`` of 72 MB took 1.96 s with two threads against 0.087 s with
one, and ``benchmarks/allreduce.py --compression uniform8bit`` rounds took 1.02 s with the
peers at torch's default against 0.69 s at one thread. One thread still encodes ~1 GB/s, far
above any volunteer's link, and the sums are bound by memory, not by cores.

Only where the team size is per thread (the OpenMP backend of PyTorch's CPU builds): with ATen's
native thread pool the setting is process-wide and would slow the training thread, so it is
left alone there.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

logger = logging.getLogger(__name__)

BACKGROUND_TORCH_THREADS = 1  # intra-op threads of torch work on kit's background threads

P = ParamSpec("P")
R = TypeVar("R")


@functools.cache
def team_size_is_per_thread() -> bool:
    """True when ``torch.set_num_threads`` affects only the calling thread (OpenMP backend)."""
    return "parallel backend: OpenMP" in torch.__config__.parallel_info()


def limit_torch_threads() -> None:
    """Give the calling (background) thread one intra-op thread, where that stays per thread.

    Cheap enough to call at the start of every round: a no-op once the thread is set.
    """
    if torch.get_num_threads() != BACKGROUND_TORCH_THREADS and team_size_is_per_thread():
        logger.debug("torch work on this background thread uses one intra-op thread")
        torch.set_num_threads(BACKGROUND_TORCH_THREADS)


def with_limited_torch_threads(function: Callable[P, R]) -> Callable[P, R]:
    """``function`` run with :func:`limit_torch_threads` first (for ``asyncio.to_thread``)."""

    @functools.wraps(function)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        limit_torch_threads()
        return function(*args, **kwargs)

    return run
