"""kit's gradient checkpointing of ALBERT: the same loss and gradients, less activation memory."""

from __future__ import annotations

import dataclasses

import torch

from kit.config import ModelConfig, RunConfig
from kit.training.checkpointing import enable_checkpointing, supports_kit_checkpointing
from kit.training.components import build_model


def config() -> RunConfig:
    # Dropout on: checkpointing must replay the same random masks in the recomputation.
    model = dataclasses.replace(
        ModelConfig.tiny(), hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1
    )
    return dataclasses.replace(RunConfig.tiny_demo(), model=model)


def batch() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 8000, (4, 128), generator=generator)
    labels = torch.full_like(ids, -100)
    labels[:, ::7] = ids[:, ::7]
    return dict(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        labels=labels,
        sentence_order_label=torch.tensor([0, 1, 0, 1]),
    )


def loss_gradients_and_saved_bytes(
    model: torch.nn.Module,
) -> tuple[float, list[torch.Tensor], int]:
    """One training forward/backward; the bytes autograd keeps for backward (not parameters)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = tensor.untyped_storage().data_ptr()
        if key not in params:
            saved[key] = tensor.untyped_storage().nbytes()
        return tensor

    model.train()
    torch.manual_seed(1)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(**batch()).loss
    loss.backward()
    return float(loss.detach()), [p.grad.clone() for p in model.parameters()], sum(saved.values())


def test_checkpointed_albert_has_the_same_loss_and_gradients_and_keeps_less() -> None:
    plain, checkpointed = build_model(config()), build_model(config())
    assert supports_kit_checkpointing(checkpointed)
    assert enable_checkpointing(checkpointed) == 1  # ALBERT's one shared layer group
    assert enable_checkpointing(checkpointed) == 1  # wrapping twice changes nothing
    names = [name for name, _ in checkpointed.named_parameters()]
    assert names == [name for name, _ in plain.named_parameters()]  # state_dict keys unchanged
    loss, grads, plain_bytes = loss_gradients_and_saved_bytes(plain)
    loss_c, grads_c, checkpointed_bytes = loss_gradients_and_saved_bytes(checkpointed)
    assert abs(loss - loss_c) <= 1e-6 * abs(loss)
    flat, flat_c = (
        torch.cat([g.flatten() for g in grads]),
        torch.cat([g.flatten() for g in grads_c]),
    )
    assert float((flat - flat_c).norm() / flat.norm()) <= 1e-6
    # Measured: what autograd keeps for backward shrinks (the two layers' insides are dropped).
    assert checkpointed_bytes < 0.75 * plain_bytes, (checkpointed_bytes, plain_bytes)


def test_evaluation_and_models_without_layer_groups_are_left_alone() -> None:
    model = build_model(config())
    enable_checkpointing(model)
    model.eval()
    with torch.no_grad():
        assert torch.isfinite(model(**batch()).loss)
    mlp = torch.nn.Sequential(torch.nn.Linear(2, 2))
    assert not supports_kit_checkpointing(mlp) and enable_checkpointing(mlp) == 0
