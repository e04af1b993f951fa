"""Masked-LM loss and perplexity of a checkpoint on held-out text, with deterministic masking.

Holds :func:`mask_tokens` (pure given a seeded generator) and :func:`masked_lm_loss`. This is the
cheap "is the run on track" signal: no fine-tuning, one forward pass over a few hundred held-out
documents. It does not fine-tune or plot.

Masking follows BERT (Devlin et al. 2019, §3.1), as the pretraining collator does: each
non-special token is picked with ``mask_probability``; a picked token becomes ``[MASK]`` 80% of
the time, a random token 10%, and stays 10%. The draws come from one ``torch.Generator`` seeded
with ``seed`` and are made per text, in order, on the CPU, so the masked positions are the same
for every batch size, device and checkpoint: losses of a series are comparable point to point.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from kit.errors import CheckpointError, EvaluationError
from kit.evaluation.checkpoints import (
    Checkpoint,
    check_vocabulary,
    load_pretrained,
    load_tokenizer,
    model_folder,
    resolve_device,
)
from kit.evaluation.metrics import IGNORE_INDEX
from kit.evaluation.tasks import collate

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MaskedLMResult:
    """Masked-LM loss of one checkpoint on one held-out text set."""

    model: str  # checkpoint label
    loss: float  # mean cross-entropy per masked token, in nats
    perplexity: float  # exp(loss)
    masked_tokens: int  # how many tokens were scored
    texts: int  # how many non-empty texts were used


def mask_tokens(
    input_ids: Sequence[int],
    special: Sequence[int],
    *,
    generator: torch.Generator,
    mask_token_id: int,
    vocab_size: int,
    probability: float,
) -> tuple[list[int], list[int]]:
    """BERT-style masking of one sequence: (inputs with masks, labels with IGNORE_INDEX).

    Args:
        input_ids: token ids of one text, special tokens included.
        special: 1 where the token is special (never masked), else 0.
        generator: seeded CPU generator; three draws per call, in a fixed order.
        mask_token_id: id of ``[MASK]``.
        vocab_size: random replacements are drawn from ``[0, vocab_size)``.
        probability: share of (non-special) tokens to predict.
    """
    n = len(input_ids)
    picked = torch.rand(n, generator=generator) < probability
    picked &= torch.tensor([not s for s in special], dtype=torch.bool)
    choice = torch.rand(n, generator=generator)
    random_ids = torch.randint(vocab_size, (n,), generator=generator)
    inputs, labels = list(input_ids), [IGNORE_INDEX] * n
    for i in torch.nonzero(picked).flatten().tolist():
        labels[i] = int(input_ids[i])
        if choice[i] < 0.8:
            inputs[i] = mask_token_id
        elif choice[i] < 0.9:
            inputs[i] = int(random_ids[i])
    return inputs, labels


@torch.no_grad()
def masked_lm_loss(
    checkpoint: Checkpoint,
    texts: Sequence[str],
    *,
    mask_probability: float = 0.15,
    seed: int = 0,
    max_length: int = 128,
    batch_size: int = 16,
    device: str = "auto",
    token: str | None = None,
    endpoint: str | None = None,
    progress: bool = True,
) -> MaskedLMResult:
    """Masked-LM loss and perplexity of a checkpoint on held-out texts.

    Args:
        checkpoint: a pretraining checkpoint (``AlbertForPreTraining`` or any masked LM).
        texts: held-out documents; empty ones are skipped.
        mask_probability: share of tokens to predict (0.15 as in pretraining).
        seed: seed of the masking; keep it fixed to compare checkpoints.
        max_length: tokens per text (longer texts are truncated).
        batch_size: texts per forward pass; lower it if memory runs out.
        device: "auto" (CUDA, MPS, CPU) or a torch device string.
        token: Hub token for private repos.
        endpoint: Hub URL (default ``HF_ENDPOINT``).
        progress: show a tqdm bar.

    Raises:
        CheckpointError: the checkpoint has no masked-LM head, or cannot be loaded.
        VocabularyMismatch: the tokenizer does not fit the embedding table.
        EvaluationError: no non-empty text, no mask token, or nothing got masked.
    """
    from transformers import AutoModelForMaskedLM

    if not 0.0 < mask_probability <= 1.0:
        raise EvaluationError(
            f"mask_probability must be in (0, 1], got {mask_probability} - "
            "help: use 0.15 as in pretraining"
        )
    documents = [text for text in texts if text and text.strip()]
    if not documents:
        raise EvaluationError("no held-out text to score - help: pass a list of documents")
    tokenizer = load_tokenizer(checkpoint, token=token, endpoint=endpoint)
    if tokenizer.mask_token_id is None:
        raise EvaluationError(
            f"the tokenizer of {checkpoint.label} has no mask token - help: "
            "use the pretraining tokenizer, which defines [MASK]"
        )
    folder = model_folder(checkpoint, token=token, endpoint=endpoint)
    model, missing = load_pretrained(AutoModelForMaskedLM, folder, checkpoint)
    if missing:
        raise CheckpointError(
            f"{checkpoint.label} has no masked-LM head (missing {', '.join(missing[:4])}) - "
            "help: evaluate the pretraining checkpoint, not a fine-tuned one"
        )
    check_vocabulary(checkpoint, model.get_input_embeddings().num_embeddings, len(tokenizer))
    target = resolve_device(device)
    model.to(target).eval()

    encoded = tokenizer(
        documents, truncation=True, max_length=max_length, return_special_tokens_mask=True
    )
    generator = torch.Generator().manual_seed(seed)
    examples: list[dict[str, Any]] = []
    for index, ids in enumerate(encoded["input_ids"]):
        inputs, labels = mask_tokens(
            ids,
            encoded["special_tokens_mask"][index],
            generator=generator,
            mask_token_id=tokenizer.mask_token_id,
            vocab_size=len(tokenizer),
            probability=mask_probability,
        )
        example = {key: encoded[key][index] for key in encoded if key != "special_tokens_mask"}
        example.update(input_ids=inputs, labels=labels)
        examples.append(example)

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    total, count = 0.0, 0
    starts = range(0, len(examples), batch_size)
    for start in tqdm(starts, desc=f"MLM {checkpoint.label}", disable=not progress, leave=False):
        batch = {
            k: v.to(target)
            for k, v in collate(examples[start : start + batch_size], pad_id).items()
        }
        targets = batch.pop("labels")
        logits = model(**batch).logits
        total += float(
            torch.nn.functional.cross_entropy(
                logits.flatten(0, 1).float(),
                targets.flatten(),
                ignore_index=IGNORE_INDEX,
                reduction="sum",
            )
        )
        count += int((targets != IGNORE_INDEX).sum())
    if count == 0:
        raise EvaluationError(
            "no token was masked - help: pass longer texts or raise mask_probability"
        )
    loss = total / count
    logger.info(
        "%s: masked-LM loss %.4f (perplexity %.2f) over %d tokens",
        checkpoint.label,
        loss,
        math.exp(min(loss, 700.0)),
        count,
    )
    return MaskedLMResult(checkpoint.label, loss, math.exp(min(loss, 700.0)), count, len(documents))
