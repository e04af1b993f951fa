"""The ``optimizer:`` and ``collaboration:`` sections: how each peer steps, and how peers average.

Holds ``OptimizerConfig`` (LAMB, 8-bit LAMB or AdamW, learning-rate schedule, clipping) and
``CollaborationConfig`` (the hivemind.Optimizer settings: run id, global batch, matchmaking and
averaging timeouts, wire compression by name, delayed steps, local updates, robust aggregation,
gradient buffers, offload). Defaults are sahajBERT's (DeDLOC, Diskin et al. 2021, §4.2 and its
``arguments.py``); :func:`ttt_optimizer` and :func:`ttt_collaboration` hold Training Transformers
Together's (recipes.md §4). It doesn't build optimizers or codecs (no torch here):
``kit.training.components`` turns these names into objects.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from kit.config.fields import (
    _as_tuple,
    _check_keys,
    _to_plain,
    check_bool,
    check_choice,
    check_int,
    check_number,
    check_text,
    config_error,
    store_normalized,
)

OPTIMIZERS = ("lamb", "lamb8bit", "adamw")
#: How an aggregator reduces its part (``kit.averaging.robust``).
ROBUST_AGGREGATIONS = ("mean", "centered_clip")
SCHEDULES = ("linear", "constant")
#: Wire codecs by name (``kit.averaging.compression``; hivemind's codecs of the same name).
#: "size_adaptive" = fp16 below ``size_adaptive_threshold`` elements, uniform8bit from there on.
COMPRESSIONS = (
    "none",
    "fp16",
    "scaledfp16",
    "uniform8bit",
    "quantile8bit",
    "blockwise8bit",
    "size_adaptive",
)
#: run_id goes into DHT keys and the handshake: keep it short and printable.
RUN_ID_MAX_LENGTH = 64


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """The local optimizer and its schedule (the ``optimizer:`` section of run.yaml).

    One schedule step = one global step ("epoch" in hivemind's terms: ``target_batch_size``
    samples over all peers), not one local ``step()`` call.
    """

    # fmt: off
    name: str = "lamb"  # "lamb" (You et al. 2020; large global batches), "lamb8bit" (8-bit statistics, bitsandbytes) or "adamw"
    lr: float = 0.00176  # peak learning rate; lower it if the loss spikes or turns NaN after warmup
    betas: tuple[float, float] = (0.9, 0.999)  # Adam moment decay rates (beta1, beta2)
    eps: float = 1e-6  # added to the denominator; raise it (1e-4) if fp16 steps turn NaN
    weight_decay: float = 0.01  # decoupled decay; biases and LayerNorm weights never decay
    lamb_clamp_value: float = 10_000.0  # LAMB clamps the weight norm of its trust ratio to this
    lamb_debias: bool = True  # LAMB scales steps by sqrt(1-b2^t)/(1-b1^t) (sahajBERT); false = paper v3 (TTT)
    clip_grad_norm: float | None = 1.0  # clip each peer's local gradients to this L2 norm; null = no clipping
    max_grad_norm: float | None = None  # clip the averaged gradient inside the optimizer step (TTT: 4.0); null = off
    warmup_steps: int = 5_000  # global steps of linear warmup; raise it if the loss diverges early
    total_steps: int = 1_000_000  # global steps the linear decay reaches 0 at (sahajBERT: 1e6, ran ~19.5k)
    schedule: str = "linear"  # "linear": warmup then linear decay to 0; "constant": warmup then flat
    # fmt: on

    SECTION: ClassVar[str] = "optimizer"

    def __post_init__(self) -> None:
        where = self.SECTION
        check_choice(f"{where}.name", self.name, OPTIMIZERS)
        lr = check_number(f"{where}.lr", self.lr, above=0, maximum=1.0, hint="sahajBERT: 0.00176")
        store_normalized(self, "lr", lr)
        betas = self.betas
        if not isinstance(betas, tuple) or len(betas) != 2:
            raise config_error(
                f"{where}.betas", f"must be two numbers, got {betas!r}", "write [0.9, 0.999]"
            )
        store_normalized(
            self,
            "betas",
            tuple(
                check_number(f"{where}.betas[{i}]", beta, minimum=0, maximum=0.9999999)
                for i, beta in enumerate(betas)
            ),
        )
        store_normalized(self, "eps", check_number(f"{where}.eps", self.eps, above=0, maximum=1.0))
        store_normalized(
            self,
            "weight_decay",
            check_number(f"{where}.weight_decay", self.weight_decay, minimum=0, maximum=1.0),
        )
        store_normalized(
            self,
            "lamb_clamp_value",
            check_number(f"{where}.lamb_clamp_value", self.lamb_clamp_value, above=0),
        )
        check_bool(f"{where}.lamb_debias", self.lamb_debias)
        if self.max_grad_norm is not None:
            store_normalized(
                self,
                "max_grad_norm",
                check_number(
                    f"{where}.max_grad_norm",
                    self.max_grad_norm,
                    above=0,
                    hint="use e.g. 4.0 (TTT), or null for no clipping inside the optimizer",
                ),
            )
        if self.clip_grad_norm is not None:
            store_normalized(
                self,
                "clip_grad_norm",
                check_number(
                    f"{where}.clip_grad_norm",
                    self.clip_grad_norm,
                    above=0,
                    hint="use e.g. 1.0, or null for no clipping",
                ),
            )
        check_int(f"{where}.warmup_steps", self.warmup_steps, minimum=0)
        check_int(f"{where}.total_steps", self.total_steps, minimum=1)
        if self.warmup_steps > self.total_steps:
            raise config_error(
                f"{where}.warmup_steps",
                f"({self.warmup_steps}) must not exceed total_steps ({self.total_steps})",
                "lower warmup_steps or raise total_steps",
            )
        check_choice(f"{where}.schedule", self.schedule, SCHEDULES)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "optimizer") -> OptimizerConfig:
        """Build from the ``optimizer:`` mapping of a run configuration (raises ConfigError)."""
        values = _check_keys(cls, data, where)
        if "betas" in values:
            values["betas"] = _as_tuple(f"{where}.betas", values["betas"])
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (betas as a list) that ``from_dict`` reads back."""
        return _to_plain(self)


@dataclasses.dataclass(frozen=True)
class CollaborationConfig:
    """How peers form one global batch and average (the ``collaboration:`` section).

    Names follow ``hivemind.Optimizer`` so hivemind users recognize them. Defaults: sahajBERT's
    batch (4096 sequences per global step) with the internet-friendly waits of Training
    Transformers Together (matchmaking 15 s).
    """

    # fmt: off
    run_id: str = "sahajbert"  # peers of another run_id are refused; also the DHT key prefix
    target_batch_size: int = 4_096  # samples per global step over all peers; fixed for the whole run
    batch_size_per_step: int = 8  # this peer's samples per local step(); lower it if GPU memory runs out
    target_group_size: int | None = 256  # largest averaging group; more peers average on a Moshpit grid; null = one group
    matchmaking_time: float | str = "auto"  # seconds to gather a group; "auto": from swarm size and past rounds
    averaging_timeout: float | str = "auto"  # one averaging round's limit; "auto": from past rounds; raise it if rounds time out
    load_state_timeout: float = 600.0  # limit of a state download from peers; raise it on a slow link
    average_state_every: int = 1  # average parameters every N global steps (0 = never); fixes drift
    grad_compression: str = "fp16"  # codec of averaged gradients; "uniform8bit" for slow uplinks
    state_compression: str = "fp16"  # codec of averaged parameters/optimizer state
    size_adaptive_threshold: int = 65_537  # "size_adaptive": tensors this large go uniform8bit
    delay_optimizer_step: bool = False  # step the optimizer in a background thread, applied one batch late (TTT: true)
    delay_grad_averaging: bool = False  # average gradients in the background too (needs delay_optimizer_step); for slow links
    use_local_updates: bool = False  # step on every local batch and average parameters each epoch (local SGD)
    robust_aggregation: str = "mean"  # "centered_clip" if some peers may send garbage gradients (costs memory)
    clip_tau: float | None = None  # CenteredClip radius; null = median distance each round; lower it if bad peers still move the loss
    reuse_grad_buffers: bool = False  # accumulate in .grad, saving a model copy (TTT: true); needs clip_grad_norm null
    offload_optimizer: bool = False  # keep optimizer statistics in CPU RAM (TTT: true); a peer's GPU plan may add it
    # fmt: on

    SECTION: ClassVar[str] = "collaboration"

    def __post_init__(self) -> None:
        where = self.SECTION
        run_id = check_text(f"{where}.run_id", self.run_id, hint='write e.g. "bengali-bert"')
        if len(run_id) > RUN_ID_MAX_LENGTH or not all(
            char.isascii() and (char.isalnum() or char in "._-") for char in run_id
        ):
            raise config_error(
                f"{where}.run_id",
                f"must be 1-{RUN_ID_MAX_LENGTH} letters, digits, '.', '_' or '-', got {run_id!r}",
                'write e.g. "bengali-bert"',
            )
        check_int(f"{where}.target_batch_size", self.target_batch_size, minimum=1)
        check_int(f"{where}.batch_size_per_step", self.batch_size_per_step, minimum=1)
        if self.batch_size_per_step > self.target_batch_size:
            raise config_error(
                f"{where}.batch_size_per_step",
                f"({self.batch_size_per_step}) must not exceed target_batch_size"
                f" ({self.target_batch_size})",
                "lower batch_size_per_step, or raise target_batch_size for everyone",
            )
        if self.target_group_size is not None:
            check_int(
                f"{where}.target_group_size",
                self.target_group_size,
                minimum=2,
                hint="use 2 or more, or null for no limit",
            )
        for name in ("matchmaking_time", "averaging_timeout", "load_state_timeout"):
            value = getattr(self, name)
            if value == "auto" and name != "load_state_timeout":
                continue
            hint = 'write a number of seconds, or "auto"' if name != "load_state_timeout" else ""
            store_normalized(self, name, check_number(f"{where}.{name}", value, above=0, hint=hint))
        matchmaking, timeout = self.matchmaking_time, self.averaging_timeout
        if isinstance(matchmaking, float) and isinstance(timeout, float) and matchmaking >= timeout:
            raise config_error(
                f"{where}.averaging_timeout",
                f"({self.averaging_timeout}) must exceed matchmaking_time ({self.matchmaking_time})",
                "a round includes its matchmaking: use at least 2x matchmaking_time",
            )
        check_int(f"{where}.average_state_every", self.average_state_every, minimum=0)
        check_choice(f"{where}.grad_compression", self.grad_compression, COMPRESSIONS)
        check_choice(f"{where}.state_compression", self.state_compression, COMPRESSIONS)
        check_int(f"{where}.size_adaptive_threshold", self.size_adaptive_threshold, minimum=1)
        for name in (
            "delay_optimizer_step",
            "delay_grad_averaging",
            "use_local_updates",
            "reuse_grad_buffers",
            "offload_optimizer",
        ):
            check_bool(f"{where}.{name}", getattr(self, name))
        if self.delay_grad_averaging and not self.delay_optimizer_step:
            raise config_error(
                f"{where}.delay_grad_averaging",
                "runs the optimizer step in the background too",
                "also set delay_optimizer_step: true",
            )
        if self.use_local_updates:
            for name in ("reuse_grad_buffers", "delay_optimizer_step", "offload_optimizer"):
                if getattr(self, name):
                    raise config_error(
                        f"{where}.use_local_updates",
                        f"steps on every local gradient, so {name} does not apply",
                        f"set {name}: false, or use_local_updates: false",
                    )
        check_choice(f"{where}.robust_aggregation", self.robust_aggregation, ROBUST_AGGREGATIONS)
        if self.clip_tau is not None:
            store_normalized(
                self,
                "clip_tau",
                check_number(
                    f"{where}.clip_tau", self.clip_tau, above=0, hint="or null for the median"
                ),
            )

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], where: str = "collaboration"
    ) -> CollaborationConfig:
        """Build from the ``collaboration:`` mapping of a run configuration (raises ConfigError)."""
        return cls(**_check_keys(cls, data, where))

    def to_dict(self) -> dict[str, Any]:
        """Plain dict that ``from_dict`` reads back."""
        return _to_plain(self)


# --- Training Transformers Together's recipe (recipes.md §4.3-4.6), for any model --------------

#: sahajBERT's optimizer (recipes.md §3.1): OptimizerConfig's defaults, spelled out for recipes.
SAHAJBERT_OPTIMIZER: dict[str, Any] = dict(
    name="lamb",
    lr=0.00176,
    betas=(0.9, 0.999),
    eps=1e-6,
    weight_decay=0.01,
    lamb_clamp_value=10_000.0,
    lamb_debias=True,
    clip_grad_norm=1.0,
    max_grad_norm=None,
    warmup_steps=5_000,
    total_steps=1_000_000,
    schedule="linear",
)
#: sahajBERT's collaboration (recipes.md §3.4: README trainer; matchmaking as TTT's, 15 s).
SAHAJBERT_COLLABORATION: dict[str, Any] = dict(
    target_batch_size=4_096,
    target_group_size=256,
    matchmaking_time=15.0,
    averaging_timeout=120.0,
    grad_compression="fp16",
    state_compression="fp16",
    delay_optimizer_step=False,
    delay_grad_averaging=False,
    use_local_updates=False,
    reuse_grad_buffers=False,
    offload_optimizer=False,
)
#: TTT's 8-bit LAMB (dalle-hivemind ``task.py``/``arguments.py``, demo settings of 2021-12-06).
TTT_OPTIMIZER: dict[str, Any] = dict(
    name="lamb8bit",
    lr=0.0025,
    betas=(0.9, 0.96),
    eps=1e-6,
    weight_decay=0.045,
    lamb_clamp_value=10_000.0,
    lamb_debias=False,
    clip_grad_norm=None,
    max_grad_norm=4.0,
    warmup_steps=3_125,
    total_steps=31_250,
    schedule="linear",
)
#: TTT's hivemind.Optimizer arguments (size-adaptive codecs: fp16 below 2**16 + 1 elements).
TTT_COLLABORATION: dict[str, Any] = dict(
    target_batch_size=4_096,
    matchmaking_time=15.0,
    averaging_timeout=180.0,
    grad_compression="size_adaptive",
    state_compression="size_adaptive",
    size_adaptive_threshold=65_537,
    delay_optimizer_step=True,
    delay_grad_averaging=False,
    reuse_grad_buffers=True,
    offload_optimizer=True,
)


def ttt_optimizer(**changes: Any) -> OptimizerConfig:
    """Training Transformers Together's optimizer for any model (recipes.md §4.3, §4.5).

    8-bit LAMB (bitsandbytes blockwise statistics, offloaded to the CPU by
    :func:`ttt_collaboration`), lr 0.0025, betas (0.9, 0.96), eps 1e-6, weight decay 0.045 (not on
    biases and LayerNorm weights), no bias correction (LAMB v3), the averaged gradient clipped to
    4.0 inside the step (no local clipping), linear schedule: 3,125 warmup and 31,250 total global
    steps. ``changes`` override single fields, e.g. ``ttt_optimizer(lr=0.001)``.
    """
    return OptimizerConfig(**{**TTT_OPTIMIZER, **changes})


def ttt_collaboration(**changes: Any) -> CollaborationConfig:
    """Training Transformers Together's collaboration settings (recipes.md §4.3, §4.4, §4.6).

    4096 samples per global step, matchmaking 15 s, averaging timeout 180 s, size-adaptive codecs
    for gradients and state (fp16 below 65,537 elements, uniform 8-bit from there on), optimizer
    statistics offloaded to the CPU, the optimizer step in a background thread one batch late
    (``delay_optimizer_step``; gradient averaging stays synchronous), and gradients accumulated
    in ``.grad`` (``reuse_grad_buffers``). Give it your ``run_id``: ``ttt_collaboration(run_id=...)``.
    """
    return CollaborationConfig(**{**TTT_COLLABORATION, **changes})
