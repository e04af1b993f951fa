"""Stand-ins for the averager and its results in the optimizer's unit tests (the swarm tests run
the real ones): they record what they are asked, and end a step as the test says."""

from __future__ import annotations

import contextlib
import threading
import types
from collections.abc import Callable, Iterator

import torch

from kit.averaging.control import StepControl


class Result:
    """A round's result as kit.optim reads it: its group's size and whether it is full."""

    def __init__(self, size: int, is_full: bool = True, group_id: bytes = b"group-of-3") -> None:
        self.size, self.is_full, self.group_id = size, is_full, group_id
        self.unaveraged_parts = () if is_full else (1,)
        self.matchmaking_time = self.allreduce_time = 0.0

    def __len__(self) -> int:
        return self.size


class Averager:
    """Records a round's settings; ``finish`` (if given) ends each step from a thread."""

    def __init__(
        self, tensors: list[torch.Tensor], finish: Callable[[StepControl], None] | None = None
    ) -> None:
        self.tensors = tensors
        self.finish = finish
        self.bits: list[str] = []
        self.targets: list[int | None] = []
        self.weights: list[float] = []
        self.steps: list[StepControl] = []
        self.shards: list[int] = []
        self.scheduled: list[float | None] = []
        self.timeouts: list[float] = []
        self.is_looking_for_group = True
        self.settings = types.SimpleNamespace(prefix="test", request_timeout=3.0)

    def give_up_search(self, control: StepControl) -> bool:
        return self.is_looking_for_group and control.cancel()

    @contextlib.contextmanager
    def get_tensors(self) -> Iterator[list[torch.Tensor]]:
        yield self.tensors

    def set_group_bits(self, bits: str) -> None:
        self.bits.append(bits)

    def set_target_group_size(self, size: int | None) -> None:
        self.targets.append(size)

    def set_shards(self, shards: int) -> None:
        self.shards.append(shards)

    def step(
        self, weight: float, timeout: float, wait: bool, scheduled_time: float | None = None
    ) -> StepControl:
        control = StepControl(0.0, timeout, False, weight)
        self.weights.append(weight)
        self.scheduled.append(scheduled_time)
        self.timeouts.append(timeout)
        self.steps.append(control)
        if self.finish is not None:
            threading.Thread(target=self.finish, args=(control,), daemon=True).start()
        return control
