"""A local step's figures, read one step late: its loss and its compute time stay on the device
until the next step is queued.

Holds :class:`PendingStep` (what a step leaves: samples, its loss as a device tensor, and the
marks of its start and end) and :class:`StepClock` (CUDA events on a CUDA device, the host clock
elsewhere). The trainer (``kit.training.trainer``) reads a step once the next one is queued.

Why late: on a GPU, reading a value (``float(loss)``, an event's time) waits until the GPU has
run everything queued before it. Read right after its step, every step drains the queue and
the GPU idles while Python prepares the next forward (with sahajBERT on an H200, a fifth of
the time). Read after the next step's forward and backward are queued, the wait ends while the
GPU is busy with them. On the CPU nothing runs ahead, and a read costs nothing.

Compute time counts what contribution accounting credits (``kit.metrics``): the device's time
from the first forward of a step to its last backward and clipping, from CUDA events (the host
clock on a GPU would measure how fast Python queues kernels).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch


class StepClock:
    """Marks on ``device``'s timeline: CUDA events there, ``time.perf_counter`` elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def seconds(self, start: Any, end: Any) -> float:
        """The time between two marks (on CUDA it waits for the end mark: read it late)."""
        if not self.cuda:
            return float(end - start)
        end.synchronize()
        return float(start.elapsed_time(end)) / 1000.0


@dataclasses.dataclass
class PendingStep:
    """A local step whose figures are still on the device."""

    samples: int  # its samples (known on the host at once)
    loss: torch.Tensor  # the mean loss of its micro-batches, on the device
    start: Any  # StepClock marks around its forward/backward
    end: Any

    def read(self, clock: StepClock) -> tuple[float, float]:
        """(mean loss, compute seconds); waits for this step's kernels only."""
        seconds = clock.seconds(self.start, self.end)
        return float(self.loss), seconds
