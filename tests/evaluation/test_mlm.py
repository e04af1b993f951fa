"""Held-out masked-LM loss: deterministic BERT masking, batch-size invariance, clear errors."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from kit.errors import CheckpointError, EvaluationError
from kit.evaluation.checkpoints import Checkpoint
from kit.evaluation.metrics import IGNORE_INDEX
from kit.evaluation.mlm import mask_tokens, masked_lm_loss
from tests.evaluation import tiny
from tests.evaluation.conftest import TinyWorld

HELDOUT = [text for text, _ in tiny.ncc_texts(20, seed=7)]


def _mask(ids: list[int], special: list[int], seed: int, probability: float = 0.15):
    return mask_tokens(
        ids,
        special,
        generator=torch.Generator().manual_seed(seed),
        mask_token_id=4,
        vocab_size=100,
        probability=probability,
    )


def test_masking_is_seeded_and_spares_special_tokens() -> None:
    ids = list(range(10, 90)) * 50
    special = [1] + [0] * (len(ids) - 2) + [1]
    inputs, labels = _mask(ids, special, seed=0)
    assert (inputs, labels) == _mask(ids, special, seed=0)
    assert (inputs, labels) != _mask(ids, special, seed=1)
    assert labels[0] == labels[-1] == IGNORE_INDEX
    picked = [i for i, label in enumerate(labels) if label != IGNORE_INDEX]
    assert all(labels[i] == ids[i] for i in picked)  # labels are the original tokens
    assert all(inputs[i] == ids[i] for i in range(len(ids)) if i not in set(picked))
    assert 0.13 < len(picked) / len(ids) < 0.17
    masked = sum(inputs[i] == 4 for i in picked) / len(picked)
    kept = sum(inputs[i] == ids[i] for i in picked) / len(picked)
    assert 0.75 < masked < 0.85 and 0.06 < kept < 0.14  # BERT's 80 / 10 / 10 (random ~10%)


def test_every_token_with_probability_one() -> None:
    _, labels = _mask([5, 6, 7, 8], [1, 0, 0, 1], seed=3, probability=1.0)
    assert labels == [IGNORE_INDEX, 6, 7, IGNORE_INDEX]


def test_loss_is_deterministic_and_batch_size_free(world: TinyWorld) -> None:
    checkpoint = Checkpoint(str(world.checkpoint))
    one = masked_lm_loss(checkpoint, HELDOUT, batch_size=1, progress=False)
    many = masked_lm_loss(checkpoint, HELDOUT + ["", "   "], batch_size=16, progress=False)
    assert one.masked_tokens == many.masked_tokens > 0
    assert many.texts == len(HELDOUT)  # empty documents are skipped
    assert one.loss == pytest.approx(many.loss, rel=1e-5)
    assert one.perplexity == pytest.approx(math.exp(one.loss))
    # an untrained model is about as unsure as a uniform guess over the vocabulary
    assert 0.5 * math.log(len(world.tokenizer)) < one.loss < 2 * math.log(len(world.tokenizer))
    other_seed = masked_lm_loss(checkpoint, HELDOUT, seed=1, progress=False)
    assert other_seed.loss != pytest.approx(one.loss)


def test_checkpoint_without_mlm_head(world: TinyWorld, tmp_path: Path) -> None:
    from transformers import AlbertConfig, AlbertModel

    config = AlbertConfig(
        vocab_size=len(world.tokenizer),
        embedding_size=16,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
    )
    AlbertModel(config).save_pretrained(tmp_path / "encoder")
    world.tokenizer.save_pretrained(tmp_path / "encoder")
    with pytest.raises(CheckpointError, match="no masked-LM head"):
        masked_lm_loss(Checkpoint(str(tmp_path / "encoder")), HELDOUT, progress=False)


def test_bad_texts(world: TinyWorld) -> None:
    with pytest.raises(EvaluationError, match="no held-out text"):
        masked_lm_loss(Checkpoint(str(world.checkpoint)), ["", " "], progress=False)
    with pytest.raises(EvaluationError, match="mask_probability"):
        masked_lm_loss(Checkpoint(str(world.checkpoint)), HELDOUT, mask_probability=0.0)
