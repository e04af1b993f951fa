"""Gradient (activation) checkpointing for ALBERT, which transformers refuses to checkpoint.

transformers 5 raises "AlbertForPreTraining does not support gradient checkpointing". ALBERT is
the easiest model to checkpoint, though: its encoder runs one shared layer group
``num_hidden_layers`` times (Lan et al. 2020 §3.1), so wrapping that group's forward in
``torch.utils.checkpoint.checkpoint`` keeps only each layer's input (``batch x seq x hidden``)
for the backward pass and recomputes the layer's insides there, one layer at a time (Chen et al.
2016, "Training Deep Nets with Sublinear Memory Cost"): activations drop from ~34·s·d + 5·a·s²
to ~2·s·d per layer and sample (Korthikanti et al. 2022 §4.1), for one more forward per step
(~1/3 more compute). Results are the same: dropout's random state is replayed
(``preserve_rng_state``), so losses and gradients match the plain model
(``tests/training/test_checkpointing.py``).

Holds :func:`supports_kit_checkpointing` and :func:`enable_checkpointing`. The wrapper patches the
group's ``forward`` on the instance: module names, the parameter order and ``state_dict`` keys stay
as they are, so checkpoints and averaging are unaffected.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

#: Set on a layer group whose forward kit wrapped (so wrapping twice is a no-op).
_WRAPPED = "_kit_checkpointed"


def _layer_groups(model: torch.nn.Module) -> list[torch.nn.Module]:
    """ALBERT's shared layer groups (``albert.encoder.albert_layer_groups``), or none."""
    base = getattr(model, "albert", model)
    encoder = getattr(base, "encoder", None)
    groups = getattr(encoder, "albert_layer_groups", None)
    return list(groups) if isinstance(groups, torch.nn.ModuleList) else []


def supports_kit_checkpointing(model: torch.nn.Module) -> bool:
    """Whether :func:`enable_checkpointing` can checkpoint ``model`` (ALBERT-shaped models)."""
    return bool(_layer_groups(model))


def enable_checkpointing(model: torch.nn.Module) -> int:
    """Recompute each ALBERT layer group's activations in backward instead of keeping them.

    Returns:
        How many layer groups were wrapped (0: nothing to wrap, the model is unchanged).
    """
    groups = _layer_groups(model)
    for group in groups:
        if getattr(group, _WRAPPED, False):
            continue
        original = group.forward
        group.forward = functools.partial(_checkpointed_forward, group, original)  # type: ignore[method-assign]
        setattr(group, _WRAPPED, True)
    return len(groups)


def _checkpointed_forward(
    group: torch.nn.Module, original: Any, hidden_states: torch.Tensor, *args: Any, **kwargs: Any
) -> Any:
    if not (group.training and torch.is_grad_enabled()):
        return original(hidden_states, *args, **kwargs)
    # Non-reentrant checkpointing: keyword arguments pass through, and inputs that need no
    # gradient (the attention mask) are fine.
    return checkpoint(original, hidden_states, *args, use_reentrant=False, **kwargs)
