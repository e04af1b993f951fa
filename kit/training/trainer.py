"""The volunteer's training loop: micro-batches, mixed precision, ``kit.Optimizer`` steps, and a
``TrainingStatus`` after each step.

Holds :class:`Trainer`. One local step = ``plan.accumulation_steps`` micro-batches of
``plan.micro_batch`` samples on each of the plan's devices (forward under autocast when the plan
says so, backward, gradients summed into the main model: ``kit.training.replicas``), then
``kit.Optimizer.step(batch_size=..., clip_grad_norm=...)``, which clips the local gradients and
accumulates toward the collaboration's global batch and takes the global step when it is full
(DeDLOC §3.1). The loop runs in the caller's thread (``run``) or in one worker thread it owns
(``start``/``stop``), so that a notebook stays responsive while training: that thread only runs
torch compute and blocking calls into the runtime loop; all network I/O stays on the runtime's
asyncio loop (kit/runtime.py). It holds no UI (``kit.ui`` draws the snapshots) and no set-up of
the network or the data (``kit.volunteer`` does that).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch

from kit.errors import KitError, StateDownloadFailed
from kit.hardware.plan import TrainingPlan
from kit.runtime import get_runtime
from kit.training.pending_steps import PendingStep, StepClock
from kit.training.replicas import LossFunction, Replicas, model_loss
from kit.training.status import LOSS_HISTORY_LIMIT, TrainingState, TrainingStatus

logger = logging.getLogger(__name__)

StatusListener = Callable[[TrainingStatus], None]
#: A step's figures for contribution reports: (samples, loss, compute seconds).
StepListener = Callable[[int, float, float], None]

#: How long a joining peer waits for the others' progress records before its first step.
JOIN_LOOKUP_SECONDS = 5.0
_AUTOCAST_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


class Trainer:
    """Train ``model`` on ``batches`` with a collaborative ``optimizer``, reporting status.

    Args:
        model: the model, already on ``plan.device``; its forward takes a batch dict and
            returns an object with ``.loss``.
        optimizer: a ``kit.Optimizer`` over the model's parameters.
        batches: an iterator of batch dicts of ``plan.micro_batch`` samples (CPU tensors).
        plan: device, precision and micro-batching (``kit.hardware.plan``).
        clip_grad_norm: clip each local step's gradients to this L2 norm (None: no clipping).
        username: shown in the status.
        device_label: shown in the status, e.g. "Tesla T4 (fp16)".
        replicas: the model's replicas on the plan's devices (several GPUs); default: the model
            alone on ``plan.device``.
        loss: the model's loss on a batch (see ``kit.training.replicas.LossFunction``; the
            default calls the model's forward); only used without ``replicas``.

    fp16 plans train with a ``torch.amp.GradScaler``: the loss is scaled before backward, and
    ``kit.Optimizer`` unscales what it averages (``kit.optim.grad_scaling``) and clips each
    local step's gradient as it accumulates it (one norm serves the clip and the inf/NaN
    check). Nothing is read back from the device inside a step: each step's loss and compute
    time are read one step later (``kit.training.pending_steps``), so a GPU never waits for
    Python.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Any,
        batches: Iterator[dict[str, torch.Tensor]],
        plan: TrainingPlan,
        *,
        clip_grad_norm: float | None = 1.0,
        username: str | None = None,
        device_label: str | None = None,
        replicas: Replicas | None = None,
        loss: LossFunction = model_loss,
    ) -> None:
        self.model = model
        self.replicas = replicas or Replicas(model, (plan.device,), loss=loss)
        # With reuse_grad_buffers .grad sums the whole epoch: kit.Optimizer clears it and
        # handles the loss scale itself.
        self.reuse_grad_buffers = bool(getattr(optimizer, "reuse_grad_buffers", False))
        self.optimizer = optimizer
        self.batches = batches
        self.plan = plan
        self.clip_grad_norm = clip_grad_norm
        self.device = torch.device(plan.device)
        self.autocast_dtype = _AUTOCAST_DTYPES.get(plan.precision)
        self.scaler = (
            torch.amp.GradScaler(self.device.type)
            if plan.grad_scaler and plan.precision == "fp16"
            else None
        )
        self._clock = StepClock(self.device)
        self._pending: deque[PendingStep] = deque()  # steps whose figures are not read yet
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._losses: deque[tuple[int, float]] = deque(maxlen=LOSS_HISTORY_LIMIT)
        self._status_listeners: list[StatusListener] = []
        self._step_listeners: list[StepListener] = []
        self.local_steps = 0
        self.most_peers_seen = 1  # this peer included
        self.samples_total = 0
        self.compute_seconds = 0.0  # forward/backward time of the steps read so far
        self.error: BaseException | None = None
        self._status = TrainingStatus(
            state=TrainingState.STARTING,
            target_batch_size=int(getattr(optimizer, "target_batch_size", 1)),
            username=username,
            device=device_label or f"{plan.device} ({plan.precision})",
            time=time.time(),
        )

    # --- observers -------------------------------------------------------------------------

    def add_status_listener(self, listener: StatusListener) -> None:
        """Call ``listener(status)`` after every step and state change (in the training thread)."""
        self._status_listeners.append(listener)

    def add_step_listener(self, listener: StepListener) -> None:
        """Call ``listener(samples, loss, compute_seconds)`` after every local step."""
        self._step_listeners.append(listener)

    @property
    def status(self) -> TrainingStatus:
        with self._lock:
            return self._status

    def update_status(self, *, notify: bool = True, **changes: Any) -> TrainingStatus:
        """Replace fields of the current snapshot and tell the listeners (unless ``notify`` is
        False: callers on the runtime loop must not run the listeners' drawing there)."""
        with self._lock:
            self._status = dataclasses.replace(self._status, time=time.time(), **changes)
            status = self._status
        if not notify:
            return status
        for listener in list(self._status_listeners):
            try:
                listener(status)
            except Exception:  # a broken display must never stop training
                logger.exception("a status listener failed")
        return status

    # --- lifecycle -------------------------------------------------------------------------

    def start(self, *, max_steps: int | None = None, max_seconds: float | None = None) -> None:
        """Train in a worker thread until :meth:`stop` or a limit; returns at once."""
        if self._thread is not None:
            raise KitError("this trainer was already started - help: create a new one")
        self._thread = threading.Thread(
            target=self._run_in_thread,
            args=(max_steps, max_seconds),
            name="kit-trainer",
            daemon=True,
        )
        self._thread.start()

    def stop(self, timeout: float = 60.0) -> bool:
        """Ask the loop to leave after the current step; wait up to ``timeout`` s. True = stopped."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the worker thread to end; True when it has."""
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run_in_thread(self, max_steps: int | None, max_seconds: float | None) -> None:
        try:
            self.run(max_steps=max_steps, max_seconds=max_seconds)
        except BaseException as error:  # reported in the status; the thread must end quietly
            self.error = error

    def run(self, *, max_steps: int | None = None, max_seconds: float | None = None) -> None:
        """Train in this thread until :meth:`stop`, ``max_steps`` local steps or ``max_seconds``."""
        deadline = math.inf if max_seconds is None else time.monotonic() + max_seconds
        self.replicas.train()
        self._catch_up()
        try:
            while not self._stop.is_set() and time.monotonic() < deadline:
                if max_steps is not None and self.local_steps >= max_steps:
                    break
                if self.plan.auxiliary:
                    self._auxiliary_step()
                    continue
                self._local_step()
        except StopIteration:
            self.update_status(
                message="the data stream ended - help: raise data.repeat or add sources"
            )
        except KitError as error:
            logger.error("training stopped: %s", error)
            self.update_status(state=TrainingState.FAILED, message=str(error))
            raise
        except Exception as error:
            self.update_status(
                state=TrainingState.FAILED,
                message=f"{type(error).__name__}: {error} - help: report this with the log above",
            )
            raise
        finally:
            self._read_steps(keep=0)
            self.replicas.close()
        with self._lock:
            losses = tuple(self._losses)
        self.update_status(state=TrainingState.STOPPED, message="stopped", loss_history=losses)

    # --- one step ----------------------------------------------------------------------------

    def _catch_up(self) -> None:
        """Download the collaboration's state first if it is ahead of us (hot join, DeDLOC §3.2)."""
        tracker = self.optimizer.tracker
        progress = get_runtime().call(tracker.wait_for_update(JOIN_LOOKUP_SECONDS), timeout=30.0)
        if progress.epoch > self.optimizer.local_epoch and not self.plan.auxiliary:
            self.update_status(
                state=TrainingState.DOWNLOADING_STATE,
                message=f"downloading the model at step {progress.epoch} from peers",
            )
            try:
                self.optimizer.load_state_from_peers()
            except StateDownloadFailed as error:
                logger.warning("%s; starting from the initial weights", error)
        self.update_status(state=TrainingState.TRAINING, local_epoch=self.optimizer.local_epoch)

    def _local_step(self) -> None:
        steps = max(1, self.plan.accumulation_steps)
        micro_batches = steps * len(self.replicas)
        if len(self.replicas) > 1:
            self.replicas.sync_parameters()  # the optimizer changed the main model only
        scaler = self.scaler
        scale = scaler.scale if scaler is not None else None
        started = self._clock.mark()
        total_loss: torch.Tensor | None = None
        samples = 0
        for _ in range(steps):
            batches = [next(self.batches) for _ in range(len(self.replicas))]
            loss = self.replicas.forward_backward(
                batches, micro_batches, autocast=self._autocast_on, scale=scale
            )
            total_loss = loss if total_loss is None else total_loss + loss  # on the device
            samples += sum(int(batch["input_ids"].shape[0]) for batch in batches)
        self.replicas.gather_gradients()
        assert total_loss is not None
        self._pending.append(
            PendingStep(samples, total_loss / micro_batches, started, self._clock.mark())
        )
        self.local_steps += 1
        self.samples_total += samples
        tracker = self.optimizer.tracker
        behind = tracker.global_progress.epoch > self.optimizer.local_epoch
        if behind:
            self.update_status(
                state=TrainingState.DOWNLOADING_STATE, message="catching up with peers"
            )
        elif tracker.ready_to_update_epoch:
            self.update_status(state=TrainingState.AVERAGING)
        # Clipping is fused into the accumulation (its norm is the inf/NaN check too).
        clip = self.clip_grad_norm
        self.optimizer.step(batch_size=samples, grad_scaler=scaler, clip_grad_norm=clip)
        if not self.reuse_grad_buffers:  # (with it, the optimizer clears .grad itself)
            self.optimizer.zero_grad()
        if scaler is not None:
            scaler.update()  # on the device: the optimizer recorded its inf/NaN check
        self._read_steps(keep=1)  # the previous step: its kernels are done by now
        self._report(TrainingState.TRAINING)

    def _read_steps(self, keep: int) -> None:
        """Read the figures of all pending steps but the newest ``keep`` (see the class)."""
        while len(self._pending) > keep:
            step = self._pending.popleft()
            mean_loss, compute = step.read(self._clock)
            self.compute_seconds += compute
            with self._lock:
                self._losses.append((self.local_steps - len(self._pending), mean_loss))
            for listener in list(self._step_listeners):
                listener(step.samples, mean_loss, compute)

    def _auxiliary_step(self) -> None:
        self.optimizer.step()
        self._report(TrainingState.AVERAGING)

    def _autocast_on(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.autocast_dtype)

    def _report(self, state: TrainingState) -> None:
        progress = self.optimizer.tracker.global_progress
        rate = self.optimizer.tracker.local.samples_per_second
        with self._lock:
            losses = tuple(self._losses)
        message = self._status.message
        self.most_peers_seen = max(self.most_peers_seen, progress.num_peers)
        if progress.num_peers <= 1 and self.most_peers_seen > 1:
            # The others' progress records stopped coming (our network, or theirs): keep training
            # alone toward the target batch (DeDLOC: any subset of peers can make the step),
            # while the DHT re-contacts the bootstrap peers by itself.
            state = TrainingState.RECONNECTING
            message = "no other peer seen: training alone while kit reconnects by itself"
        elif self._status.state is TrainingState.RECONNECTING:
            message = f"back with {progress.num_peers - 1} other peer(s)"
        self.update_status(
            state=state,
            message=message,
            local_epoch=self.optimizer.local_epoch,
            global_epoch=progress.epoch,
            samples_accumulated=progress.samples_accumulated,
            target_batch_size=progress.target_batch_size,
            eta_next_step=progress.eta_next_epoch,
            peers_online=progress.num_peers,
            samples_per_second=rate,
            samples_total=self.samples_total,
            rollbacks=int(getattr(self.optimizer, "nonfinite_rollbacks", 0)),
            loss_history=losses,
        )
