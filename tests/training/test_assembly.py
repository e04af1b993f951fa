"""Each branch of the hardware plan against what the volunteer really builds from it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kit
from kit.config import RunConfig
from kit.hardware import GPU, Hardware, TrainingPlan, estimate_memory, needs_from_model
from kit.hardware.detect import CUDA_CONTEXT_BYTES, MIN_USEFUL_MICRO_BATCH
from kit.hardware.memory import optimizer_state_bytes
from kit.training import assembly
from kit.training.assembly import build_training, plan_training
from kit.training.components import build_inner_optimizer, build_model, parameter_groups
from kit.training.trainer import Trainer
from tests.training.test_trainer import random_batches, tiny_config

GIB = 1024**3


def on_cpu(plan: TrainingPlan) -> TrainingPlan:
    """The same choices, built on this machine's CPU (there is no GPU here)."""
    return dataclasses.replace(plan, device="cpu", devices=tuple("cpu" for _ in plan.devices))


def t4s(count: int, memory: int = 15 * GIB) -> Hardware:
    gpus = tuple(GPU("Tesla T4", memory, (7, 5), index, True) for index in range(count))
    return Hardware(gpus=gpus, cpu_cores=2, ram_bytes=13 * GIB, bitsandbytes=True)


def short_gpu_memory(config: RunConfig) -> int:
    """A GPU on which MIN_USEFUL_MICRO_BATCH samples fit with 8-bit statistics, not without."""
    needs = needs_from_model(
        build_model(config),
        sequence_length=config.data.max_seq_length,
        batch_size_per_step=config.collaboration.batch_size_per_step,
    )
    fp32 = estimate_memory(needs, MIN_USEFUL_MICRO_BATCH, precision="fp16").device_bytes
    eight = estimate_memory(
        needs, MIN_USEFUL_MICRO_BATCH, precision="fp16", optimizer_8bit=True
    ).device_bytes
    assert eight < fp32
    budget = (fp32 + eight) / 2
    return int((budget + CUDA_CONTEXT_BYTES) / 0.9)


@pytest.fixture
def dht():
    node = kit.DHT(host="127.0.0.1", client_mode=False)
    yield node
    node.shutdown()


def config_with_batch(batch: int) -> RunConfig:
    config = tiny_config()
    return dataclasses.replace(
        config,
        collaboration=dataclasses.replace(
            config.collaboration, batch_size_per_step=batch, target_batch_size=64
        ),
    )


@pytest.mark.sockets
def test_the_8bit_branch_builds_the_8bit_lamb(dht, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("bitsandbytes")
    config = config_with_batch(8)
    hw = t4s(1, short_gpu_memory(config))
    _, plan = plan_training(config, hw, probe=False)
    assert plan.optimizer_8bit and not plan.offload_optimizer
    parts = build_training(config, on_cpu(plan), build_model(config), dht)
    try:
        assert parts.inner_optimizer == "lamb8bit"
        assert type(parts.optimizer.opt).__name__ == "Lamb8bit"
        assert not parts.optimizer.exact_steps  # an 8-bit peer in an fp32 LAMB run drifts
        assert not parts.offload_optimizer and not parts.checkpointing
    finally:
        parts.optimizer.shutdown()
    # Where kit's 8-bit LAMB would not import, the plan never chooses it.
    monkeypatch.setattr(assembly, "eight_bit_available", lambda: False)
    _, without = plan_training(config, hw, probe=False)
    assert not without.optimizer_8bit
    assert without.offload_optimizer  # the next saver took over


@pytest.mark.sockets
def test_the_offload_branch_steps_cpu_copies(dht) -> None:
    config = config_with_batch(8)
    plan = TrainingPlan(micro_batch=2, accumulation_steps=4, offload_optimizer=True)
    parts = build_training(config, plan, build_model(config), dht)
    try:
        assert parts.offload_optimizer and parts.inner_optimizer == "lamb"
        masters = [p for group in parts.optimizer.opt.param_groups for p in group["params"]]
        model_params = list(parts.model.parameters())
        assert all(m is not p for m, p in zip(masters, model_params, strict=True))
        assert all(m.device.type == "cpu" and m.dtype == torch.float32 for m in masters)
    finally:
        parts.optimizer.shutdown()


@pytest.mark.sockets
def test_the_checkpointing_branch_wraps_albert(dht) -> None:
    config = config_with_batch(8)
    plan = TrainingPlan(micro_batch=2, accumulation_steps=4, gradient_checkpointing=True)
    parts = build_training(config, plan, build_model(config), dht)
    try:
        assert parts.checkpointing
        groups = parts.model.albert.encoder.albert_layer_groups
        assert all(getattr(group, "_kit_checkpointed", False) for group in groups)
    finally:
        parts.optimizer.shutdown()
    # And the planner may choose it for ALBERT now (kit's own wrapper), where transformers refuses.
    model, _ = plan_training(config, Hardware(cpu_cores=2, ram_bytes=8 * GIB))
    assert not getattr(model, "supports_gradient_checkpointing", False)
    needs = needs_from_model(
        model, sequence_length=128, batch_size_per_step=8, supports_checkpointing=True
    )
    assert needs.supports_checkpointing


@pytest.mark.sockets
def test_two_gpus_are_one_peer_with_two_replicas_counting_samples_once(dht) -> None:
    config = config_with_batch(8)
    _, plan = plan_training(config, t4s(2), probe=False)
    assert plan.devices == ("cuda:0", "cuda:1") and plan.replicas == 2
    assert any("2 × Tesla T4" in reason for reason in plan.reasons)
    assert plan.batch_size_per_step >= 8
    assert plan.micro_batch * plan.accumulation_steps * 2 == plan.batch_size_per_step
    cpu_plan = on_cpu(plan)
    parts = build_training(config, cpu_plan, build_model(config), dht)
    trainer = Trainer(
        parts.model,
        parts.optimizer,
        random_batches(cpu_plan.micro_batch),
        cpu_plan,
        clip_grad_norm=config.optimizer.clip_grad_norm,
        replicas=parts.replicas,
    )
    try:
        assert len(parts.replicas) == 2
        trainer.run(max_steps=2)
    finally:
        parts.optimizer.shutdown()
    assert trainer.local_steps == 2
    assert trainer.samples_total == 2 * cpu_plan.batch_size_per_step
    assert parts.optimizer.tracker.local.samples_per_second >= 0
    assert all(torch.isfinite(p).all() for p in parts.model.parameters())


@pytest.mark.sockets
def test_the_auxiliary_branch_builds_no_training(dht) -> None:
    config = config_with_batch(8)
    parts = build_training(config, TrainingPlan(auxiliary=True), build_model(config), dht)
    try:
        assert parts.optimizer.auxiliary and not parts.offload_optimizer
    finally:
        parts.optimizer.shutdown()


@pytest.mark.parametrize("name", ["lamb", "lamb8bit"])
def test_optimizer_state_memory_matches_the_estimate_for_albert_large(name: str) -> None:
    if name == "lamb8bit":
        pytest.importorskip("bitsandbytes")
    config = RunConfig.sahajbert()
    model = build_model(config)  # ALBERT-large, ~18M parameters, on the CPU
    needs = needs_from_model(model, sequence_length=512, batch_size_per_step=8, optimizer=name)
    optimizer = build_inner_optimizer(
        parameter_groups(model, config.optimizer.weight_decay), config.optimizer, name=name
    )
    generator = torch.Generator().manual_seed(0)
    for param in model.parameters():
        param.grad = torch.randn(param.shape, generator=generator) * 1e-3
    optimizer.step()  # creates every statistic
    allocated = optimizer_state_bytes(optimizer)
    estimated = estimate_memory(needs, 1, optimizer_8bit=name == "lamb8bit").optimizer
    assert abs(allocated - estimated) <= 0.2 * allocated, (allocated, estimated)
