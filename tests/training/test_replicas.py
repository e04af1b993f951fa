"""One peer on several devices: replicas' summed gradients equal one model's on the whole batch."""

from __future__ import annotations

import dataclasses

import torch

from kit.config import ModelConfig, RunConfig
from kit.training.checkpointing import enable_checkpointing
from kit.training.components import build_model
from kit.training.replicas import Replicas


def config() -> RunConfig:
    # No dropout anywhere (the SOP head has its own): the two runs must compute the same thing.
    model = dataclasses.replace(ModelConfig.tiny(), classifier_dropout_prob=0.0)
    return dataclasses.replace(RunConfig.tiny_demo(), model=model)


def doubled_batch() -> dict[str, torch.Tensor]:
    # Every token labelled and no padding: each half's mean loss weighs the same, so the mean of
    # the halves' means is the mean over the doubled batch.
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 8000, (8, 32), generator=generator)
    return dict(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        labels=ids.clone(),
        sentence_order_label=torch.tensor([0, 1, 0, 1, 1, 0, 0, 1]),
    )


def flat_gradient(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_two_cpu_replicas_give_the_gradient_of_the_doubled_batch() -> None:
    single, main = build_model(config()), build_model(config())
    full = doubled_batch()
    single(**full).loss.backward()
    replicas = Replicas(main, ["cpu", "cpu"])
    try:
        with torch.no_grad():  # the optimizer moved the main model: the replica must follow
            for param in main.parameters():
                param.add_(0.0)
        replicas.sync_parameters()
        halves = [{k: v[:4] for k, v in full.items()}, {k: v[4:] for k, v in full.items()}]
        losses = replicas.forward_backward(halves, divisor=2)
        replicas.gather_gradients()
    finally:
        replicas.close()
    expected, got = flat_gradient(single), flat_gradient(main)
    assert float((expected - got).norm() / expected.norm()) <= 1e-6
    assert all(p.grad is None for p in replicas.models[1].parameters())  # cleared
    assert abs(float(losses) / 2 - float(single(**full).loss.detach())) <= 1e-5


def test_replicas_follow_the_main_model_and_keep_checkpointing() -> None:
    main = build_model(config())
    enable_checkpointing(main)
    replicas = Replicas(main, ["cpu", "cpu"])
    try:
        with torch.no_grad():
            for param in main.parameters():
                param.mul_(0.5)
        replicas.sync_parameters()
        for mine, theirs in zip(main.parameters(), replicas.models[1].parameters(), strict=True):
            assert torch.equal(mine, theirs) and mine is not theirs
        copy_groups = replicas.models[1].albert.encoder.albert_layer_groups
        assert getattr(copy_groups[0], "_kit_checkpointed", False)
        assert copy_groups[0].forward.args[0] is copy_groups[0]  # its own layers, not main's
    finally:
        replicas.close()
