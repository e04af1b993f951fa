"""ALBERT pretraining examples from tokenized documents: segments A/B, sentence order, masked LM.

It holds the pure, vectorized construction of examples, following sahajBERT's
``create_instances_from_document`` (ALBERT, Lan et al. 2020, §4.2 and appendix A.3):

* sentences end at sentence-final punctuation tokens (``।``, ``॥``, ``?``, ``!``, ``.``). The
  recipe's pre-tokenizer isolates every punctuation mark, so boundaries are found in token space,
  with no second tokenization pass and no language-specific sentence splitter;
* sentences gather into a chunk until it reaches ``max_seq_length - 3`` tokens or the document
  ends; a chunk is cut at a random sentence boundary into A and B. A chunk of a single sentence
  can't be cut and gives no example (counted, as sahajBERT did);
* sentence-order prediction: with probability ``sop_swap_probability`` A and B trade places and
  the label is 1 (the negative is always the same two segments reversed, never another document);
* the pair is trimmed longest-first to fit, then ``[CLS] A [SEP] B [SEP]`` with type ids 0/1;
* masked LM: each non-special token is picked with ``mlm_probability`` (or each whole word, as an
  option), then 80% become ``[MASK]``, 10% a random non-special token, 10% stay (BERT §3.1).

All randomness of one batch of documents comes from one seed, so rebuilding a batch from the same
documents and seed gives identical examples (that's how the pipeline resumes). It doesn't hold
reading, shuffling or tokenizing text (kit.data.sources, kit.data.pipeline) or padding
(kit.data.collate).
"""

from __future__ import annotations

import dataclasses
import random
import unicodedata
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from tokenizers import Tokenizer

from kit.config import DataConfig, config_error

from .tokenizer import CLS_ID, MASK_ID, PAD_ID, SEP_ID, SPECIAL_TOKENS, WORD_START

#: Labels of positions the MLM loss ignores (the convention of torch's cross_entropy and HF).
IGNORE_INDEX = -100
#: Tokens that end a sentence: danda, double danda, and Latin terminal punctuation.
SENTENCE_TERMINATORS = ("\u0964", "\u0965", "?", "!", ".")


class Example(NamedTuple):
    """One pretraining example, before padding."""

    input_ids: np.ndarray  # int32, [CLS] A [SEP] B [SEP] after masking
    token_type_ids: np.ndarray  # int8, 0 for [CLS] A [SEP], 1 for B [SEP]
    labels: (
        np.ndarray
    )  # int32, original id where a token was picked for MLM, IGNORE_INDEX elsewhere
    sentence_order_label: int  # 1 if A and B were swapped, else 0


@dataclasses.dataclass(frozen=True)
class VocabularyTables:
    """What example construction needs to know about a tokenizer, as lookup arrays."""

    vocab_size: int  # ids are below this
    special: np.ndarray  # bool[vocab]: never masked, never a random replacement
    sentence_end: np.ndarray  # bool[vocab]: the token ends a sentence
    word_start: np.ndarray  # bool[vocab]: the token begins a word (for whole-word masking)
    random_ids: np.ndarray  # int32: ids a random replacement draws from
    cls_id: int = CLS_ID  # starts every example
    sep_id: int = SEP_ID  # ends each segment
    mask_id: int = MASK_ID  # what 80% of picked tokens become
    pad_id: int = PAD_ID  # fills batches (kit.data.collate)

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer) -> VocabularyTables:
        """Tables for a tokenizer made by kit.data.tokenizer (special tokens at ids 0-4).

        Raises:
            ConfigError: the tokenizer lacks the recipe's special tokens at their ids.
        """
        for token_id, token in enumerate(SPECIAL_TOKENS):
            if tokenizer.token_to_id(token) != token_id:
                raise config_error(
                    "tokenizer",
                    f"must have {token!r} at id {token_id} (it has {tokenizer.token_to_id(token)})",
                    "train it with `kit tokenizer train` (kit.data.tokenizer)",
                )
        vocab_size = tokenizer.get_vocab_size()
        pieces = [tokenizer.id_to_token(i) or "" for i in range(vocab_size)]
        special = np.zeros(vocab_size, dtype=bool)
        special[: len(SPECIAL_TOKENS)] = True
        sentence_end = np.array([piece in SENTENCE_TERMINATORS for piece in pieces], dtype=bool)
        # A word starts at a "▁" piece; an isolated punctuation mark is a word of its own. Digits
        # are isolated too but continue the "▁" before them, so "১০" masks as one number.
        word_start = np.array(
            [
                piece.startswith(WORD_START)
                or (len(piece) == 1 and unicodedata.category(piece).startswith("P"))
                for piece in pieces
            ],
            dtype=bool,
        )
        return cls(
            vocab_size, special, sentence_end, word_start, np.flatnonzero(~special).astype(np.int32)
        )


@dataclasses.dataclass(frozen=True)
class ExampleCounts:
    """What example construction has done so far."""

    documents: int = 0  # documents turned into chunks
    examples: int = 0  # examples built
    single_sentence_chunks: int = 0  # chunks (or documents) of one sentence: no A/B cut, no example
    truncated_tokens: int = 0  # tokens trimmed so a pair fits max_seq_length
    tokens: int = 0  # tokens in built examples, special tokens included
    masked_tokens: int = 0  # tokens picked for MLM
    swapped: int = 0  # examples with A and B swapped (sentence_order_label 1)

    def __add__(self, other: ExampleCounts) -> ExampleCounts:
        return ExampleCounts(
            *(
                a + b
                for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other), strict=True)
            )
        )


def truncate_pair(length_a: int, length_b: int, budget: int) -> tuple[int, int]:
    """Segment lengths after longest-first truncation to ``budget`` tokens in all.

    Same result as ``tokenizers``' LongestFirst strategy (what sahajBERT's
    ``truncation="longest_first"`` used): if only the longer segment must shrink it keeps
    ``budget - shorter``; if both must, the shorter keeps ``budget // 2`` and the longer the rest
    (on a tie, B is "the longer").
    """
    if length_a + length_b <= budget:
        return length_a, length_b
    swap = length_a > length_b
    shorter, longer = (length_b, length_a) if swap else (length_a, length_b)
    longer = shorter if shorter > budget else max(shorter, budget - shorter)
    if shorter + longer > budget:
        shorter = budget // 2
        longer = shorter + budget % 2
    return (longer, shorter) if swap else (shorter, longer)


class ExampleBuilder:
    """Turns batches of tokenized documents into masked ALBERT examples.

    Args:
        tables: the tokenizer's lookup tables.
        max_seq_length: longest example, special tokens included.
        mlm_probability: share of tokens (or words) picked for MLM.
        mask_replace_probability: share of picked tokens replaced by [MASK].
        random_replace_probability: share of picked tokens replaced by a random token.
        whole_word_masking: pick whole words instead of single pieces.
        sop_swap_probability: share of examples with A and B swapped.
    """

    def __init__(
        self,
        tables: VocabularyTables,
        *,
        max_seq_length: int = 512,
        mlm_probability: float = 0.15,
        mask_replace_probability: float = 0.8,
        random_replace_probability: float = 0.1,
        whole_word_masking: bool = False,
        sop_swap_probability: float = 0.5,
    ) -> None:
        self.tables = tables
        self.max_seq_length = max_seq_length
        self._budget = max_seq_length - 3  # room for [CLS] A [SEP] B [SEP]
        self._mlm_probability = mlm_probability
        self._mask_replace = mask_replace_probability
        self._random_replace = random_replace_probability
        self._whole_word = whole_word_masking
        self._swap = sop_swap_probability
        self.counts = ExampleCounts()

    @classmethod
    def from_config(cls, tables: VocabularyTables, config: DataConfig) -> ExampleBuilder:
        """A builder with the example and masking settings of ``config``."""
        return cls(
            tables,
            max_seq_length=config.max_seq_length,
            mlm_probability=config.mlm_probability,
            mask_replace_probability=config.mask_replace_probability,
            random_replace_probability=config.random_replace_probability,
            whole_word_masking=config.whole_word_masking,
            sop_swap_probability=config.sop_swap_probability,
        )

    def build(self, documents: Sequence[np.ndarray], seed: int) -> list[Example]:
        """Examples from a batch of documents (token ids without special tokens).

        The result depends only on ``documents`` and ``seed``.
        """
        rng = random.Random(seed)
        pairs: list[tuple[np.ndarray, np.ndarray]] = []
        swapped: list[int] = []
        single = truncated = 0
        budget = self._budget
        sentence_end = self.tables.sentence_end
        for ids in documents:
            size = len(ids)
            if size == 0:
                single += 1
                continue
            ends = (np.flatnonzero(sentence_end[ids]) + 1).tolist()
            if ends[-1:] != [size]:
                ends.append(size)
            chunk_start = 0  # token offset where the current chunk starts
            first = 0  # index of its first sentence
            last_index = len(ends) - 1
            for index, end in enumerate(ends):
                if end - chunk_start < budget and index != last_index:
                    continue
                if index == first:  # a chunk of one sentence can't be cut into A and B
                    single += 1
                else:
                    cut = ends[rng.randint(first, index - 1)]  # A = sentences up to the cut
                    a, b = ids[chunk_start:cut], ids[cut:end]
                    is_swapped = rng.random() < self._swap
                    if is_swapped:
                        a, b = b, a
                    keep_a, keep_b = truncate_pair(len(a), len(b), budget)
                    truncated += len(a) + len(b) - keep_a - keep_b
                    pairs.append((a[:keep_a], b[:keep_b]))
                    swapped.append(int(is_swapped))
                chunk_start = end
                first = index + 1
        examples, tokens, masked = self._assemble(pairs, swapped, seed)
        self.counts = self.counts + ExampleCounts(
            documents=len(documents),
            examples=len(examples),
            single_sentence_chunks=single,
            truncated_tokens=truncated,
            tokens=tokens,
            masked_tokens=masked,
            swapped=sum(swapped),
        )
        return examples

    def _assemble(
        self, pairs: list[tuple[np.ndarray, np.ndarray]], swapped: list[int], seed: int
    ) -> tuple[list[Example], int, int]:
        """[CLS] A [SEP] B [SEP] for every pair, masked in one vectorized pass over the batch.

        Returns the examples, their total length and how many tokens were picked for MLM.
        """
        if not pairs:
            return [], 0, 0
        tables = self.tables
        cls_token = np.array([tables.cls_id], dtype=np.int32)
        sep_token = np.array([tables.sep_id], dtype=np.int32)
        parts: list[np.ndarray] = []
        segment_lengths: list[int] = []
        for a, b in pairs:
            parts += (cls_token, a, sep_token, b, sep_token)
            segment_lengths += (len(a) + 2, len(b) + 1)
        flat = np.concatenate(parts).astype(np.int32, copy=False)
        types = np.repeat(np.tile(np.array([0, 1], dtype=np.int8), len(pairs)), segment_lengths)
        inputs, labels, masked = self._mask(flat, np.random.default_rng([seed, 0x4D4C4D]))
        ends = np.cumsum(segment_lengths)[1::2].tolist()  # each example ends after its B segment
        starts = [0, *ends[:-1]]
        examples = [
            Example(inputs[start:end], types[start:end], labels[start:end], order)
            for start, end, order in zip(starts, ends, swapped, strict=True)
        ]
        return examples, len(flat), masked

    def _mask(
        self, flat: np.ndarray, rng: np.random.Generator
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """Masked inputs, MLM labels and the number of picked tokens, for a flat array of ids."""
        tables = self.tables
        maskable = ~tables.special[flat]
        if self._whole_word:
            # Each word (a word-start piece and the pieces after it) is picked as a unit; special
            # tokens start a "word" of their own so words never run across [SEP].
            starts = tables.word_start[flat] | ~maskable
            starts[0] = True
            word_index = np.cumsum(starts) - 1
            picked = (rng.random(int(word_index[-1]) + 1) < self._mlm_probability)[
                word_index
            ] & maskable
        else:
            picked = (rng.random(len(flat)) < self._mlm_probability) & maskable
        positions = np.flatnonzero(picked)
        labels = np.full(len(flat), IGNORE_INDEX, dtype=np.int32)
        labels[positions] = flat[positions]
        inputs = flat.copy()
        action = rng.random(len(positions))
        inputs[positions[action < self._mask_replace]] = tables.mask_id
        randomized = positions[
            (action >= self._mask_replace) & (action < self._mask_replace + self._random_replace)
        ]
        inputs[randomized] = tables.random_ids[
            rng.integers(0, len(tables.random_ids), len(randomized))
        ]
        return inputs, labels, len(positions)
