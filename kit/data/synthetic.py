"""Synthetic Bengali-like text for tests, benchmarks and dry runs, generated locally.

It holds a generator of pseudo-Bengali documents (real Bengali letters, vowel signs, digits and
danda, arranged into made-up words, sentences and paragraphs) with a fixed seed. The text has
Bengali's script statistics (conjuncts, vowel signs, ``।``) without being a corpus: it is for
measuring speed and exercising code paths offline, not for training a useful model. Real Bengali
sentences for correctness tests live in the test fixtures, not here.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

# Consonants, vowel signs and independent vowels of the Bengali block (U+0980-U+09FF).
_CONSONANTS = tuple("কখগঘঙচছজঝঞটঠডঢণতথদধনপফবভমযরলশষসহ") + ("ড\u09bc", "ঢ\u09bc", "য\u09bc")
_VOWEL_SIGNS = ("", "", "া", "ি", "ী", "ু", "ূ", "ে", "ৈ", "ো", "ৌ", "ৃ")
_VOWELS = tuple("অআইঈউঊএঐওঔ")
_CONJUNCTS = ("ক্ষ", "ন্ত", "স্ত", "ন্দ", "ম্প", "ত্র", "প্র", "গ্র", "ব্দ", "ন্ধ", "জ্ঞ", "শ্র")
_FINALS = ("", "", "", "", "ং", "ঃ")
_DIGITS = "০১২৩৪৫৬৭৮৯"
_TERMINATORS = ("।", "।", "।", "?", "!")


class SyntheticBengali:
    """A seeded generator of pseudo-Bengali words, sentences and documents.

    Args:
        seed: seed of the generator; the same seed always produces the same text.
        vocabulary_size: how many distinct made-up words to draw from (Zipf-distributed, like
            real text, so frequent words repeat and a tokenizer finds pieces to learn).
    """

    def __init__(self, seed: int = 0, vocabulary_size: int = 3000) -> None:
        self._rng = random.Random(seed)
        self._words = [self._make_word() for _ in range(vocabulary_size)]
        # Zipf weights 1/rank: a few very common words, a long tail.
        self._cumulative: list[float] = []
        total = 0.0
        for rank in range(1, vocabulary_size + 1):
            total += 1.0 / rank
            self._cumulative.append(total)

    def _make_syllable(self) -> str:
        rng = self._rng
        if rng.random() < 0.1:
            return rng.choice(_VOWELS)
        onset = rng.choice(_CONJUNCTS) if rng.random() < 0.12 else rng.choice(_CONSONANTS)
        return onset + rng.choice(_VOWEL_SIGNS)

    def _make_word(self) -> str:
        syllables = self._rng.choice((1, 2, 2, 3, 3, 4))
        return "".join(self._make_syllable() for _ in range(syllables)) + self._rng.choice(_FINALS)

    def word(self) -> str:
        """One word, Zipf-distributed over the generator's vocabulary."""
        return self._rng.choices(self._words, cum_weights=self._cumulative)[0]

    def sentence(self, min_words: int = 4, max_words: int = 14) -> str:
        """One sentence ending in a danda (or ``?``/``!``), sometimes with a number or a comma."""
        rng = self._rng
        words = [self.word() for _ in range(rng.randint(min_words, max_words))]
        if rng.random() < 0.2:
            number = "".join(rng.choice(_DIGITS) for _ in range(rng.randint(1, 4)))
            words.insert(rng.randrange(len(words) + 1), number)
        if len(words) > 5 and rng.random() < 0.3:
            words[rng.randrange(1, len(words) - 1)] += ","
        return " ".join(words) + rng.choice(_TERMINATORS)

    def document(self, min_sentences: int = 2, max_sentences: int = 12) -> str:
        """One document: a paragraph of sentences on one line (like a line of OSCAR)."""
        count = self._rng.randint(min_sentences, max_sentences)
        return " ".join(self.sentence() for _ in range(count))

    def documents(
        self, count: int, min_sentences: int = 2, max_sentences: int = 12
    ) -> Iterator[str]:
        """``count`` documents, one after the other."""
        for _ in range(count):
            yield self.document(min_sentences, max_sentences)
