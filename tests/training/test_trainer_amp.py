"""fp16 loss scaling through the volunteer's loop, with every option it combines with.

A scale that is a power of two is exact in float32: a run whose gradients carry a GradScaler's
scale (here one that grows at every clean step) must end with the parameters of the same run
without one, if the scale is removed exactly once on what the optimizer steps with. Each
combination runs a lone peer (its global steps need no round) on the CPU with
``torch.amp.GradScaler("cpu")``; then the plan a T4 gets (fp16 autocast + scaler) trains the
TTT recipe and sahajBERT with offload, forced onto the CPU.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import pytest
import torch

import kit
from kit.config import RunConfig
from kit.hardware.plan import TrainingPlan
from kit.training.assembly import build_training, plan_training
from kit.training.components import build_model
from kit.training.trainer import Trainer
from tests.training.test_assembly import on_cpu, t4s
from tests.training.test_trainer import random_batches, tiny_config

pytestmark = pytest.mark.sockets
_RUNS = itertools.count()


def configured(**changes: Any) -> RunConfig:
    """The tiny run with optimizer / collaboration fields changed, no dropout (the runs compared
    must draw nothing at random), and a run id of its own (a finished run's progress records
    stay in the DHT for a minute)."""
    config = tiny_config()
    optimizer_fields = {f.name for f in dataclasses.fields(config.optimizer)}
    optimizer = {k: v for k, v in changes.items() if k in optimizer_fields}
    collaboration = {k: v for k, v in changes.items() if k not in optimizer_fields}
    return dataclasses.replace(
        config,
        # No dropout: replicas run in threads, and their draws would come in either order.
        model=dataclasses.replace(config.model, classifier_dropout_prob=0.0),
        optimizer=dataclasses.replace(config.optimizer, **optimizer),
        collaboration=dataclasses.replace(
            config.collaboration, run_id=f"amp-{next(_RUNS)}", **collaboration
        ),
    )


def volunteer_loop(dht: Any, config: RunConfig, plan: TrainingPlan) -> tuple[Trainer, Any]:
    """The volunteer's path: the plan built, and its Trainer on the test's batches."""
    parts = build_training(config, plan, build_model(config), dht)
    trainer = Trainer(
        parts.model,
        parts.optimizer,
        random_batches(plan.micro_batch),
        plan,
        clip_grad_norm=config.optimizer.clip_grad_norm,
        replicas=parts.replicas,
    )
    return trainer, parts


def train(
    dht: Any, config: RunConfig, plan: TrainingPlan, scaler: torch.amp.GradScaler | None
) -> tuple[Trainer, list[torch.Tensor]]:
    trainer, parts = volunteer_loop(dht, config, plan)
    trainer.scaler = scaler  # fp32 compute, scaled gradients: see the module
    try:
        trainer.run(max_steps=6)
        parts.optimizer.step(batch_size=0)  # a delayed step lands
        parts.optimizer._driver.finish_optimizer_step(wait=10.0)
    finally:
        parts.optimizer.shutdown()
    return trainer, [p.detach().clone() for p in parts.model.parameters()]


COMBINATIONS: dict[str, dict[str, Any]] = {
    "sahajbert-local-clipping": {},
    "reuse_grad_buffers+clipping-in-step": dict(
        reuse_grad_buffers=True, clip_grad_norm=None, max_grad_norm=4.0
    ),
    "offload_optimizer": dict(offload_optimizer=True),
    "lamb8bit+offload+reuse (ttt)": dict(
        name="lamb8bit",
        offload_optimizer=True,
        reuse_grad_buffers=True,
        clip_grad_norm=None,
        max_grad_norm=4.0,
    ),
    "delay_optimizer_step": dict(delay_optimizer_step=True),
    "delay_grad_averaging": dict(delay_optimizer_step=True, delay_grad_averaging=True),
    "local_updates": dict(use_local_updates=True),
    "two-replicas": dict(),
}
#: Delayed steps land when their thread is done: how many batches ran on stale parameters
#: varies from run to run, so those runs are compared by what they must all do.
TIMING_DEPENDENT = {"delay_optimizer_step", "delay_grad_averaging"}


@pytest.mark.parametrize("name", list(COMBINATIONS))
def test_a_grad_scaler_changes_nothing_in_float32_with(dht: Any, name: str) -> None:
    if "lamb8bit" in name:
        pytest.importorskip("bitsandbytes")
    changes = COMBINATIONS[name]
    devices = ("cpu", "cpu") if name == "two-replicas" else ()
    plan = TrainingPlan(micro_batch=2, accumulation_steps=2, devices=devices)
    plain, expected = train(dht, configured(**changes), plan, None)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    scaled, params = train(dht, configured(**changes), plan, scaler)
    assert scaled.optimizer.local_epoch == plain.optimizer.local_epoch >= 2
    assert scaler.get_scale() > 2.0**10  # clean steps grew it (between global steps only,
    # with reuse_grad_buffers: kit.optim.grad_scaling)
    if name in TIMING_DEPENDENT:
        assert all(torch.isfinite(p).all() for p in params)
        assert scaled.status.loss_history[-1][1] < scaled.status.loss_history[0][1] + 1.0
        return
    start = torch.cat([p.detach().reshape(-1) for p in build_model(configured()).parameters()])
    ours, theirs = (torch.cat([p.reshape(-1) for p in ps]) for ps in (params, expected))
    moved = float((theirs - start).norm())
    assert moved > 0 and float((ours - theirs).norm()) <= 1e-4 * moved, name


@pytest.mark.parametrize("recipe", ["ttt", "sahajbert+offload"], ids=["ttt", "sahajbert-offload"])
def test_the_plan_of_a_t4_trains_on_the_cpu(dht: Any, recipe: str) -> None:
    """sm_75 plans fp16 autocast with a GradScaler; before, the first global step raised
    "No inf checks were recorded prior to update" (TTT, and sahajBERT with offload)."""
    config = configured()
    if recipe == "ttt":
        config = config.with_recipe("ttt")
        config = dataclasses.replace(
            config,
            collaboration=dataclasses.replace(
                config.collaboration, target_batch_size=8, batch_size_per_step=4
            ),
        )
    else:
        config = configured(offload_optimizer=True)
    _, plan = plan_training(config, t4s(1), probe=False)
    assert (plan.precision, plan.grad_scaler) == ("fp16", True)
    if recipe == "ttt":
        pytest.importorskip("bitsandbytes")
    trainer, parts = volunteer_loop(dht, config, on_cpu(plan))
    assert trainer.scaler is not None
    try:
        trainer.run(max_steps=8)
    finally:
        parts.optimizer.shutdown()
    assert trainer.error is None and trainer.local_steps == 8
    assert parts.optimizer.local_epoch >= 2  # global steps were taken
    losses = [loss for _, loss in trainer.status.loss_history]
    assert len(losses) == 8 and all(torch.isfinite(torch.tensor(losses)))
    assert all(torch.isfinite(p).all() for p in parts.model.parameters())


@pytest.fixture
def dht():
    node = kit.DHT(host="127.0.0.1", client_mode=False)
    yield node
    node.shutdown()
