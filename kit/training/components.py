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

from kit.averaging.compression import (
    BlockwiseQuantization,
    CompressionBase,
    Float16Compression,
    NoCompression,
    Quantile8BitQuantization,
    ScaledFloat16Compression,
    SizeAdaptiveCompression,
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


def build_inner_optimizer(params: Any, config: OptimizerConfig) -> torch.optim.Optimizer:
    """The local optimizer of ``config`` over ``params`` (groups keep their own weight decay)."""
    if config.name == "lamb":
        return Lamb(
            params,
            lr=config.lr,
            betas=config.betas,
            eps=config.eps,
            weight_decay=config.weight_decay,
            clamp_value=config.lamb_clamp_value,
        )
    if config.name == "adamw":
        return torch.optim.AdamW(
            params,
            lr=config.lr,
            betas=config.betas,
            eps=config.eps,
            weight_decay=config.weight_decay,
        )
    raise ConfigError(f"unknown optimizer {config.name!r} - help: use lamb or adamw")


def build_scheduler(optimizer: torch.optim.Optimizer, config: OptimizerConfig) -> Any:
    """Linear warmup, then linear decay to 0 at ``total_steps`` (or flat): one step per epoch."""
    warmup, total = config.warmup_steps, config.total_steps
    constant = config.schedule == "constant"

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if constant:
            return 1.0
        return max(0.0, (total - step) / max(1, total - warmup))

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
        **overrides: other ``kit.Optimizer`` arguments (tests, benchmarks).
    """
    from kit.optim.optimizer import Optimizer

    collab: CollaborationConfig = config.collaboration
    groups = parameter_groups(model, config.optimizer.weight_decay)
    arguments: dict[str, Any] = dict(
        dht=dht,
        run_id=collab.run_id,
        target_batch_size=collab.target_batch_size,
        batch_size_per_step=batch_size_per_step,
        optimizer=lambda params: build_inner_optimizer(params, config.optimizer),
        params=groups,
        scheduler=lambda opt: build_scheduler(opt, config.optimizer),
        matchmaking_time=collab.matchmaking_time,
        averaging_timeout=collab.averaging_timeout,
        load_state_timeout=collab.load_state_timeout,
        average_state_every=collab.average_state_every,
        client_mode=client_mode,
        auxiliary=auxiliary,
        grad_compression=codec(collab.grad_compression, collab.size_adaptive_threshold),
        state_averaging_compression=codec(collab.state_compression, collab.size_adaptive_threshold),
    )
    arguments.update(overrides)
    return Optimizer(**arguments)
