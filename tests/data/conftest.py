"""Fixtures of the data tests: a small local corpus (real Bengali + generated text) and a tokenizer.

Everything is made in temporary folders; nothing is downloaded. The corpus files are read with
the same ``datasets.load_dataset("text", data_files=..., streaming=True)`` path as Hub data.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from kit.config import DataConfig, SourceConfig, TokenizerConfig
from kit.data.synthetic import SyntheticBengali
from kit.data.tokenizer import train_tokenizer

#: Real Bengali sentences (everyday statements, facts and questions), each ending in । or ?.
BENGALI_SENTENCES = (
    "আমি ভাত খাই।",
    "তুমি কী খাও?",
    "বাংলাদেশের রাজধানী ঢাকা।",
    "রবীন্দ্রনাথ ঠাকুর ১৯১৩ সালে নোবেল পুরস্কার পান।",
    "এই ইউনিয়নে ৩ টি মৌজা ও ১০ টি গ্রাম আছে ।",
    "পদ্মা বাংলাদেশের একটি প্রধান নদী।",
    "আজ আকাশে অনেক মেঘ করেছে।",
    "ছেলেটি প্রতিদিন সকালে স্কুলে যায়।",
    "বাংলা ভাষা পৃথিবীর অন্যতম প্রধান ভাষা।",
    "কলকাতা পশ্চিমবঙ্গের রাজধানী।",
    "আমার সোনার বাংলা, আমি তোমায় ভালোবাসি।",
    "বর্ষাকালে এখানে প্রচুর বৃষ্টি হয়।",
    "তিনি একজন বিখ্যাত লেখক ছিলেন।",
    "গ্রামের মানুষ কৃষিকাজ করে জীবিকা নির্বাহ করে।",
    "বইটি আমি গত বছর পড়েছিলাম।",
    "শিক্ষক ক্লাসে নতুন একটি গল্প বললেন।",
    "মা রান্নাঘরে রুটি বানাচ্ছেন।",
    "সুন্দরবন পৃথিবীর সবচেয়ে বড় ম্যানগ্রোভ বন।",
    "কাজী নজরুল ইসলাম বাংলাদেশের জাতীয় কবি।",
    "একুশে ফেব্রুয়ারি আন্তর্জাতিক মাতৃভাষা দিবস।",
    "নদীর ধারে একটি পুরনো মন্দির আছে।",
    "আমরা বিকেলে মাঠে ফুটবল খেলি।",
    "তোমার নাম কী?",
    "সে খুব ভালো গান গায়।",
    "চট্টগ্রাম একটি বন্দর নগরী।",
    "ট্রেনটি সময়মতো স্টেশনে পৌঁছেছে।",
    "বাজারে আজ মাছের দাম বেশি।",
    "ডাক্তার রোগীকে বিশ্রাম নিতে বললেন।",
    "জীবনে সফল হতে হলে পরিশ্রম করতে হয়।",
    "পাখিরা গাছে বাসা বাঁধে।",
)


def real_documents(count: int, seed: int = 0) -> list[str]:
    """Documents of 2-6 real sentences each, drawn with a fixed seed."""
    rng = random.Random(seed)
    return [" ".join(rng.sample(BENGALI_SENTENCES, rng.randint(2, 6))) for _ in range(count)]


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two sources: "wiki" (real Bengali, some generated) and "oscar" (generated, longer)."""
    folder = tmp_path_factory.mktemp("corpus")
    generator = SyntheticBengali(seed=1)
    wiki = real_documents(150) + list(generator.documents(150))
    random.Random(2).shuffle(wiki)
    oscar = list(generator.documents(400, min_sentences=3, max_sentences=20))
    return {
        "wiki": write_lines(folder / "wiki.txt", wiki),
        "oscar": write_lines(folder / "oscar.txt", oscar),
    }


@pytest.fixture(scope="session")
def tokenizer(corpus: dict[str, Path]) -> Tokenizer:
    """A tiny tokenizer (1,000 pieces) trained with the Bengali recipe on the corpus."""
    texts = [
        line for path in corpus.values() for line in path.read_text(encoding="utf-8").splitlines()
    ]
    return train_tokenizer(texts, TokenizerConfig(vocab_size=1000), progress=False)


@pytest.fixture
def make_config(corpus: dict[str, Path]) -> Callable[..., DataConfig]:
    """DataConfig over the corpus (wiki 0.23 / oscar 0.77 like sahajBERT), small windows."""

    def make(**overrides: object) -> DataConfig:
        values: dict[str, object] = {
            "sources": (
                SourceConfig("wiki", data_files=(str(corpus["wiki"]),), probability=0.23),
                SourceConfig("oscar", data_files=(str(corpus["oscar"]),), probability=0.77),
            ),
            "max_seq_length": 64,
            "shuffle_buffer_size": 40,
            "tokenize_batch_size": 16,
        }
        values.update(overrides)
        return DataConfig(**values)  # type: ignore[arg-type]

    return make
