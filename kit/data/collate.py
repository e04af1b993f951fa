"""The collator: a list of ALBERT examples becomes one batch of padded torch tensors.

It holds the padding step only, producing exactly the keyword arguments of
``transformers.AlbertForPreTraining.forward``: ``input_ids``, ``attention_mask``,
``token_type_ids``, ``labels`` (MLM, -100 where nothing is predicted) and
``sentence_order_label``. Batches are padded to their longest example (rounded up to a multiple
of 8 for tensor cores), not to ``max_seq_length``: sahajBERT did the same, and short batches then
cost less. It doesn't hold masking or example construction (kit.data.examples).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .examples import IGNORE_INDEX, Example
from .tokenizer import PAD_ID


class AlbertCollator:
    """Pads examples into a batch for ``AlbertForPreTraining``.

    Args:
        pad_id: id of ``<pad>`` (0 in the recipe, matching ALBERT's ``pad_token_id``).
        pad_to_multiple_of: round the padded length up to a multiple of this (1 = no rounding).
        max_length: never pad beyond this (the model's ``max_position_embeddings``).
    """

    def __init__(
        self, *, pad_id: int = PAD_ID, pad_to_multiple_of: int = 8, max_length: int = 512
    ) -> None:
        self.pad_id = pad_id
        self.pad_to_multiple_of = pad_to_multiple_of
        self.max_length = max_length

    def __call__(self, examples: Sequence[Example]) -> dict[str, torch.Tensor]:
        """The batch as int64 tensors of shape (batch, length), plus (batch,) SOP labels."""
        if not examples:
            raise ValueError("cannot collate an empty list of examples")
        lengths = [len(example.input_ids) for example in examples]
        longest = max(lengths)
        multiple = self.pad_to_multiple_of
        width = min(max(longest, -(-longest // multiple) * multiple), max(self.max_length, longest))
        input_ids = np.full((len(examples), width), self.pad_id, dtype=np.int64)
        token_type_ids = np.zeros((len(examples), width), dtype=np.int64)
        labels = np.full((len(examples), width), IGNORE_INDEX, dtype=np.int64)
        attention_mask = np.zeros((len(examples), width), dtype=np.int64)
        for row, (example, length) in enumerate(zip(examples, lengths, strict=True)):
            input_ids[row, :length] = example.input_ids
            token_type_ids[row, :length] = example.token_type_ids
            labels[row, :length] = example.labels
            attention_mask[row, :length] = 1
        return {
            "input_ids": torch.from_numpy(input_ids),
            "attention_mask": torch.from_numpy(attention_mask),
            "token_type_ids": torch.from_numpy(token_type_ids),
            "labels": torch.from_numpy(labels),
            "sentence_order_label": torch.tensor(
                [example.sentence_order_label for example in examples], dtype=torch.int64
            ),
        }
