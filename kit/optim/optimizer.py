"""``kit.Optimizer``: DeDLOC's collaborative optimizer, with hivemind.Optimizer's interface.

"Each device accumulates gradients at its own pace until the collaboration reaches the target
batch size; then the collaborators exchange their gradients and perform one optimizer step"
(Diskin et al., 2021, §3). Hyperparameters stay fixed whatever the number of volunteers: one
global step ("epoch") always uses ``target_batch_size`` samples.

How one ``step(batch_size=...)`` works (gradient averaging, the default):

1. finished background work is applied first (a safe point: the caller's backward is done and
   its next forward has not begun): a delayed optimizer step, a parameter-averaging round, a
   catch-up state download;
2. the local gradient is added to an accumulator, weighted by ``batch_size`` (or, with
   ``reuse_grad_buffers``, left to accumulate in ``.grad``); a non-finite gradient is skipped
   with a warning (it never poisons the others);
3. the progress tracker publishes the local sample count; if the collaboration now has the
   target batch, this peer joins an averaging round tagged with its epoch: every peer
   contributes its *mean* gradient weighted by its sample count, so the result is exactly the
   mean gradient over the global batch, as one process accumulating it would compute;
4. the inner optimizer steps with that gradient (in a background thread with
   ``delay_optimizer_step``), the scheduler steps once per epoch;
5. parameters are averaged only when they may have drifted apart (``state_averaging``: a
   full, exact gradient all-reduce leaves every member identical), in the background, applied
   later as a delta (hivemind's ``delay_state_averaging``);
6. a peer that fell one epoch behind (its round failed, or it just downloaded a state that the
   collaboration has since stepped past) moves to the current epoch at once and downloads the
   current state in the background; further behind, it downloads the state before going on.

With ``delay_grad_averaging`` (needs ``delay_optimizer_step``), steps 3-4 run in the background
thread: the peer moves to the next epoch at once and computes its next batches while the round
and the optimizer step go on; their result lands at a safe point, one step stale, as in hivemind.

With ``use_local_updates=True`` (hivemind's quickstart; local SGD as in DiLoCo-style runs) the
inner optimizer steps after every local step and the collaboration averages parameters once per
epoch, with the optimizer statistics named in ``average_opt_statistics``.

Supported hivemind arguments: all but ``grad_averager_factory`` (refused with ConfigError: kit
has one gradient averager) and ``load_state_compression`` (refused unless None/NoCompression: the
state is verified by its digest).

Where it lives: the decisions above are the epoch machine's (``kit.optim.epochs``, pure), carried
out by ``kit.optim.driver``; the tracker and the averagers are started by ``kit.optim.collaboration``; this module holds
the public API and composes the parts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from kit.averaging.averager import DecentralizedAverager, RoundResult
from kit.averaging.compression import CompressionBase
from kit.averaging.control import StepControl
from kit.averaging.deadlines import Deadlines
from kit.errors import (
    ConfigError,
    KitUsageError,
)
from kit.optim.accumulation import GradientAccumulator
from kit.optim.arguments import resolve_defaults, validate
from kit.optim.collaboration import (
    averaging_options,
    build_averagers,
    start_state_server,
    start_tracker,
    stop_tracker,
)
from kit.optim.driver import EpochDriver
from kit.optim.epochs import EpochLife
from kit.optim.progress import GlobalProgress
from kit.optim.sharing import StateSharing, start_download
from kit.optim.state_averaging import (
    AveragedTensors,
    DelayedStateAveraging,
    default_statistics,
    initialize_statistics,
)
from kit.optim.stepping import InnerOptimizer
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
            with few peers averaging. ``"auto"``: derived from the swarm's size and the last
            rounds (``kit.averaging.deadlines``).
        averaging_timeout: the longest an averaging round may take (about 2x a normal round);
            increase it if rounds on slow links time out. ``"auto"``: from the last rounds.
        target_group_size: the largest averaging group. When more peers are expected at an
            epoch, the gradient is averaged on a Moshpit grid of groups of this size (still the
            exact global-batch gradient on a full grid: ``kit.optim.rounds``). None: one group.
        load_state_timeout: the longest a state download from peers may take.
        shutdown_timeout: how long ``shutdown`` lets a background step (its gradient round
            with ``delay_grad_averaging``) finish before cancelling the round; raise it if you
            see "did not finish within shutdown_timeout" and want that last step kept.
        reuse_grad_buffers: accumulate in the parameters' ``.grad`` instead of a separate buffer
            (saves one copy of the model). Never call ``zero_grad`` then: kit clears ``.grad``
            after each global step. Each micro-batch weighs the same (keep their sizes equal).
        offload_optimizer: the inner optimizer works on float32 CPU copies of the parameters
            (its statistics stay off the GPU); needs the factory form of ``optimizer``.
        delay_optimizer_step: the inner optimizer steps in a background thread while the next
            batch computes; the parameters change at the next ``step()`` call (so gradients of
            the batch in between are one step stale, as in hivemind). Needs the factory form.
        delay_grad_averaging: the gradient round (and the optimizer step) run in the background
            while the next batches compute; needs ``delay_optimizer_step`` (its default then).
            Turn it on when rounds take long next to a batch (slow links, big models).
        delay_state_averaging: parameter-averaging rounds run in the background and are applied
            as a delta when done (False: wait for them).
        average_state_every: parameters may be averaged every this many epochs (0: never); with
            exact gradient rounds only when some peer drifted (see ``kit.optim.state_averaging``).
        use_local_updates: step the inner optimizer after each local step and average
            parameters once per epoch (local SGD) instead of averaging gradients.
        client_mode: True for peers that cannot accept connections (None: as the DHT's peer).
        auxiliary: a helper without gradients (CPU is enough): it only joins averaging rounds.
        grad_compression, state_averaging_compression: codecs (kit.averaging) on the wire.
        average_opt_statistics: names of optimizer statistics averaged with the parameters
            (e.g. ``("exp_avg_sq",)`` for Adam). None (kit's default): Adam's and LAMB's two
            moments, so that a peer pulled back after a failed or split round steps like the
            others again (none for other optimizers, and with ``use_local_updates``); pass
            hivemind's default ``()`` to save their memory and traffic
            (``kit.optim.state_averaging.default_statistics`` says why).
        extra_tensors: further tensors averaged with the parameters and shared with late
            joiners (e.g. a running mean that is not a parameter); same shapes on every peer.
        averager_opts, tracker_opts: extra keyword arguments of the averagers and the tracker.
        verbose: log every epoch at INFO level.

    Raises:
        ConfigError: an unsupported argument or combination (with what to do instead).
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
        matchmaking_time: float | str | None = 15.0,
        averaging_timeout: float | str | None = 60.0,
        target_group_size: int | None = None,
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
        average_opt_statistics: Sequence[str] | None = None,
        extra_tensors: Sequence[torch.Tensor] = (),
        averager_opts: dict[str, Any] | None = None,
        tracker_opts: dict[str, Any] | None = None,
        performance_ema_alpha: float = 0.1,
        shutdown_timeout: float = 5.0,
        verbose: bool = False,
    ) -> None:
        validate(locals())
        delay_step, offload = resolve_defaults(locals())
        self.dht = dht
        self.run_id = run_id
        self.target_batch_size = target_batch_size
        self.batch_size_per_step = batch_size_per_step
        self.use_local_updates = use_local_updates
        self.auxiliary = auxiliary
        self.reuse_grad_buffers = reuse_grad_buffers
        self.delay_optimizer_step = delay_step
        self.delay_grad_averaging = delay_grad_averaging
        self.delay_state_averaging = delay_state_averaging
        self.average_state_every = average_state_every
        self.load_state_timeout = load_state_timeout
        self.shutdown_timeout = float(shutdown_timeout)
        self.target_group_size = target_group_size
        # Fixed, or "auto" (kit.averaging.deadlines): updated before every gradient round.
        deadlines = Deadlines.create(matchmaking_time or 15.0, averaging_timeout or 60.0, 0)
        self.verbose = verbose
        # A late joiner needs the collaboration's state and progress: both are fetched while the
        # rest is set up (building the inner optimizer alone takes ~1.4 s on torch 2.x: its first
        # use imports torch._dynamo), and load_state_from_peers, or the first step, takes the
        # state if it is still current.
        prefetch = (
            None
            if auxiliary
            else start_download(dht, run_id, load_state_timeout, only_if_running=True)
        )
        client = dht.client_mode if client_mode is None else client_mode
        self.client_mode = client  # hivemind's attribute: aggregates nothing, serves no state
        life = EpochLife(prefetching=prefetch is not None)  # the epochs (kit.optim.epochs)

        self.tracker = start_tracker(
            dht,
            run_id,
            target_batch_size,
            client_mode=client,
            auxiliary=auxiliary,
            performance_ema_alpha=performance_ema_alpha,
            tracker_opts=tracker_opts,
            drifted=life.drifted,
        )
        try:
            self._inner = InnerOptimizer(optimizer, params, copies=offload, delay=delay_step)
            self.opt = self._inner.opt
            self._params = self._inner.params
            deadlines.vector_bytes = 4 * sum(p.numel() for p in self._params)
            self._matchmaking_time = deadlines.matchmaking_time(2)  # until the first round
            self._averaging_timeout = deadlines.averaging_timeout(2)
            self._extra = list(extra_tensors)
            # (before the scheduler: initializing the statistics takes an optimizer step)
            if average_opt_statistics is None:
                average_opt_statistics = () if use_local_updates else default_statistics(self.opt)
            self.average_opt_statistics = tuple(average_opt_statistics)
            if self.average_opt_statistics:
                initialize_statistics(self.opt, self.average_opt_statistics)
            averaged = AveragedTensors(self._inner, self.average_opt_statistics, self._extra)
            scheduler = (
                scheduler(self.opt)
                if callable(scheduler) and not hasattr(scheduler, "step")
                else scheduler
            )
            # torch.optim.Optimizer bookkeeping: share the inner optimizer's groups and state.
            self.defaults = self.opt.defaults
            self._optimizer_step_pre_hooks = {}  # type: ignore[var-annotated]
            self._optimizer_step_post_hooks = {}  # type: ignore[var-annotated]
            self._accumulated = GradientAccumulator(
                self._params,
                reuse_grad_buffers=reuse_grad_buffers,
                buffered=not (use_local_updates or auxiliary),
            )
            averagers = build_averagers(
                dht,
                run_id,
                self._params,
                averaged.current(),
                state_roles=averaged.roles(),
                tracker=self.tracker,
                deadlines=deadlines,
                use_local_updates=use_local_updates,
                target_group_size=target_group_size,
                grad_compression=grad_compression,
                state_averaging_compression=state_averaging_compression,
                averaging=averaging_options(
                    self._matchmaking_time,
                    self._averaging_timeout,
                    allreduce_timeout,
                    next_chunk_timeout,
                    client_mode=client,
                    auxiliary=auxiliary,
                    averager_opts=averager_opts,
                ),
            )
            self._averagers = averagers
            self.grad_averager: DecentralizedAverager | None = averagers.grads
            self.state_averager = averagers.state
            sharing = StateSharing(
                dht=dht,
                run_id=run_id,
                inner=self._inner,
                extra=self._extra,
                scheduler=scheduler,
                server=start_state_server(dht, run_id),
                prefetch=prefetch,
                load_state_timeout=load_state_timeout,
            )
            self._driver = EpochDriver(
                life=life,
                inner=self._inner,
                accumulated=self._accumulated,
                tracker=self.tracker,
                rounds=averagers.rounds,
                sharing=sharing,
                state_round=DelayedStateAveraging(self.state_averager, averaged.add),
                averaged=averaged,
                runtime=get_runtime(),
                options={
                    **{name: getattr(self, name) for name in EpochDriver.OPTIONS},
                    "matchmaking_time": self._matchmaking_time,  # (local updates: no rounds)
                },
            )
            self._driver.landing.publish_state()
        except BaseException:  # undo what was started (a bad optimizer factory, bad options)
            if prefetch is not None:
                prefetch.cancel()
            stop_tracker(self.dht, self.tracker)
            raise

    # The inner optimizer's current groups and state (its load_state_dict replaces them).
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

    @property
    def local_epoch(self) -> int:
        """This peer's epoch (global steps taken, or loaded with a state)."""
        return self._driver.life.epoch

    @local_epoch.setter
    def local_epoch(self, epoch: int) -> None:
        self._driver.life.epoch_set(epoch)

    @property
    def nonfinite_rollbacks(self) -> int:
        """Steps undone because they left a parameter non-finite."""
        return self._driver.nonfinite_rollbacks

    @property
    def exact_steps(self) -> bool:
        """False if its steps differ from the others' (8-bit statistics): rounds mark it drifted."""
        return self._driver.exact_steps

    @exact_steps.setter
    def exact_steps(self, exact: bool) -> None:
        self._driver.exact_steps = exact

    @property
    def scheduler(self) -> Any:
        """The learning-rate scheduler (None if none); it steps once per epoch."""
        return self._driver.sharing.scheduler

    @scheduler.setter
    def scheduler(self, scheduler: Any) -> None:
        self._driver.sharing.scheduler = scheduler

    @property
    def matchmaking_time(self) -> float:
        """Seconds a peer waits for its group (with "auto": as set for the last round)."""
        rounds = self._driver.rounds
        return rounds.matchmaking_time if rounds is not None else self._matchmaking_time

    @property
    def averaging_timeout(self) -> float:
        """The longest a round may take (with "auto": as set for the last round)."""
        rounds = self._driver.rounds
        return rounds.averaging_timeout if rounds is not None else self._averaging_timeout

    @property
    def global_progress(self) -> GlobalProgress:
        return self.tracker.global_progress

    @property
    def scheduled_grads(self) -> StepControl | None:
        """The gradient averager's latest step (hivemind's name): done unless a round runs;
        None before the first round, and with ``use_local_updates``."""
        return None if self.grad_averager is None else self.grad_averager.last_step

    def is_alive(self) -> bool:
        """The optimizer's averagers still run (False after ``shutdown``), as hivemind's."""
        return self.state_averager.is_alive()

    def is_synchronized_with_peers(self) -> bool:
        """True if this peer is at the collaboration's epoch (or one behind, mid-step)."""
        return self.local_epoch >= self.tracker.global_progress.epoch - 1

    def add_round_listener(self, listener: Callable[[int, RoundResult], None]) -> None:
        """Call ``listener(epoch, result)`` after each gradient round that formed a group (in
        the thread that ran it): ``kit.metrics`` attests the members' weights this way."""
        if self._driver.rounds is not None:  # with local updates there are no gradient rounds
            self._driver.rounds.listeners.append(listener)

    def step(
        self,
        closure: Callable[[], Any] | None = None,
        batch_size: int | None = None,
        grad_scaler: Any = None,
        *,
        clip_grad_norm: float | None = None,
    ) -> Any:
        """Accumulate this step's gradients; take a global step when the collaboration is ready.

        Args:
            closure: recomputes the loss (as in torch.optim), optional.
            batch_size: samples in this step (default: ``batch_size_per_step``); 0 only checks
                whether the collaboration is ready.
            grad_scaler: a ``torch.amp.GradScaler`` (any, ``kit.GradScaler`` included) whose
                scale is in the gradients: they are unscaled once, on what is averaged, and a
                step with inf/NaN gradients is skipped. The inf/NaN check is recorded in the
                scaler, so call ``grad_scaler.update()`` after this, as after
                ``grad_scaler.step(opt)`` in plain PyTorch (``kit.optim.grad_scaling``).
            clip_grad_norm: clip this step's gradient to this global L2 norm (of the unscaled
                gradient) as it is accumulated, in the same pass (kit's, not hivemind's:
                sahajBERT clipped each peer's local gradients); not with ``reuse_grad_buffers``.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.auxiliary:
            self._driver.auxiliary_step()
            return loss
        if batch_size is None:
            if self.batch_size_per_step is None:
                raise ConfigError(
                    "step() needs batch_size - help: pass it, or batch_size_per_step= when creating the Optimizer"
                )
            batch_size = self.batch_size_per_step
        self._driver.step(batch_size, grad_scaler, clip_grad_norm)
        return loss

    def load_state_from_peers(self, timeout: float | None = None) -> bool:
        """Download parameters, optimizer and scheduler state and epoch from up-to-date peers.

        Returns:
            Whether a state was loaded: False at once, keeping this peer's own state, when no
            other peer shares one (the first peer of a run), as hivemind does.

        Raises:
            StateDownloadFailed: peers share a state, but none could provide a verified one
                within the timeout.
        """
        return self._driver.landing.load_from_peers(timeout)

    def share_state(self) -> None:
        """Serve this peer's current state to others and report its epoch, auxiliary or not.

        For a state loaded from elsewhere (the coordinator's checkpoint after a restart): late
        joiners download it when no training peer has a newer one.
        """
        self.tracker.report_local_progress(self.local_epoch, 0)
        self._driver.landing.publish_state(even_auxiliary=True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.reuse_grad_buffers:
            raise KitUsageError(
                "with reuse_grad_buffers=True the gradients accumulate in .grad until the global "
                "step, and kit clears them itself - help: remove the zero_grad() call"
            )
        self._accumulated.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        self._driver.finish_optimizer_step(wait=None)
        state = self.opt.state_dict()
        state["kit_local_epoch"] = self.local_epoch
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._driver.finish_optimizer_step(wait=None)
        state_dict = dict(state_dict)
        epoch = int(state_dict.pop("kit_local_epoch", self.local_epoch))
        self.opt.load_state_dict(state_dict)
        self._driver.act(self._driver.life.checkpoint_loaded(epoch))  # it may not match theirs

    def shutdown(self) -> None:
        """Stop: a background step gets ``shutdown_timeout`` s to land, then its gradient round
        is cancelled (the averagers stop first, so the step's thread ends at once)."""
        try:
            self._driver.finish_optimizer_step(wait=self.shutdown_timeout)
            if self._inner.pending:
                logger.warning(
                    "the background step did not finish within shutdown_timeout=%.1f s: its "
                    "averaging round is cancelled",
                    self.shutdown_timeout,
                )
        finally:
            self._averagers.shutdown()
            self._inner.shutdown()
            self._driver.sharing.shutdown()
            stop_tracker(self.dht, self.tracker)
