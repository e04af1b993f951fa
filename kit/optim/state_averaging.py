"""Parameter ("state") averaging for ``kit.Optimizer``: when it is needed, and how it runs late.

Holds :func:`state_averaging_needed` (pure: does this epoch need a parameter-averaging round?) and
:class:`DelayedStateAveraging` (one round in the background, applied later as a delta). It does not
hold the averager itself (``kit.averaging``) nor the gradient rounds (``kit.optim.optimizer``).

Why parameters rarely need averaging with gradient averaging. After an all-reduce that is
*full* (every part averaged over every sender) and *exact* (no lossy codec), every member of the
group holds bit-identical averaged gradients: each part is reduced once, by its aggregator, and the
same bytes go to every member. Members that start an epoch with identical parameters and optimizer
statistics and apply the identical gradient with the same optimizer end it identical too, so an
averaging round would only average equal numbers. Parameters drift apart only when a round failed
or was partial, when a lossy codec sends each member its own difference (hivemind's scheme; kit's
gradient rounds send one shared average that every member decodes alike, ``averages.py``), when
a peer missed a round (no samples, late), or by rounding on different hardware. So:

* a peer whose gradient round was not full and exact, or whose group was smaller than the peers
  its tracker sees at that epoch (the group may have split), marks itself *drifted*, and publishes
  it with its progress; it stays drifted until a full parameter round with all of them;
* on epochs where ``average_state_every`` calls for it, a peer averages parameters if it or
  someone at its epoch is drifted, and in any case every ``SAFETY_PERIOD`` such epochs (slow
  drift from different hardware's rounding);
* with ``use_local_updates`` parameters differ by design: they are averaged whenever due.

Peers may disagree for a moment on whether a round is needed (records travel through the DHT);
the cost is a background round that finds no group, and the drifted flag makes the others join
at the next due epoch.

What a round averages (:class:`AveragedTensors`): the parameters, then the optimizer statistics
named in ``average_opt_statistics`` (e.g. Adam's ``exp_avg_sq``; with local updates the peers'
statistics differ as much as their parameters), then the ``extra_tensors``, in that fixed order on
every peer. Statistics must exist before the first round (their shapes make the averager's
schema), so :func:`initialize_statistics` creates them with a step that changes nothing.

Delayed application (hivemind's ``delay_state_averaging``, the delta rule): the round averages a
copy of the parameters taken when it starts, while training goes on; when it ends, each parameter
moves by ``averaged - snapshot``, so whatever the peer did meanwhile (local updates, an optimizer
step) is kept on top of the average instead of being overwritten.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Sequence

import torch

from kit.averaging.averager import DecentralizedAverager, RoundResult
from kit.averaging.compression import TensorRole
from kit.averaging.control import StepControl
from kit.errors import AveragingFailed, ConfigError
from kit.optim.stepping import InnerOptimizer

logger = logging.getLogger(__name__)

SAFETY_PERIOD = 32  # with exact rounds, still average parameters every this many due epochs


def state_averaging_needed(
    epoch: int,
    every: int,
    *,
    local_updates: bool,
    drifted: bool,
    others_drifted: bool,
) -> bool:
    """Whether the round after reaching ``epoch`` averages parameters (pure).

    Args:
        epoch: the epoch just reached (every peer decides on the same number).
        every: ``average_state_every`` (0: never).
        local_updates: peers step on local gradients, so parameters always differ.
        drifted, others_drifted: this peer's, and the others' (as last fetched), drift flags.
    """
    if every <= 0 or epoch % every:
        return False
    if local_updates or drifted or others_drifted:
        return True
    return epoch % (every * SAFETY_PERIOD) == 0


#: Per-parameter float32 statistics of optimizers whose state kit knows: torch's Adam family;
#: an optimizer class may name its own in an ``averaged_statistics`` attribute (kit's LAMB does).
ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")
ADAM_FAMILY = (torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam)


def default_statistics(opt: torch.optim.Optimizer) -> tuple[str, ...]:
    """``average_opt_statistics=None``: the statistics of ``opt`` averaged with the parameters
    (Adam's and LAMB's two moments; none for an optimizer kit does not know).

    Why by default: a peer whose gradient round failed or split stepped with other gradients, so
    its optimizer statistics differ from the others' as well as its parameters. Averaging the
    parameters alone brings them together for one step; the next steps, the same gradient
    through different Adam moments, part them again (seen in tests/netsim/test_churn.py: peers
    ~1e-3 apart 160 epochs later, every round full). Averaged together, they stay together. The
    cost: parameter rounds (only when some peer drifted) carry those tensors too, and the
    averager keeps float32 copies of them. Only known optimizers: their state is created by one
    step on zero gradients (``initialize_statistics``), which another optimizer's ``step`` might
    count or log. The averaged tensors must be the same on every peer: pass
    ``average_opt_statistics=()`` where peers of one run keep different kinds (8-bit ones).
    """
    names = getattr(type(opt), "averaged_statistics", None)
    if names is not None:
        return tuple(names)
    return ADAM_MOMENTS if isinstance(opt, ADAM_FAMILY) else ()


def initialize_statistics(opt: torch.optim.Optimizer, names: Sequence[str]) -> None:
    """Create ``opt``'s per-parameter state (lazy in torch) so ``names`` can be averaged.

    One step on zero gradients, then every parameter is put back and step counters reset: with
    weight decay or momentum a step on a zero gradient could still move a parameter.

    Raises:
        ConfigError: a name that is not a tensor of the optimizer's state, shaped as its parameter.
    """
    params = [p for group in opt.param_groups for p in group["params"]]
    missing = [p for p in params if not opt.state.get(p)]
    if missing:
        grads = [p.grad for p in params]
        saved = [p.detach().clone() for p in missing]
        for p in params:  # a zero gradient where state is missing; the others are skipped
            p.grad = torch.zeros_like(p) if not opt.state.get(p) else None
        opt.step()
        with torch.no_grad():
            for p, value in zip(missing, saved, strict=True):
                p.copy_(value)
                step = opt.state[p].get("step")
                if step is not None:
                    opt.state[p]["step"] = torch.zeros_like(step) if torch.is_tensor(step) else 0
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad
    for p in params:
        for name in names:
            value = opt.state[p].get(name)
            if not torch.is_tensor(value) or value.shape != p.shape:
                available = sorted(
                    k for k, v in opt.state[p].items() if torch.is_tensor(v) and v.shape == p.shape
                )
                raise ConfigError(
                    f"average_opt_statistics: {type(opt).__name__} has no per-parameter {name!r}"
                    f" - help: use some of {available}"
                )


class AveragedTensors:
    """The tensors a parameter round averages: parameters, named optimizer statistics, extras.

    Args:
        inner: the inner optimizer (its parameters, and their master copies holding the state).
        statistics: names of per-parameter optimizer statistics (``average_opt_statistics``).
        extra: further tensors averaged as they are (``extra_tensors``).
    """

    def __init__(
        self, inner: InnerOptimizer, statistics: Sequence[str], extra: Sequence[torch.Tensor]
    ) -> None:
        self.inner = inner
        self.statistics = tuple(statistics)
        self.extra = list(extra)

    def roles(self) -> list[TensorRole]:
        """What each tensor of ``current()`` is to the model, as hivemind's
        TrainingStateAverager tags them for role-adaptive codecs."""
        statistics = len(self.inner.master) * len(self.statistics)
        return [
            *[TensorRole.PARAMETER] * len(self.inner.params),
            *[TensorRole.OPTIMIZER] * statistics,
            *[TensorRole.UNSPECIFIED] * len(self.extra),
        ]

    def current(self) -> list[torch.Tensor]:
        """The tensors now (statistics looked up afresh: loading a state replaces them)."""
        state = self.inner.opt.state
        stats = [state[m][name] for m in self.inner.master for name in self.statistics]
        return [*self.inner.params, *stats, *self.extra]

    def add(self, deltas: Sequence[torch.Tensor]) -> None:
        """Move every tensor by its delta (parameters: every copy of them too)."""
        count = len(self.inner.params)
        self.inner.add(deltas[:count])
        with torch.no_grad():
            for tensor, delta in zip(self.current()[count:], deltas[count:], strict=True):
                tensor.add_(delta.to(device=tensor.device, dtype=tensor.dtype))


class DelayedStateAveraging:
    """At most one parameter-averaging round at a time, applied as a delta when it is done.

    Args:
        averager: the state averager; its tensors are float32 CPU buffers shaped as the parameters.
        apply_deltas: adds the round's deltas to the parameters (and every copy of them).
    """

    def __init__(
        self,
        averager: DecentralizedAverager,
        apply_deltas: Callable[[Sequence[torch.Tensor]], None],
    ) -> None:
        self.averager = averager
        self.apply_deltas = apply_deltas
        self._snapshot: list[torch.Tensor] = []
        self._future: concurrent.futures.Future[RoundResult | None] | None = None
        self._expected = 0
        self.epoch = -1  # of the last round begun (its group's key)
        self._forgotten = False  # a settled state was loaded meanwhile: the delta is not applied
        self.rebased = False  # a state was loaded meanwhile: the delta is taken from it

    @property
    def running(self) -> bool:
        return self._future is not None

    @property
    def moves_parameters(self) -> bool:
        """A round runs whose delta will move the parameters when it lands."""
        return self._future is not None and not self._forgotten

    def forget(self) -> None:
        """A settled state was loaded: the running round (if any) averaged the parameters
        before it, and its delta would move the loaded ones to values nobody holds. It runs on
        (the others' group keeps its member) and lands as a round without a result."""
        if self._future is not None:
            self._forgotten = True
            self.rebased = False

    def rebase(self, source: Sequence[torch.Tensor]) -> None:
        """A state was loaded whose donor averages in this same round, from these tensors: the
        delta is taken from them, so the loaded state lands where the donor's does."""
        if self._future is None:
            return
        self._snapshot = [t.detach().float().cpu().clone() for t in source]
        self.rebased = True

    def start(
        self,
        source: Sequence[torch.Tensor],
        group_bits: str,
        expected: int,
        timeout: float,
        *,
        epoch: int = -1,
    ) -> None:
        """Copy ``source`` (the current parameters) and begin a round (of ``epoch``) in the
        background."""
        self.epoch = epoch
        self._forgotten = self.rebased = False
        with self.averager.get_tensors() as buffers:
            for buffer, param in zip(buffers, source, strict=True):
                buffer.copy_(param.detach().float().cpu())
            self._snapshot = [buffer.clone() for buffer in buffers]
        self.averager.set_group_bits(group_bits)
        self.averager.set_target_group_size(expected if expected >= 2 else None)
        self._expected = expected
        future = self.averager.step(weight=1.0, timeout=timeout, wait=False)
        assert isinstance(future, concurrent.futures.Future)  # a StepControl
        self._future = future

    def give_up_search(self) -> bool:
        """Drop the running round if it is still looking for a group (nobody counts on this peer
        yet); True if no round runs now.

        Why: a round of an older epoch that found nobody keeps searching for its whole window
        (several epochs), and meanwhile this peer skips the rounds the others do hold. Seen in
        tests/netsim/test_churn.py: a joiner's lone round at epoch 3 timed out at epoch 6, its
        next at 7 at 10, ... while the three others averaged at 4, 6, 8, ... without it; their
        rounds were never complete (3 of 4 expected), so they went on forever, out of phase, and
        the joiner's parameters stayed apart from theirs.
        """
        future = self._future
        if future is None:
            return True
        if not isinstance(future, StepControl) or not self.averager.give_up_search(future):
            return False
        logger.debug("parameter round of epoch %d: given up (still no group)", self.epoch)
        self._future = None
        self._snapshot = []
        self._forgotten = self.rebased = False
        return True

    def finish(self, wait: float | None = 0.0) -> tuple[bool, RoundResult | None]:
        """Apply the round if it is over (waiting at most ``wait`` s; None: until it is).

        Returns:
            (over, result): ``over`` False while it still runs; ``result`` None if it failed.
        """
        future = self._future
        if future is None:
            return True, None
        try:
            result = future.result(timeout=wait)
        except concurrent.futures.TimeoutError:
            return False, None
        except AveragingFailed as e:  # no group (nobody drifted, or alone): nothing to apply
            logger.info("parameter averaging: %s", e)
            result = None
        except Exception as e:  # a failed round must never stop training
            logger.warning("parameter averaging failed: %s", e)
            result = None
        self._future = None
        self.rebased = False
        if self._forgotten:
            self._forgotten = False
            logger.debug("a parameter round landed after a settled state was loaded: not applied")
            result = None
        if result is not None:
            with self.averager.get_tensors() as buffers:
                deltas = [b - s for b, s in zip(buffers, self._snapshot, strict=True)]
            self.apply_deltas(deltas)
        self._snapshot = []
        return True, result

    def complete(self, result: RoundResult | None) -> bool:
        """Whether ``result`` averaged everyone this peer expected, exactly (clears drift)."""
        return result is not None and result.is_full and len(result) >= self._expected
