"""The collator: padded tensors that AlbertForPreTraining accepts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kit.data.collate import AlbertCollator
from kit.data.examples import IGNORE_INDEX, Example


def example(length: int, order: int = 0) -> Example:
    ids = np.arange(5, 5 + length, dtype=np.int32)
    ids[0], ids[-1] = 2, 3
    types = np.zeros(length, dtype=np.int8)
    types[length // 2 :] = 1
    labels = np.full(length, IGNORE_INDEX, dtype=np.int32)
    labels[1] = 42
    return Example(ids, types, labels, order)


def test_padding_shapes_and_values() -> None:
    batch = AlbertCollator(pad_to_multiple_of=8, max_length=64)([example(5), example(11, 1)])
    assert set(batch) == {
        "input_ids",
        "attention_mask",
        "token_type_ids",
        "labels",
        "sentence_order_label",
    }
    assert batch["input_ids"].shape == (2, 16) and batch["input_ids"].dtype == torch.int64
    assert batch["attention_mask"].sum(dim=1).tolist() == [5, 11]
    assert (batch["input_ids"][0, 5:] == 0).all() and (batch["token_type_ids"][0, 5:] == 0).all()
    assert (batch["labels"][0, 5:] == IGNORE_INDEX).all() and batch["labels"][1, 1] == 42
    assert batch["input_ids"][1, :11].tolist() == example(11).input_ids.tolist()
    assert batch["sentence_order_label"].tolist() == [0, 1]


def test_padding_never_exceeds_max_length() -> None:
    batch = AlbertCollator(pad_to_multiple_of=8, max_length=12)([example(11)])
    assert batch["input_ids"].shape == (1, 12)
    assert AlbertCollator(pad_to_multiple_of=1)([example(7)])["input_ids"].shape == (1, 7)
    with pytest.raises(ValueError):
        AlbertCollator()([])


def test_forward_pass_through_a_tiny_albert(tokenizer, make_config) -> None:  # type: ignore[no-untyped-def]
    from transformers import AlbertConfig, AlbertForPreTraining

    from kit.data.pipeline import PretrainingPipeline

    pipeline = PretrainingPipeline.from_config(make_config(), tokenizer, peer_identity=b"forward")
    batch = next(pipeline.batches(4))
    torch.manual_seed(0)
    config = AlbertConfig(
        vocab_size=tokenizer.get_vocab_size(),
        embedding_size=16,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=3,
    )
    model = AlbertForPreTraining(config)
    output = model(**batch)
    assert output.prediction_logits.shape == (*batch["input_ids"].shape, tokenizer.get_vocab_size())
    assert output.sop_logits.shape == (4, 2)
    assert torch.isfinite(output.loss)
    output.loss.backward()
    assert model.albert.embeddings.word_embeddings.weight.grad is not None
