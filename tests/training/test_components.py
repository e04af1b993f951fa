"""What ``kit.training.components`` builds from run.yaml: schedule, inner optimizer, kit.Optimizer."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kit
from kit.averaging.adaptive_compression import SizeAdaptiveCompression
from kit.averaging.compression import (
    Float16Compression,
    Uniform8BitQuantization,
)
from kit.config import CollaborationConfig, OptimizerConfig, RunConfig
from kit.config.training import ttt_collaboration, ttt_optimizer
from kit.errors import ConfigError
from kit.training.components import (
    build_collaborative_optimizer,
    build_inner_optimizer,
    build_model,
    build_scheduler,
)
from kit.training.lamb import Lamb


@pytest.mark.parametrize(
    ("warmup", "total"), [(5_000, 1_000_000), (3_125, 31_250), (0, 50), (7, 7)]
)
def test_the_linear_schedule_is_transformers_get_linear_schedule_with_warmup(
    warmup: int, total: int
) -> None:
    from transformers import get_linear_schedule_with_warmup

    def optimizer() -> torch.optim.Optimizer:
        return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.00176)

    config = OptimizerConfig(warmup_steps=warmup, total_steps=total)
    ours = build_scheduler(optimizer(), config)
    theirs = get_linear_schedule_with_warmup(optimizer(), warmup, total)
    steps = {*range(0, 30), warmup - 1, warmup, warmup + 1, total // 2, total - 1, total, total + 3}
    for step in sorted(s for s in steps if s >= 0):
        assert ours.lr_lambdas[0](step) == theirs.lr_lambdas[0](step), step
    # And stepped as kit.Optimizer steps it (once per global step), the same learning rates.
    for _ in range(12):
        assert ours.optimizer.param_groups[0]["lr"] == theirs.optimizer.param_groups[0]["lr"]
        ours.optimizer.step()
        theirs.optimizer.step()
        ours.step()
        theirs.step()
    assert ours.lr_lambdas[0](0) == (0.0 if warmup else 1.0)  # step 0 of a warmup: lr 0


def test_the_constant_schedule_is_transformers_constant_schedule_with_warmup() -> None:
    from transformers import get_constant_schedule_with_warmup

    config = OptimizerConfig(warmup_steps=10, total_steps=100, schedule="constant")
    ours = build_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), config)
    theirs = get_constant_schedule_with_warmup(
        torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), 10
    )
    for step in range(200):
        assert ours.lr_lambdas[0](step) == theirs.lr_lambdas[0](step)


def test_inner_optimizers_by_name() -> None:
    params = [torch.nn.Parameter(torch.ones(3))]
    lamb = build_inner_optimizer(params, OptimizerConfig(lamb_debias=False, max_grad_norm=4.0))
    assert isinstance(lamb, Lamb) and lamb.max_grad_norm == 4.0
    assert lamb.param_groups[0]["debias"] is False
    assert lamb.param_groups[0]["clamp_value"] == 10_000.0
    assert isinstance(
        build_inner_optimizer(params, OptimizerConfig(name="adamw")), torch.optim.AdamW
    )
    with pytest.raises(ConfigError, match="help:"):
        build_inner_optimizer(params, OptimizerConfig(name="adamw", max_grad_norm=1.0))


def test_lamb8bit_is_a_bitsandbytes_optimizer() -> None:
    pytest.importorskip("bitsandbytes")
    from bitsandbytes.optim.optimizer import Optimizer8bit

    params = [torch.nn.Parameter(torch.ones(3))]
    optimizer = build_inner_optimizer(params, OptimizerConfig(name="lamb8bit"))
    assert isinstance(optimizer, Optimizer8bit)
    assert optimizer.param_groups[0]["debias"] is True  # the config's lamb_debias
    # A lamb run whose peer planned 8-bit statistics builds the same LAMB in 8 bits.
    planned = build_inner_optimizer(params, OptimizerConfig(), name="lamb8bit")
    assert isinstance(planned, Optimizer8bit)


def test_lamb8bit_without_bitsandbytes_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "kit.training.lamb8bit", None)  # import fails
    with pytest.raises(ConfigError, match="pip install 'bitsandbytes"):
        build_inner_optimizer([torch.nn.Parameter(torch.ones(3))], OptimizerConfig(name="lamb8bit"))


# --- kit.Optimizer from run.yaml ----------------------------------------------------------------


@pytest.fixture
def dht():
    node = kit.DHT(host="127.0.0.1", client_mode=False)
    yield node
    node.shutdown()


def small_config(**collaboration: object) -> RunConfig:
    config = RunConfig.tiny_demo(data_files=["unused/*.txt"])
    return dataclasses.replace(
        config,
        collaboration=dataclasses.replace(
            config.collaboration, matchmaking_time=0.5, averaging_timeout=5.0, **collaboration
        ),
    )


@pytest.mark.sockets
def test_every_collaboration_knob_of_run_yaml_reaches_kit_optimizer(dht) -> None:
    pytest.importorskip("bitsandbytes")
    base = small_config()
    config = dataclasses.replace(
        base,
        optimizer=ttt_optimizer(warmup_steps=5, total_steps=100),
        collaboration=ttt_collaboration(
            run_id="knobs",
            target_batch_size=64,
            batch_size_per_step=8,
            target_group_size=3,
            matchmaking_time=0.5,
            averaging_timeout=5.0,
            size_adaptive_threshold=1_000,
            robust_aggregation="centered_clip",
            clip_tau=2.5,
        ),
    )
    model = build_model(config)
    optimizer = build_collaborative_optimizer(model, config, dht, batch_size_per_step=8)
    try:
        assert optimizer.delay_optimizer_step and not optimizer.delay_grad_averaging
        assert optimizer.reuse_grad_buffers and not optimizer.use_local_updates
        # offload: the inner optimizer steps float32 CPU copies, not the model's parameters
        masters = [p for group in optimizer.opt.param_groups for p in group["params"]]
        assert all(m is not p for m, p in zip(masters, model.parameters(), strict=False))
        # the 8-bit LAMB, no debias, clipping at 4.0 inside the step
        assert type(optimizer.opt).__name__ == "Lamb8bit"
        assert optimizer.opt.max_grad_norm == 4.0
        assert all(group["debias"] is False for group in optimizer.param_groups)
        for averager in (optimizer.grad_averager, optimizer.state_averager):
            settings = averager.settings
            assert settings.robust_aggregation == "centered_clip" and settings.clip_tau == 2.5
            codec = settings.compression
            assert isinstance(codec, SizeAdaptiveCompression) and codec.threshold == 1_000
            assert isinstance(codec.less, Float16Compression)
            assert isinstance(codec.greater_equal, Uniform8BitQuantization)
            # target_group_size caps the groups the optimizer asks for
            assert settings.target_group_size == 3
            averager.set_target_group_size(10)
            assert averager._require().matchmaking.settings.target_group_size == 3
            averager.set_target_group_size(2)
            assert averager._require().matchmaking.settings.target_group_size == 2
        assert optimizer.exact_steps
    finally:
        optimizer.shutdown()


@pytest.mark.sockets
def test_local_updates_and_delayed_averaging_reach_kit_optimizer(dht) -> None:
    local = build_collaborative_optimizer(
        build_model(small_config()),
        small_config(run_id="local", use_local_updates=True),
        dht,
        batch_size_per_step=8,
    )
    delayed = build_collaborative_optimizer(
        build_model(small_config()),
        small_config(run_id="delayed", delay_optimizer_step=True, delay_grad_averaging=True),
        dht,
        batch_size_per_step=8,
    )
    try:
        assert local.use_local_updates and not local.delay_optimizer_step
        assert delayed.delay_optimizer_step and delayed.delay_grad_averaging
        assert local.grad_averager is None  # as hivemind: local updates average no gradients
        assert local.state_averager.settings.robust_aggregation == "mean"
    finally:
        local.shutdown()
        delayed.shutdown()


@pytest.mark.sockets
def test_a_planned_8bit_optimizer_in_a_lamb_run_is_marked_inexact(dht) -> None:
    pytest.importorskip("bitsandbytes")
    config = small_config()
    optimizer = build_collaborative_optimizer(
        build_model(config), config, dht, batch_size_per_step=8, inner_optimizer="lamb8bit"
    )
    try:
        assert type(optimizer.opt).__name__ == "Lamb8bit"
        # its steps differ from the fp32 peers': every round marks it drifted
        assert not optimizer.exact_steps
    finally:
        optimizer.shutdown()


def test_collaboration_knobs_that_cannot_work_together_are_refused() -> None:
    with pytest.raises(ConfigError, match="delay_optimizer_step"):
        CollaborationConfig(delay_grad_averaging=True)
    with pytest.raises(ConfigError, match="help:"):
        CollaborationConfig(use_local_updates=True, reuse_grad_buffers=True)
    with pytest.raises(ConfigError, match="centered_clip"):
        CollaborationConfig(robust_aggregation="median")
    with pytest.raises(ConfigError, match="max_grad_norm"):
        dataclasses.replace(
            RunConfig(), collaboration=CollaborationConfig(reuse_grad_buffers=True)
        )  # local clipping of 1.0 on a .grad that sums several steps


@pytest.mark.sockets
def test_the_ttt_recipe_trains_and_its_8bit_state_reaches_a_late_joiner() -> None:
    pytest.importorskip("bitsandbytes")
    from kit.hardware.plan import TrainingPlan
    from kit.training.trainer import Trainer
    from tests.training.test_trainer import random_batches

    base = RunConfig.tiny_demo(data_files=["unused/*.txt"])  # embeddings of 8000 x 64: 8-bit
    config = base.with_recipe("ttt")
    config = dataclasses.replace(
        config,
        optimizer=dataclasses.replace(config.optimizer, warmup_steps=1, total_steps=100),
        collaboration=dataclasses.replace(
            config.collaboration,
            target_batch_size=8,
            matchmaking_time=0.2,
            averaging_timeout=5.0,
            size_adaptive_threshold=64,
        ),
    )
    first = kit.DHT(host="127.0.0.1", client_mode=False)
    second = kit.DHT(host="127.0.0.1", client_mode=False, initial_peers=first.get_visible_maddrs())
    trainer = joiner = None
    try:
        model = build_model(config)
        optimizer = build_collaborative_optimizer(model, config, first, batch_size_per_step=4)
        plan = TrainingPlan(micro_batch=2, accumulation_steps=2)
        trainer = Trainer(model, optimizer, random_batches(2), plan, clip_grad_norm=None)
        trainer.run(max_steps=4)  # 2 global steps: delayed, on 8-bit CPU statistics
        optimizer.state_dict()  # lands the delayed step
        assert optimizer.local_epoch >= 1 and trainer.status.rollbacks == 0
        statistics = [s for s in optimizer.opt.state.values() if s]
        assert statistics and any(s["state1"].dtype == torch.uint8 for s in statistics)
        joiner_model = build_model(config)
        joiner = build_collaborative_optimizer(joiner_model, config, second, batch_size_per_step=4)
        joiner.load_state_from_peers(timeout=30)
        assert joiner.local_epoch == optimizer.local_epoch
        for mine, theirs in zip(joiner_model.parameters(), model.parameters(), strict=True):
            assert torch.equal(mine, theirs)
        joined = [s for s in joiner.opt.state.values() if s]
        assert any(s["state1"].dtype == torch.uint8 for s in joined)
    finally:
        if trainer is not None:
            trainer.optimizer.shutdown()
        if joiner is not None:
            joiner.shutdown()
        second.shutdown()
        first.shutdown()
