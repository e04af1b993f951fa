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
import importlib.util
import logging
from typing import Any

import torch

from kit.config import RunConfig
from kit.errors import ConfigError
from kit.hardware import Hardware, TrainingPlan, make_torch_probe, needs_from_model
from kit.hardware import plan as make_plan
from kit.hardware.memory import supports_gradient_checkpointing
from kit.training.albert_speed import (
    compile_layers,
    prepare_batch,
    pretraining_loss,
    speed_up,
    uses_sdpa,
)
from kit.training.checkpointing import enable_checkpointing, supports_kit_checkpointing
from kit.training.components import (
    build_collaborative_optimizer,
    build_model,
    eight_bit_available,
)
from kit.training.replicas import Replicas

logger = logging.getLogger(__name__)

#: Seconds a CPU volunteer's plan may spend measuring the speed of micro-batches.
CPU_SPEED_PROBE_SECONDS = 5.0


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
    never promises 8-bit statistics that would not be built. ``probe``: measure what training
    really takes (``kit.hardware.make_torch_probe``, with the training loss on synthetic
    batches): on a CUDA GPU the memory of one forward/backward and the speed of each
    micro-batch that fits; on a CPU the speed (for at most a few seconds).
    """
    model = build_model(config)
    needs = needs_from_model(
        model,
        sequence_length=config.data.max_seq_length,
        batch_size_per_step=config.collaboration.batch_size_per_step,
        optimizer=config.optimizer.name,
        supports_checkpointing=supports_kit_checkpointing(model)
        or supports_gradient_checkpointing(model),
        target_batch_size=config.collaboration.target_batch_size,
    )
    if hardware.bitsandbytes and not eight_bit_available():
        logger.info("bitsandbytes is installed but does not import: no 8-bit optimizer")
        hardware = dataclasses.replace(hardware, bitsandbytes=False)
    cuda = bool(hardware.gpus) and torch.cuda.is_available()
    cpu = not hardware.gpus and not hardware.mps
    measure = None
    if probe and (cuda or cpu):
        generator = torch.Generator().manual_seed(0)
        measure = make_torch_probe(
            lambda: build_fast_model(config),
            needs,
            "cuda" if cuda else "cpu",
            batch=lambda size: synthetic_batch(config, size, generator),
            loss=training_loss,
        )
        if cpu:  # a CPU volunteer joins a few seconds later at most
            measure.time_budget = CPU_SPEED_PROBE_SECONDS
    try:
        result = make_plan(
            needs,
            hardware,
            probe=measure if cuda else None,
            speed=measure.samples_per_second if measure is not None else None,
            **plan_options,
        )
    finally:
        if measure is not None:
            measure.close()
    return model, result


def compiles_here(plan: TrainingPlan) -> bool:
    """``model.compile`` applies on CUDA GPUs with Triton (torch.compile's GPU code generator),
    where it pays; elsewhere compiling costs more start-up than it saves."""
    return plan.device.startswith("cuda") and importlib.util.find_spec("triton") is not None


def build_fast_model(config: RunConfig) -> torch.nn.Module:
    """The run's model with :func:`kit.training.albert_speed.speed_up` applied."""
    model = build_model(config)
    speed_up(model)
    return model


def training_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], device: Any) -> Any:
    """ALBERT's pretraining loss at the GPU's speed (``kit.training.albert_speed``): the batch
    goes to ``device`` without a synchronisation, the MLM head runs at masked positions only."""
    prepared = prepare_batch(batch, device, sdpa=uses_sdpa(model))
    return pretraining_loss(model, prepared)


def synthetic_batch(
    config: RunConfig, size: int, generator: torch.Generator, *, mask_fraction: float = 0.15
) -> dict[str, torch.Tensor]:
    """A pretraining batch of random tokens shaped as the run's (``size`` x max_seq_length, a
    ``mask_fraction`` of positions labelled), on the CPU: what probes and benchmarks train on."""
    shape = (size, config.data.max_seq_length)
    vocab = config.model.vocab_size
    input_ids = torch.randint(5, vocab, shape, generator=generator)
    labelled = torch.rand(shape, generator=generator) < mask_fraction
    labelled[:, 1] = True  # every row predicts something
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "token_type_ids": torch.zeros_like(input_ids),
        "labels": torch.where(labelled, input_ids, torch.full_like(input_ids, -100)),
        "sentence_order_label": torch.randint(0, 2, (size,), generator=generator),
    }


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
    for line in speed_up(model):
        logger.info("model: %s", line)
    model = model.to(plan.device)
    replicas = Replicas(model, plan.devices or (plan.device,), loss=training_loss)
    compiled = config.model.compile and compiles_here(plan)
    for replica in replicas.models if compiled else ():
        for line in compile_layers(replica):
            logger.info("model: %s", line)
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
