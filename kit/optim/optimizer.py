"""``kit.Optimizer``: DeDLOC's collaborative optimizer, with hivemind.Optimizer's interface.

"Each device accumulates gradients at its own pace until the collaboration reaches the target
batch size; then the collaborators exchange their gradients and perform one optimizer step"
(Diskin et al., 2021, §3). Hyperparameters stay fixed whatever the number of volunteers: one
global step ("epoch") always uses ``target_batch_size`` samples.

How one ``step(batch_size=...)`` works (gradient averaging, the default):

1. the local gradient is added to an accumulator, weighted by ``batch_size``; a non-finite
   gradient is skipped with a warning (it never poisons the others);
2. the progress tracker publishes the local sample count; if the collaboration now has the
   target batch (or moved past our epoch), this peer joins an averaging round: every peer
   contributes its *mean* gradient weighted by its sample count, so the result is exactly the
   mean gradient over the global batch, as one process accumulating it would compute;
3. the inner optimizer steps with that gradient, the scheduler steps once per epoch, and every
   ``average_state_every`` epochs the parameters are averaged too (it corrects any drift);
4. a peer whose averaging failed proceeds with its local gradient and says so in the log; a peer
   that fell behind (local epoch < global epoch) downloads the state from peers (``state.py``).

With ``use_local_updates=True`` (hivemind's quickstart; local SGD as in DiLoCo-style runs) the
inner optimizer steps after every local step and the collaboration averages parameters (and the
optimizer statistics named in ``average_opt_statistics``) once per epoch.

Supported hivemind arguments: dht, run_id, target_batch_size, batch_size_per_step, optimizer
(instance or factory), params, scheduler (instance or factory), matchmaking_time,
averaging_timeout, allreduce_timeout, next_chunk_timeout, load_state_timeout,
average_state_every, use_local_updates, client_mode (an explicit value is honoured), auxiliary,
grad_compression, state_averaging_compression, average_opt_statistics, averager_opts,
tracker_opts, verbose. Not supported yet, refused with a clear error when enabled:
delay_optimizer_step, delay_grad_averaging, offload_optimizer, reuse_grad_buffers,
grad_averager_factory; extra_tensors and load_state_compression are ignored with a warning.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from kit.averaging.averager import DecentralizedAverager
from kit.averaging.compression import CompressionBase, NoCompression
from kit.errors import ConfigError, KitError, KitTimeout, StateDownloadFailed, TransientError
from kit.optim.progress import GlobalProgress, ProgressTracker
from kit.optim.state import StateServer, StateSnapshot, download_state, find_donors
from kit.runtime import get_runtime

logger = logging.getLogger(__name__)

OptimizerFactory = Callable[[Any], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


class Optimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` that trains together with every peer of ``run_id``.

    Args:
        dht: a running ``kit.DHT``.
        run_id: the collaboration's name; peers with the same run id train together.
        target_batch_size: samples per global step. Keep it fixed for the whole run: it is the
            batch size in the hyperparameters.
        batch_size_per_step: samples per local ``step()`` when ``step`` gets no ``batch_size``.
        optimizer: the inner optimizer, or a factory ``lambda params: torch.optim.AdamW(params)``
            (then pass ``params``).
        params: parameters (or groups) for an optimizer factory.
        scheduler: a learning-rate scheduler or a factory of one; it steps once per epoch.
        matchmaking_time: seconds a peer waits for others to form an averaging group. 3-5 s on
            a LAN, 10-15 s on the Internet; increase it if you see "averaging failed" warnings
            with few peers averaging.
        averaging_timeout: the longest an averaging round may take (about 2x a normal round);
            increase it if rounds on slow links time out.
        load_state_timeout: the longest a state download from peers may take.
        average_state_every: average parameters every this many epochs (0: never).
        use_local_updates: step the inner optimizer after each local step and average
            parameters once per epoch (local SGD) instead of averaging gradients.
        client_mode: True for peers that cannot accept connections (None: as the DHT's peer).
        auxiliary: a helper without gradients (CPU is enough): it only joins averaging rounds.
        grad_compression, state_averaging_compression: codecs (kit.averaging) on the wire.
        average_opt_statistics: names of optimizer state entries averaged with the parameters.
        averager_opts, tracker_opts: extra keyword arguments of the averagers and the tracker.
        verbose: log every epoch at INFO level.
    """

    def __init__(
        self,
        *,
        dht: Any,
        run_id: str,
        target_batch_size: int,
        batch_size_per_step: int | None = None,
        optimizer: torch.optim.Optimizer | OptimizerFactory,
        params: Iterable[Any] | None = None,
        scheduler: Any = None,
        matchmaking_time: float | None = 15.0,
        averaging_timeout: float | None = 60.0,
        allreduce_timeout: float | None = None,
        next_chunk_timeout: float | None = None,
        load_state_timeout: float = 600.0,
        reuse_grad_buffers: bool = False,
        offload_optimizer: bool | None = None,
        delay_optimizer_step: bool | None = None,
        delay_grad_averaging: bool = False,
        delay_state_averaging: bool = True,
        average_state_every: int = 1,
        use_local_updates: bool = False,
        client_mode: bool | None = None,
        auxiliary: bool = False,
        grad_compression: CompressionBase | None = None,
        grad_averager_factory: Any = None,
        state_averaging_compression: CompressionBase | None = None,
        load_state_compression: CompressionBase | None = None,
        average_opt_statistics: Sequence[str] = (),
        extra_tensors: Sequence[torch.Tensor] = (),
        averager_opts: dict[str, Any] | None = None,
        tracker_opts: dict[str, Any] | None = None,
        performance_ema_alpha: float = 0.1,
        shutdown_timeout: float = 5.0,
        verbose: bool = False,
    ) -> None:
        _validate(locals())
        if extra_tensors or load_state_compression is not None:
            logger.warning(
                "kit.Optimizer ignores extra_tensors and load_state_compression (not supported yet)"
            )
        self.dht = dht
        self.run_id = run_id
        self.target_batch_size = target_batch_size
        self.batch_size_per_step = batch_size_per_step
        self.use_local_updates = use_local_updates
        self.auxiliary = auxiliary
        self.average_state_every = average_state_every
        self.average_opt_statistics = tuple(average_opt_statistics)
        self.load_state_timeout = load_state_timeout
        self.averaging_timeout = averaging_timeout or 60.0
        self.matchmaking_time = matchmaking_time or 15.0
        self.verbose = verbose
        self.opt = (
            optimizer(params)
            if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer)
            else optimizer
        )
        self.scheduler = (
            scheduler(self.opt)
            if callable(scheduler) and not hasattr(scheduler, "step")
            else scheduler
        )
        self._params = [p for group in self.opt.param_groups for p in group["params"]]
        # torch.optim.Optimizer bookkeeping: share the inner optimizer's groups and state.
        self.defaults = self.opt.defaults
        self._optimizer_step_pre_hooks = {}  # type: ignore[var-annotated]
        self._optimizer_step_post_hooks = {}  # type: ignore[var-annotated]
        self.local_epoch = 0
        self._local_samples = 0
        self._accumulators = [torch.zeros_like(p, dtype=torch.float32) for p in self._params]
        self._grad_buffers = [torch.zeros(p.shape, dtype=torch.float32) for p in self._params]
        self._state_buffers = [torch.zeros(p.shape, dtype=torch.float32) for p in self._params]
        self._runtime = get_runtime()
        client = dht.client_mode if client_mode is None else client_mode
        averaging = dict(
            min_matchmaking_time=self.matchmaking_time,
            request_timeout=min(3.0, self.matchmaking_time),
            allreduce_timeout=allreduce_timeout or self.averaging_timeout,
            next_chunk_timeout=next_chunk_timeout,
            client_mode=client,
            auxiliary=auxiliary,
            **(averager_opts or {}),
        )
        self.grad_averager = DecentralizedAverager(
            self._grad_buffers,
            dht,
            prefix=f"{run_id}_grad_averager",
            compression=grad_compression or NoCompression(),
            **averaging,
        )
        self.state_averager = DecentralizedAverager(
            self._state_buffers,
            dht,
            prefix=f"{run_id}_state_averager",
            compression=state_averaging_compression or NoCompression(),
            **averaging,
        )
        identity = dht.node.peer.identity

        async def start(_: Any, node: Any) -> tuple[ProgressTracker, StateServer]:
            tracker = ProgressTracker(
                node,
                run_id,
                target_batch_size,
                identity=identity,
                client_mode=client,
                auxiliary=auxiliary,
                performance_ema_alpha=performance_ema_alpha,
                **(tracker_opts or {}),
            )
            tracker.start()
            return tracker, StateServer(node.peer, node, run_id, identity)

        self.tracker, self._state_server = dht.run_coroutine(start)
        self._publish_state()

    # The inner optimizer's groups and state, always its current objects (its load_state_dict
    # replaces them, so they are never copied here).
    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self.opt.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.opt.param_groups = value

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self.opt.state

    @state.setter
    def state(self, value: Any) -> None:
        self.opt.state = value

    # --- hivemind's API -----------------------------------------------------------------

    @property
    def global_progress(self) -> GlobalProgress:
        return self.tracker.global_progress

    def is_synchronized_with_peers(self) -> bool:
        """True if this peer is at the collaboration's epoch (or one behind, mid-step)."""
        return self.local_epoch >= self.tracker.global_progress.epoch - 1

    def step(
        self,
        closure: Callable[[], Any] | None = None,
        batch_size: int | None = None,
        grad_scaler: Any = None,
    ) -> Any:
        """Accumulate this step's gradients; take a global step when the collaboration is ready.

        Args:
            closure: recomputes the loss (as in torch.optim), optional.
            batch_size: samples in this step (default: ``batch_size_per_step``); 0 only checks
                whether the collaboration is ready.
            grad_scaler: a ``torch.amp.GradScaler`` whose scale is in the gradients; the
                gradients are unscaled before accumulation and inf/NaN steps are skipped.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.auxiliary:
            self._auxiliary_step()
            return loss
        if batch_size is None:
            if self.batch_size_per_step is None:
                raise ConfigError(
                    "step() needs batch_size - help: pass it, or batch_size_per_step= when creating the Optimizer"
                )
            batch_size = self.batch_size_per_step
        if self.local_epoch < self.tracker.global_progress.epoch:
            # The others stepped without us (we were late, or joined mid-step): our parameters
            # and accumulated gradients belong to an epoch that is over. Averaging them into the
            # next round would mix epochs, so catch up by downloading the current state.
            self.load_state_from_peers()
            return loss
        if batch_size > 0 and self._accumulate(batch_size, grad_scaler):
            self._local_samples += batch_size
        self.tracker.report_local_progress(self.local_epoch, self._local_samples)
        if self.tracker.ready_to_update_epoch:
            self._global_step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.zero_grad(set_to_none=set_to_none)

    def load_state_from_peers(self, timeout: float | None = None) -> None:
        """Download parameters, optimizer and scheduler state and epoch from up-to-date peers.

        Raises:
            StateDownloadFailed: nobody could provide a verified state within the timeout.
        """
        timeout = timeout or self.load_state_timeout

        async def fetch(_: Any, node: Any) -> StateSnapshot:
            # Donors move on to the next epoch now and then; a download that straddles that
            # moment fails its digest and starts over with the new state, until the deadline.
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            while True:
                donors = await find_donors(node, node.peer, self.run_id)
                try:
                    return await download_state(
                        node.peer, donors, self.run_id, timeout=deadline - loop.time()
                    )
                except StateDownloadFailed as e:
                    if loop.time() + 1.0 > deadline:
                        raise
                    logger.info("state download failed (%s); trying again", e)
                    await asyncio.sleep(0.5)

        started = time.perf_counter()
        snapshot: StateSnapshot = self.dht.run_coroutine(fetch)
        self._load_snapshot(snapshot)
        logger.info(
            "downloaded the state of epoch %d from peers in %.1f s",
            self.local_epoch,
            time.perf_counter() - started,
        )

    def state_dict(self) -> dict[str, Any]:
        state = self.opt.state_dict()
        state["kit_local_epoch"] = self.local_epoch
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        self.local_epoch = int(state_dict.pop("kit_local_epoch", self.local_epoch))
        self.opt.load_state_dict(state_dict)

    def shutdown(self) -> None:
        self.grad_averager.shutdown()
        self.state_averager.shutdown()

        async def stop(_: Any, node: Any) -> None:
            await self.tracker.shutdown()

        if self.dht.is_alive():
            self.dht.run_coroutine(stop)

    # --- internals ------------------------------------------------------------------------

    def _accumulate(self, batch_size: int, grad_scaler: Any) -> bool:
        scale = 1.0
        if grad_scaler is not None:
            scale = float(grad_scaler.get_scale())
        grads = [p.grad for p in self._params]
        finite = all(g is None or bool(torch.isfinite(g).all()) for g in grads)
        if not finite:
            logger.warning("skipping a step with non-finite gradients (it is not sent to peers)")
            if grad_scaler is not None:
                grad_scaler.update(scale / 2)
            return False
        for accumulator, grad in zip(self._accumulators, grads, strict=True):
            if grad is not None:
                accumulator.add_(grad.detach().float(), alpha=batch_size / scale)
        if self.use_local_updates:
            self.opt.step()
        return True

    def _global_step(self) -> None:
        epoch = self.local_epoch
        if self.use_local_updates:
            self._average_state()
        elif self._local_samples > 0:
            with self.grad_averager.get_tensors() as buffers:
                for buffer, accumulator in zip(buffers, self._accumulators, strict=True):
                    buffer.copy_(accumulator.cpu() / self._local_samples)
            result = self._average(self.grad_averager, self._local_samples)
            if result is None:
                logger.warning(
                    "averaging failed at epoch %d: proceeding with the local gradients", epoch
                )
            elif not result.is_full:
                logger.warning(
                    "averaging at epoch %d was partial: parts %s stay local",
                    epoch,
                    result.unaveraged_parts,
                )
            with self.grad_averager.get_tensors() as buffers:
                for param, buffer in zip(self._params, buffers, strict=True):
                    param.grad = buffer.to(device=param.device, dtype=param.dtype).clone()
            self.opt.step()
            for param in self._params:
                param.grad = (
                    None  # consumed: the next backward must not add to the averaged gradient
                )
        else:
            logger.info("no samples at epoch %d: waiting for the state of the next epoch", epoch)
        if self.scheduler is not None:
            self.scheduler.step()
        self.local_epoch = epoch + 1
        self._local_samples = 0
        for accumulator in self._accumulators:
            accumulator.zero_()
        if (
            not self.use_local_updates
            and self.average_state_every
            and self.local_epoch % self.average_state_every == 0
        ):
            self._average_state()
        self.tracker.report_local_progress(self.local_epoch, 0)
        self._publish_state()
        if self.verbose:
            logger.info(
                "epoch %d done (%d peers)", self.local_epoch, self.tracker.global_progress.num_peers
            )

    def _average(self, averager: DecentralizedAverager, weight: float) -> Any:
        result = self._average_once(averager, weight)
        if result is not None:
            logger.debug(
                "%s: averaged with %d peers (full: %s)",
                averager.settings.prefix,
                len(result),
                result.is_full,
            )
        return result

    def _average_once(self, averager: DecentralizedAverager, weight: float) -> Any:
        # Tag the round with our epoch (hivemind's group bits): peers at different epochs never
        # average together, so a late peer cannot mix its stale gradients into the next step.
        averager.set_group_bits(format(self.local_epoch % 2**20, "020b"))
        # Everyone the tracker sees at our epoch (auxiliary peers included): begin when they are in.
        expected = self.tracker.peers_at_epoch(self.local_epoch)
        averager.set_target_group_size(expected if expected >= 2 else None)
        try:
            # The timeout bounds the search for a group; the all-reduce has its own (allreduce_timeout).
            return averager.step(weight=weight, timeout=2 * self.matchmaking_time + 1.0)
        except (TransientError, KitTimeout, KitError) as e:
            logger.warning("averaging round failed: %s", e)
            return None

    def _average_state(self) -> None:
        with self.state_averager.get_tensors() as buffers:
            for buffer, param in zip(buffers, self._params, strict=True):
                buffer.copy_(param.detach().float().cpu())
        result = self._average(self.state_averager, 1.0)
        if result is None:
            return
        with self.state_averager.get_tensors() as buffers, torch.no_grad():
            for buffer, param in zip(buffers, self._params, strict=True):
                param.copy_(buffer.to(device=param.device, dtype=param.dtype))

    def _auxiliary_step(self) -> None:
        """Auxiliary peers bring no gradients: they join the rounds when the others are ready."""
        progress = self._runtime.call(self.tracker.wait_for_update(5.0), timeout=10.0)
        if progress.epoch > self.local_epoch:
            self.local_epoch = progress.epoch
        if progress.ready:
            self._average(self.grad_averager, 0.0)
            self.local_epoch = progress.epoch + 1
            self.tracker.report_local_progress(self.local_epoch, 0)
        else:
            time.sleep(
                min(1.0, max(0.05, progress.eta_next_epoch / 2))
                if math.isfinite(progress.eta_next_epoch)
                else 0.5
            )

    def _full_state(self) -> dict[str, Any]:
        return {
            "epoch": self.local_epoch,
            "params": [p.detach() for p in self._params],
            "optimizer": self.opt.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
        }

    def _publish_state(self) -> None:
        if self.auxiliary:
            return
        try:
            snapshot = StateSnapshot.capture(self.local_epoch, self._full_state())
        except KitError as e:
            logger.warning("cannot share the training state: %s", e)
            return

        async def publish(_: Any, node: Any) -> None:
            await self._state_server.publish(snapshot)

        self.dht.run_coroutine(publish, return_future=True)

    def _load_snapshot(self, snapshot: StateSnapshot) -> None:
        state = snapshot.state()
        params = state.get("params") if isinstance(state, dict) else None
        if not isinstance(params, list) or len(params) != len(self._params):
            raise StateDownloadFailed(
                "the peers' state has another number of parameters - help: check the model config"
            )
        for mine, theirs in zip(self._params, params, strict=True):
            if tuple(mine.shape) != tuple(theirs.shape):
                raise StateDownloadFailed(
                    f"parameter shape {tuple(theirs.shape)} from peers, {tuple(mine.shape)} here"
                )
        with torch.no_grad():
            for mine, theirs in zip(self._params, params, strict=True):
                mine.copy_(theirs.to(device=mine.device, dtype=mine.dtype))
        self.opt.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.local_epoch = snapshot.epoch
        self._local_samples = 0
        for accumulator in self._accumulators:
            accumulator.zero_()
        self.tracker.report_local_progress(self.local_epoch, 0)
        self._publish_state()


def _validate(arguments: dict[str, Any]) -> None:
    """Refuse argument combinations that cannot work, at construction (hivemind hangs on some: #443)."""
    unsupported = {
        "delay_optimizer_step": arguments["delay_optimizer_step"],
        "delay_grad_averaging": arguments["delay_grad_averaging"],
        "offload_optimizer": arguments["offload_optimizer"],
        "reuse_grad_buffers": arguments["reuse_grad_buffers"],
        "grad_averager_factory": arguments["grad_averager_factory"] is not None,
    }
    for name, value in unsupported.items():
        if value:
            raise ConfigError(
                f"{name} is not supported by kit.Optimizer yet - help: leave it at its default"
            )
    if not isinstance(arguments["target_batch_size"], int) or arguments["target_batch_size"] <= 0:
        raise ConfigError("target_batch_size must be a positive integer - help: e.g. 4096")
    if arguments["client_mode"] and arguments["auxiliary"]:
        raise ConfigError(
            "an auxiliary peer aggregates for others, so it cannot be in client mode - help: drop one"
        )
    if arguments["auxiliary"] and arguments["batch_size_per_step"] is not None:
        raise ConfigError("auxiliary peers bring no samples - help: leave batch_size_per_step=None")
    optimizer = arguments["optimizer"]
    if isinstance(optimizer, torch.optim.Optimizer):
        if arguments["params"] is not None:
            raise ConfigError(
                "params= goes with an optimizer factory - help: pass optimizer=lambda p: Opt(p)"
            )
    elif callable(optimizer):
        if arguments["params"] is None:
            raise ConfigError(
                "an optimizer factory needs params= - help: params=model.parameters()"
            )
    else:
        raise ConfigError("optimizer must be a torch optimizer or a factory of one")
    if arguments["average_state_every"] < 0 or arguments["load_state_timeout"] <= 0:
        raise ConfigError("average_state_every must be >= 0 and load_state_timeout > 0")
    if not isinstance(arguments["run_id"], str) or not arguments["run_id"]:
        raise ConfigError(
            "run_id must be a non-empty string - help: the run's name, e.g. 'sahajbert'"
        )
