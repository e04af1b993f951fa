"""ALBERT example construction: A/B segments, sentence order, masking, lengths, determinism."""

from __future__ import annotations

import random

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from kit.data.examples import IGNORE_INDEX, Example, ExampleBuilder, VocabularyTables, truncate_pair

VOCAB = 100
END = 6  # the "sentence terminator" of the toy vocabulary
FIRST_MARKER = 10  # sentence k is made of token FIRST_MARKER + k (plus END)


def toy_tables() -> VocabularyTables:
    """Ids 0-4 special, 6 ends a sentence, 10-99 are words (even ids start a word)."""
    special = np.zeros(VOCAB, dtype=bool)
    special[:5] = True
    sentence_end = np.zeros(VOCAB, dtype=bool)
    sentence_end[END] = True
    word_start = np.zeros(VOCAB, dtype=bool)
    word_start[FIRST_MARKER::2] = True
    word_start[END] = True
    return VocabularyTables(
        VOCAB, special, sentence_end, word_start, np.arange(5, VOCAB, dtype=np.int32)
    )


def ordered_document(rng: random.Random, sentences: int) -> np.ndarray:
    """Sentence k repeats marker FIRST_MARKER + k, so the original order can be read back."""
    tokens: list[int] = []
    for k in range(sentences):
        tokens += [FIRST_MARKER + k] * rng.randint(1, 12) + [END]
    return np.asarray(tokens, dtype=np.int32)


def original_ids(example: Example) -> np.ndarray:
    return np.where(example.labels != IGNORE_INDEX, example.labels, example.input_ids)


def segments(example: Example) -> tuple[np.ndarray, np.ndarray]:
    original = original_ids(example)
    seps = np.flatnonzero(original == 3)
    assert original[0] == 2 and len(seps) == 2 and seps[1] == len(original) - 1
    return original[1 : seps[0]], original[seps[0] + 1 : seps[1]]


def build_many(builder: ExampleBuilder, documents: int = 400, seed: int = 0) -> list[Example]:
    rng = random.Random(seed)
    examples: list[Example] = []
    for batch in range(documents // 50):
        docs = [ordered_document(rng, rng.randint(1, 60)) for _ in range(50)]
        examples += builder.build(docs, seed=batch)
    return examples


@pytest.mark.parametrize("max_seq_length", [12, 64, 512])
def test_sop_labels_match_segment_order_and_lengths_fit(max_seq_length: int) -> None:
    builder = ExampleBuilder(toy_tables(), max_seq_length=max_seq_length)
    examples = build_many(builder)
    assert len(examples) > 300
    for example in examples:
        assert len(example.input_ids) <= max_seq_length
        a, b = segments(example)
        assert len(a) and len(b)
        markers_a = a[a >= FIRST_MARKER]
        markers_b = b[b >= FIRST_MARKER]
        if example.sentence_order_label == 0:
            assert markers_a.max() < markers_b.min()
        else:
            assert markers_a.min() > markers_b.max()
        first_sep = len(a) + 1
        assert example.token_type_ids.tolist() == [0] * (first_sep + 1) + [1] * (
            len(example.input_ids) - first_sep - 1
        )
    swapped = np.mean([example.sentence_order_label for example in examples])
    bound = 4 * np.sqrt(0.25 / len(examples))  # 4 standard deviations of a fair coin's mean
    assert abs(swapped - 0.5) < bound
    assert builder.counts.swapped == sum(example.sentence_order_label for example in examples)


def test_chunks_fill_up_to_the_budget_and_single_sentences_are_counted() -> None:
    builder = ExampleBuilder(toy_tables(), max_seq_length=40)
    one_sentence = np.asarray([FIRST_MARKER] * 5 + [END], dtype=np.int32)
    examples = builder.build([one_sentence, np.zeros(0, dtype=np.int32)], seed=0)
    assert (
        examples == []
        and builder.counts.single_sentence_chunks == 2
        and builder.counts.documents == 2
    )
    # 20 sentences of 4 tokens: a chunk closes at 10 sentences (40 >= 37 = 40 - 3 tokens),
    # so two examples, each of sentences 0-9 / 10-19, each trimmed by 3 tokens to fit.
    document = np.concatenate([[FIRST_MARKER + k] * 3 + [END] for k in range(20)]).astype(np.int32)
    examples = builder.build([document], seed=1)
    assert [len(example.input_ids) for example in examples] == [40, 40]
    markers = [set(original_ids(example).tolist()) - {2, 3, END} for example in examples]
    assert markers == [set(range(10, 20)), set(range(20, 30))]
    assert builder.counts.truncated_tokens == 6


def test_masking_rate_and_80_10_10_split() -> None:
    builder = ExampleBuilder(toy_tables(), max_seq_length=128)
    examples = build_many(builder, documents=800)
    flat_input = np.concatenate([example.input_ids for example in examples])
    flat_labels = np.concatenate([example.labels for example in examples])
    flat_original = np.concatenate([original_ids(example) for example in examples])
    maskable = flat_original >= 5
    picked = flat_labels != IGNORE_INDEX
    rate = picked[maskable].mean()
    assert abs(rate - 0.15) < 4 * np.sqrt(0.15 * 0.85 / maskable.sum())
    assert builder.counts.masked_tokens == picked.sum()

    n = picked.sum()
    as_mask = (flat_input[picked] == 4).mean()
    kept = (flat_input[picked] == flat_labels[picked]).mean()
    randomized = 1 - as_mask - kept
    tolerance = 4 * np.sqrt(0.8 * 0.2 / n)
    assert abs(as_mask - 0.8) < tolerance
    # A random replacement equals the original 1 time in 95, so "kept" is a bit above 10%.
    assert abs(kept - (0.1 + 0.1 / 95)) < tolerance
    assert abs(randomized - (0.1 - 0.1 / 95)) < tolerance
    replaced = flat_input[picked & (flat_input != flat_labels) & (flat_input != 4)]
    assert replaced.min() >= 5  # random replacements are never special tokens


def test_special_tokens_are_never_masked_or_changed() -> None:
    builder = ExampleBuilder(toy_tables(), max_seq_length=64, mlm_probability=1.0)
    for example in build_many(builder, documents=100):
        special = np.isin(example.input_ids, [2, 3]) | np.isin(
            original_ids(example), [0, 1, 2, 3, 4]
        )
        assert (example.labels[special] == IGNORE_INDEX).all()
        assert example.input_ids[0] == 2 and example.input_ids[-1] == 3
        assert (example.labels[~special] != IGNORE_INDEX).all()  # probability 1 picks all others


def test_whole_word_masking_picks_whole_words() -> None:
    tables = toy_tables()
    builder = ExampleBuilder(tables, max_seq_length=128, whole_word_masking=True)
    rng = random.Random(5)
    documents = []
    for _ in range(300):  # words: an even id followed by 0-3 odd ids
        tokens: list[int] = []
        for _ in range(rng.randint(2, 8)):
            for _ in range(rng.randint(1, 6)):
                tokens += [2 * rng.randint(5, 40)] + [2 * rng.randint(5, 40) + 1] * rng.randint(
                    0, 3
                )
            tokens.append(END)
        documents.append(np.asarray(tokens, dtype=np.int32))
    examples = builder.build(documents, seed=3)
    picked_tokens = total = 0
    for example in examples:
        original = original_ids(example)
        picked = example.labels != IGNORE_INDEX
        starts = tables.word_start[original] | tables.special[original]
        word = np.cumsum(starts)
        for index in np.unique(word):
            members = picked[word == index]
            assert members.all() or not members.any()
        picked_tokens += picked.sum()
        total += (~tables.special[original]).sum()
    assert 0.10 < picked_tokens / total < 0.20


def test_same_documents_and_seed_give_the_same_examples() -> None:
    rng = random.Random(1)
    documents = [ordered_document(rng, 20) for _ in range(30)]
    first = ExampleBuilder(toy_tables()).build(documents, seed=7)
    again = ExampleBuilder(toy_tables()).build(documents, seed=7)
    other = ExampleBuilder(toy_tables()).build(documents, seed=8)
    assert all(
        np.array_equal(x.input_ids, y.input_ids)
        and x.sentence_order_label == y.sentence_order_label
        for x, y in zip(first, again, strict=True)
    )
    assert any(
        not np.array_equal(x.input_ids, y.input_ids) for x, y in zip(first, other, strict=True)
    )


def test_truncate_pair_matches_tokenizers_longest_first() -> None:
    vocab = {"x": 0, "y": 1}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="x"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    for budget in range(1, 11):
        tokenizer.enable_truncation(max_length=budget, strategy="longest_first")
        for length_a in range(13):
            for length_b in range(13):
                if length_a + length_b == 0:
                    continue
                encoding = tokenizer.encode(
                    " ".join("x" * length_a), " ".join("y" * length_b), add_special_tokens=False
                )
                expected = (encoding.ids.count(0), encoding.ids.count(1))
                assert truncate_pair(length_a, length_b, budget) == expected, (
                    length_a,
                    length_b,
                    budget,
                )


def test_tables_from_a_trained_tokenizer(tokenizer: Tokenizer) -> None:
    tables = VocabularyTables.from_tokenizer(tokenizer)
    assert (
        tables.sentence_end[tokenizer.token_to_id("।")]
        and tables.sentence_end[tokenizer.token_to_id("?")]
    )
    assert (
        tables.word_start[tokenizer.token_to_id("▁")]
        and tables.word_start[tokenizer.token_to_id(",")]
    )
    assert not tables.word_start[tokenizer.token_to_id("১")]
    assert tables.special[:5].all() and not tables.special[5:].any()
    assert 4 not in tables.random_ids and len(tables.random_ids) == tables.vocab_size - 5
