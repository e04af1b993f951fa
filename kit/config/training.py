"""The ``optimizer:`` and ``collaboration:`` sections: how each peer steps, and how peers average.

Holds ``OptimizerConfig`` (LAMB or AdamW, learning-rate schedule, clipping) and
``CollaborationConfig`` (the hivemind.Optimizer settings: run id, global batch, matchmaking and
averaging timeouts, wire compression by name). Defaults are sahajBERT's (DeDLOC, Diskin et al.
2021, §4.2 and its ``arguments.py``). It doesn't build optimizers or codecs (no torch here):
``kit.optim`` and ``kit.averaging.compression`` turn these names into objects.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from kit.config.fields import (
    _as_tuple,
    _check_keys,
    _to_plain,
    check_choice,
    check_int,
    check_number,
    check_text,
    config_error,
    store_normalized,
)

OPTIMIZERS = ("lamb", "adamw")
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
    name: str = "lamb"  # "lamb" (You et al. 2020; keeps large global batches stable) or "adamw"
    lr: float = 0.00176  # peak learning rate; lower it if the loss spikes or turns NaN after warmup
    betas: tuple[float, float] = (0.9, 0.999)  # Adam moment decay rates (beta1, beta2)
    eps: float = 1e-6  # added to the denominator; raise it (1e-4) if fp16 steps turn NaN
    weight_decay: float = 0.01  # decoupled decay; biases and LayerNorm weights never decay
    lamb_clamp_value: float = 10_000.0  # LAMB clamps the weight norm of its trust ratio to this
    clip_grad_norm: float | None = 1.0  # clip local gradients to this L2 norm; null = no clipping
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
    target_group_size: int | None = 256  # largest averaging group; null = everyone ready at once
    matchmaking_time: float = 15.0  # seconds to gather a group; raise it if you see groups of 1 peer
    averaging_timeout: float = 120.0  # one averaging round's limit; raise it if rounds time out on slow links
    load_state_timeout: float = 600.0  # limit of a state download from peers; raise it on a slow link
    average_state_every: int = 1  # average parameters every N global steps (0 = never); fixes drift
    grad_compression: str = "fp16"  # codec of averaged gradients; "uniform8bit" for slow uplinks
    state_compression: str = "fp16"  # codec of averaged parameters/optimizer state
    size_adaptive_threshold: int = 65_537  # "size_adaptive": tensors this large go uniform8bit
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
            store_normalized(
                self, name, check_number(f"{where}.{name}", getattr(self, name), above=0)
            )
        if self.matchmaking_time >= self.averaging_timeout:
            raise config_error(
                f"{where}.averaging_timeout",
                f"({self.averaging_timeout}) must exceed matchmaking_time ({self.matchmaking_time})",
                "a round includes its matchmaking: use at least 2x matchmaking_time",
            )
        check_int(f"{where}.average_state_every", self.average_state_every, minimum=0)
        check_choice(f"{where}.grad_compression", self.grad_compression, COMPRESSIONS)
        check_choice(f"{where}.state_compression", self.state_compression, COMPRESSIONS)
        check_int(f"{where}.size_adaptive_threshold", self.size_adaptive_threshold, minimum=1)

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], where: str = "collaboration"
    ) -> CollaborationConfig:
        """Build from the ``collaboration:`` mapping of a run configuration (raises ConfigError)."""
        return cls(**_check_keys(cls, data, where))

    def to_dict(self) -> dict[str, Any]:
        """Plain dict that ``from_dict`` reads back."""
        return _to_plain(self)
