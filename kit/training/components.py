"""Build what a run trains from its ``RunConfig``: the model, the inner optimizer, the schedule,
the wire codecs, and the ``kit.Optimizer`` that ties them to the collaboration.

Every peer (volunteer, coordinator's auxiliary peer, demo) builds these the same way, so that the
same run.yaml gives the same parameter layout and the same initial weights everywhere (the model
is seeded by ``model.init_seed``: a fresh collaboration starts identical on every peer). It holds
no training loop (``trainer.py``) and no I/O.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from kit.averaging.adaptive_compression import SizeAdaptiveCompression
from kit.averaging.compression import (
    BlockwiseQuantization,
    CompressionBase,
    Float16Compression,
    NoCompression,
    Quantile8BitQuantization,
    ScaledFloat16Compression,
    Uniform8BitQuantization,
)
from kit.config import RunConfig
from kit.config.training import CollaborationConfig, OptimizerConfig
from kit.errors import ConfigError
from kit.training.lamb import Lamb

logger = logging.getLogger(__name__)

#: Parameter names that never decay (BERT/ALBERT convention: biases and LayerNorm weights).
NO_DECAY = ("bias", "LayerNorm.weight", "LayerNorm.bias", "layer_norm")


def build_model(config: RunConfig) -> Any:
    """A fresh ``AlbertForPreTraining`` with the run's seeded initial weights (on the CPU)."""
    from transformers import AlbertForPreTraining

    fork = torch.random.fork_rng(devices=[])
    with fork:
        torch.manual_seed(config.model.init_seed)
        model = AlbertForPreTraining(config.model.to_transformers())
    return model


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two groups: decayed weights and non-decayed biases/norms (same order on every peer)."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if any(part in name for part in NO_DECAY) else decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


#: Where the bitsandbytes LAMB comes from, for the error message when it is missing.
BITSANDBYTES_HINT = (
    "pip install 'bitsandbytes>=0.45' (CUDA GPUs and, since 0.45, the CPU), or use optimizer.name: "
    "lamb (8 bytes of statistics per parameter instead of ~2)"
)


def eight_bit_available() -> bool:
    """Whether :class:`~kit.training.lamb8bit.Lamb8bit` can be built here (bitsandbytes imports)."""
    try:
        import kit.training.lamb8bit  # noqa: F401
    except Exception:  # ImportError, or a broken CUDA set-up inside bitsandbytes' import
        return False
    return True


def lamb_arguments(config: OptimizerConfig) -> dict[str, Any]:
    """The ``optimizer:`` section as the keyword arguments of kit's LAMB (``torch_optimizer.Lamb``
    takes the same ones, but ``max_grad_norm``)."""
    return dict(
        lr=config.lr,
        betas=config.betas,
        eps=config.eps,
        weight_decay=config.weight_decay,
        clamp_value=config.lamb_clamp_value,
        debias=config.lamb_debias,
        max_grad_norm=config.max_grad_norm,
    )


def build_inner_optimizer(
    params: Any, config: OptimizerConfig, *, name: str | None = None
) -> torch.optim.Optimizer:
    """The local optimizer of ``config`` over ``params`` (groups keep their own weight decay).

    Args:
        params: parameters or groups (:func:`parameter_groups`).
        config: the ``optimizer:`` section.
        name: build this optimizer instead of ``config.name`` (a peer's plan chose 8-bit
            statistics for a ``lamb`` run: ``"lamb8bit"``).

    Raises:
        ConfigError: an unknown name, or ``lamb8bit`` without bitsandbytes.
    """
    name = name or config.name
    lamb = lamb_arguments(config)
    if name == "lamb":
        return Lamb(params, **lamb)
    if name == "lamb8bit":
        try:
            from kit.training.lamb8bit import Lamb8bit
        except ImportError as error:
            raise ConfigError(
                f"optimizer lamb8bit needs bitsandbytes ({error}) - help: {BITSANDBYTES_HINT}"
            ) from None
        return Lamb8bit(params, **lamb)
    if name == "adamw":
        optimizer = torch.optim.AdamW(
            params,
            lr=config.lr,
            betas=config.betas,
            eps=config.eps,
            weight_decay=config.weight_decay,
        )
        if config.max_grad_norm is not None:
            raise ConfigError(
                "optimizer.max_grad_norm clips inside LAMB's step; AdamW has no such option - "
                "help: use clip_grad_norm (local gradients), or optimizer.name: lamb"
            )
        return optimizer
    raise ConfigError(f"unknown optimizer {name!r} - help: use lamb, lamb8bit or adamw")


def build_scheduler(optimizer: torch.optim.Optimizer, config: OptimizerConfig) -> Any:
    """The learning-rate schedule, stepped once per global step (epoch).

    ``"linear"`` is ``transformers.get_linear_schedule_with_warmup`` (sahajBERT's and TTT's):
    the factor is ``step / warmup`` during warmup (0 at the very first step), then falls
    linearly to 0 at ``total_steps``. ``"constant"`` is ``get_constant_schedule_with_warmup``.
    """
    warmup, total = config.warmup_steps, config.total_steps
    constant = config.schedule == "constant"

    def factor(step: int) -> float:
        if step < warmup:
            return float(step) / float(max(1, warmup))
        if constant:
            return 1.0
        return max(0.0, float(total - step) / float(max(1, total - warmup)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def codec(name: str, size_adaptive_threshold: int = 65_537) -> CompressionBase:
    """The wire codec named in run.yaml (``collaboration.grad_compression`` and friends)."""
    leaf: dict[str, type[CompressionBase]] = {
        "none": NoCompression,
        "fp16": Float16Compression,
        "scaledfp16": ScaledFloat16Compression,
        "uniform8bit": Uniform8BitQuantization,
        "quantile8bit": Quantile8BitQuantization,
        "blockwise8bit": BlockwiseQuantization,
    }
    if name in leaf:
        return leaf[name]()
    if name == "size_adaptive":
        return SizeAdaptiveCompression(
            size_adaptive_threshold,
            less=Float16Compression(),
            greater_equal=Uniform8BitQuantization(),
        )
    raise ConfigError(
        f"unknown compression {name!r} - help: use one of none, fp16, uniform8bit, ..."
    )


def build_collaborative_optimizer(
    model: torch.nn.Module,
    config: RunConfig,
    dht: Any,
    *,
    batch_size_per_step: int | None,
    client_mode: bool | None = None,
    auxiliary: bool = False,
    inner_optimizer: str | None = None,
    **overrides: Any,
) -> Any:
    """``kit.Optimizer`` for ``model`` with every setting taken from ``config``.

    Args:
        model: the model (already on its device).
        config: the run.
        dht: the running ``kit.DHT`` of this peer.
        batch_size_per_step: samples per local ``step()`` (the hardware plan's).
        client_mode: None = as the DHT's peer.
        auxiliary: a helper peer without gradients.
        inner_optimizer: the local optimizer's name when this peer's plan chose another than
            ``optimizer.name`` (``"lamb8bit"``: 8-bit statistics in a ``lamb`` run); its steps
            then differ slightly from the others', so the optimizer flags itself drifted after
            every round and parameter averaging keeps it in line.
        **overrides: other ``kit.Optimizer`` arguments (the plan's ``offload_optimizer``, tests).
    """
    from kit.optim.optimizer import Optimizer

    collab: CollaborationConfig = config.collaboration
    groups = parameter_groups(model, config.optimizer.weight_decay)
    local = inner_optimizer or config.optimizer.name
    arguments: dict[str, Any] = dict(
        dht=dht,
        run_id=collab.run_id,
        target_batch_size=collab.target_batch_size,
        batch_size_per_step=batch_size_per_step,
        optimizer=lambda params: build_inner_optimizer(params, config.optimizer, name=local),
        params=groups,
        scheduler=lambda opt: build_scheduler(opt, config.optimizer),
        matchmaking_time=collab.matchmaking_time,
        averaging_timeout=collab.averaging_timeout,
        target_group_size=collab.target_group_size,
        load_state_timeout=collab.load_state_timeout,
        average_state_every=collab.average_state_every,
        # Peers of one run may keep 8-bit statistics (lamb8bit) or 32-bit ones: what the
        # parameter rounds average must be the same on every peer, so the parameters only.
        average_opt_statistics=(),
        client_mode=client_mode,
        auxiliary=auxiliary,
        grad_compression=codec(collab.grad_compression, collab.size_adaptive_threshold),
        state_averaging_compression=codec(collab.state_compression, collab.size_adaptive_threshold),
        averager_opts=dict(
            target_group_size=collab.target_group_size,
            robust_aggregation=collab.robust_aggregation,
            clip_tau=collab.clip_tau,
        ),
    )
    if not auxiliary:  # an auxiliary peer has no gradients and takes no optimizer steps
        arguments.update(
            delay_optimizer_step=collab.delay_optimizer_step,
            delay_grad_averaging=collab.delay_grad_averaging,
            use_local_updates=collab.use_local_updates,
            reuse_grad_buffers=collab.reuse_grad_buffers,
            offload_optimizer=collab.offload_optimizer,
        )
    arguments.update(overrides)
    optimizer = Optimizer(**arguments)
    optimizer.exact_steps = local == config.optimizer.name
    return optimizer
