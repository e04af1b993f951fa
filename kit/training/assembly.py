"""What a volunteer builds from its hardware plan: every choice of the plan, really applied.

Holds :func:`plan_training` (the model and the ``kit.hardware`` plan for it, with what kit can
build on this machine: its own ALBERT checkpointing, and 8-bit statistics only where bitsandbytes
imports) and :func:`build_training` (the trainer's parts as the plan says: gradient
checkpointing, a replica per GPU, the 8-bit LAMB, the optimizer offloaded to the CPU).
``tests/training/test_assembly.py`` checks each branch of the plan against what is built. It
holds no loop (``trainer``) and no network set-up (``kit.volunteer``).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from kit.config import RunConfig
from kit.errors import ConfigError
from kit.hardware import Hardware, TrainingPlan, make_torch_probe, needs_from_model
from kit.hardware import plan as make_plan
from kit.hardware.memory import supports_gradient_checkpointing
from kit.training.checkpointing import enable_checkpointing, supports_kit_checkpointing
from kit.training.components import (
    build_collaborative_optimizer,
    build_model,
    eight_bit_available,
)
from kit.training.replicas import Replicas

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class LocalTraining:
    """The parts a volunteer trains with, as built from its plan."""

    model: torch.nn.Module  # the main model on plan.device (checkpointed if the plan says so)
    replicas: Replicas  # the main model plus a copy per further GPU
    optimizer: Any  # the kit.Optimizer
    inner_optimizer: str  # the local optimizer's name ("lamb8bit" when the plan chose 8-bit)
    offload_optimizer: bool  # the optimizer steps float32 CPU copies
    checkpointing: bool  # ALBERT's layer groups recompute their activations in backward


def plan_training(
    config: RunConfig, hardware: Hardware, *, probe: bool = True, **plan_options: Any
) -> tuple[torch.nn.Module, TrainingPlan]:
    """Build the run's model (on the CPU) and plan how this machine trains it.

    ``hardware.bitsandbytes`` is kept only if kit's 8-bit LAMB really imports here, so the plan
    never promises 8-bit statistics that would not be built. ``probe``: measure the memory of
    one forward/backward on a CUDA GPU (see ``kit.hardware.make_torch_probe``).
    """
    model = build_model(config)
    needs = needs_from_model(
        model,
        sequence_length=config.data.max_seq_length,
        batch_size_per_step=config.collaboration.batch_size_per_step,
        optimizer=config.optimizer.name,
        supports_checkpointing=supports_kit_checkpointing(model)
        or supports_gradient_checkpointing(model),
    )
    if hardware.bitsandbytes and not eight_bit_available():
        logger.info("bitsandbytes is installed but does not import: no 8-bit optimizer")
        hardware = dataclasses.replace(hardware, bitsandbytes=False)
    measure = None
    if probe and hardware.gpus and torch.cuda.is_available():
        measure = make_torch_probe(lambda: build_model(config), needs, "cuda")
    try:
        result = make_plan(needs, hardware, probe=measure, **plan_options)
    finally:
        if measure is not None:
            measure.close()
    return model, result


def build_training(
    config: RunConfig,
    plan: TrainingPlan,
    model: torch.nn.Module,
    dht: Any,
    *,
    client_mode: bool | None = None,
    **optimizer_options: Any,
) -> LocalTraining:
    """Apply every choice of ``plan`` to ``model`` and build the ``kit.Optimizer`` for it.

    Args:
        config: the run.
        plan: this machine's plan (``plan_training``).
        model: the run's model, on the CPU (moved to ``plan.device`` here).
        dht: the running ``kit.DHT`` of this peer.
        client_mode: None = as the DHT's peer.
        **optimizer_options: further ``kit.Optimizer`` arguments (tests).

    Raises:
        ConfigError: the plan asks for something this model or machine cannot do.
    """
    checkpointing = False
    if plan.gradient_checkpointing:
        if enable_checkpointing(model):
            checkpointing = True
        elif supports_gradient_checkpointing(model):
            model.gradient_checkpointing_enable()  # type: ignore[operator]
            checkpointing = True
        else:
            raise ConfigError(
                "the plan asks for gradient checkpointing, which this model does not support - "
                "help: lower collaboration.batch_size_per_step or data.max_seq_length"
            )
    model = model.to(plan.device)
    replicas = Replicas(model, plan.devices or (plan.device,))
    inner = config.optimizer.name
    if plan.optimizer_8bit and inner == "lamb":
        inner = "lamb8bit"  # the plan's memory saver: the same LAMB with 8-bit statistics
    collab = config.collaboration
    offload = not plan.auxiliary and (
        collab.offload_optimizer or (plan.offload_optimizer and not collab.use_local_updates)
    )
    options: dict[str, Any] = dict(optimizer_options)
    if not plan.auxiliary:
        options.setdefault("offload_optimizer", offload)
    optimizer = build_collaborative_optimizer(
        model,
        config,
        dht,
        batch_size_per_step=plan.batch_size_per_step or None,
        client_mode=client_mode,
        auxiliary=plan.auxiliary,
        inner_optimizer=inner,
        **options,
    )
    return LocalTraining(
        model=model,
        replicas=replicas,
        optimizer=optimizer,
        inner_optimizer=inner,
        offload_optimizer=bool(options.get("offload_optimizer", False)),
        checkpointing=checkpointing,
    )
