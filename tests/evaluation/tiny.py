"""Tiny stand-ins for the real evaluation inputs, built in a temporary folder (no downloads).

A BPE tokenizer of ~140 pieces, 1-layer ALBERT checkpoints (hidden 32), and
datasets with exactly the WikiANN-bn and IndicGLUE sna.bn schemas (ClassLabel features included),
written as parquet (NER) and as JSON lines with a README feature card (NCC), so that
``datasets.load_dataset(folder)`` reads them the way it reads the real ones.

The synthetic tasks are learnable from single words (each entity word and each class keyword
belongs to one label), so a working fine-tuning loop must beat chance on them.
"""

from __future__ import annotations

import random
from pathlib import Path

import yaml

NER_TAGS = ["O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC"]
NCC_LABELS = ["kolkata", "state", "national", "sports", "entertainment", "international"]

FILLER = [
    "আমি",
    "ভাত",
    "খাই",
    "এবং",
    "সে",
    "গেল",
    "বাড়ি",
    "আজ",
    "কাল",
    "ভালো",
    "তারা",
    "খুব",
    "সুন্দর",
    "দিন",
]
ENTITIES = {  # entity type -> (words that start it, words that continue it)
    "PER": (["রহিম", "করিম", "সুমন", "রাজু"], ["হোসেন", "দাস", "রায়"]),
    "ORG": (["গ্রামীণ", "ইসলামী"], ["ব্যাংক", "সমিতি"]),
    "LOC": (["কলকাতা", "ঢাকা", "সিলেট"], ["শহর", "নগর"]),
}
KEYWORDS = ["পৌরসভা", "জেলাশাসক", "সংসদ", "ক্রিকেট", "সিনেমা", "জাতিসংঘ"]


def ner_sentences(count: int, seed: int) -> list[tuple[list[str], list[int]]]:
    rng = random.Random(seed)
    sentences = []
    for _ in range(count):
        words: list[str] = []
        tags: list[int] = []
        for _ in range(rng.randint(2, 4)):
            words.append(rng.choice(FILLER))
            tags.append(0)
            if rng.random() < 0.6:
                kind = rng.choice(sorted(ENTITIES))
                starts, continues = ENTITIES[kind]
                words.append(rng.choice(starts))
                tags.append(NER_TAGS.index(f"B-{kind}"))
                if rng.random() < 0.5:
                    words.append(rng.choice(continues))
                    tags.append(NER_TAGS.index(f"I-{kind}"))
        sentences.append((words, tags))
    return sentences


def ncc_texts(count: int, seed: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    items = []
    for _ in range(count):
        label = rng.randrange(len(NCC_LABELS))
        words = [rng.choice(FILLER) for _ in range(rng.randint(3, 6))]
        words.insert(rng.randrange(len(words) + 1), KEYWORDS[label])
        items.append((" ".join(words), label))
    return items


def corpus() -> list[str]:
    lines = [" ".join(words) for words, _ in ner_sentences(200, 1)]
    return lines + [text for text, _ in ncc_texts(200, 2)]


def make_tokenizer(folder: Path, vocab_size: int = 140):
    """Train a small BPE tokenizer (ALBERT-style specials, Metaspace) saved as a fast tokenizer.

    BPE rather than Unigram: on a corpus this small, tokenizers' Unigram trainer collapses to
    single characters, while BPE keeps frequent words whole and splits the rare ones, so both
    one-piece and many-piece words reach the label alignment.
    """
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.NFKC()
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials)
    tokenizer.train_from_iterator(corpus(), trainer)
    cls_id, sep_id = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )
    fast.save_pretrained(folder)
    return fast


def make_checkpoint(
    folder: Path,
    tokenizer,
    *,
    vocab_size: int | None = None,
    seed: int = 0,
    save_tokenizer: bool = True,
) -> Path:
    """A 1-layer ALBERT pretraining checkpoint (hidden 32) saved like the coordinator saves it."""
    import torch
    from transformers import AlbertConfig, AlbertForPreTraining

    torch.manual_seed(seed)
    config = AlbertConfig(
        vocab_size=vocab_size or len(tokenizer),
        embedding_size=16,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=tokenizer.pad_token_id,
    )
    AlbertForPreTraining(config).save_pretrained(folder)
    if save_tokenizer:
        tokenizer.save_pretrained(folder)
    return folder


def _ner_features():
    from datasets import ClassLabel, Features, Sequence, Value

    return Features(
        {
            "tokens": Sequence(Value("string")),
            "ner_tags": Sequence(ClassLabel(names=NER_TAGS)),
            "langs": Sequence(Value("string")),
            "spans": Sequence(Value("string")),
        }
    )


def _ncc_features():
    from datasets import ClassLabel, Features, Value

    return Features({"text": Value("string"), "label": ClassLabel(names=NCC_LABELS)})


def _spans(words: list[str], tags: list[int]) -> list[str]:
    spans, current = [], None
    for word, tag in zip(words, tags, strict=True):
        name = NER_TAGS[tag]
        if name.startswith("B-"):
            current = [name[2:], word]
            spans.append(current)
        elif name.startswith("I-") and current is not None:
            current.append(word)
        else:
            current = None
    return [f"{span[0]}: {' '.join(span[1:])}" for span in spans]


def make_ner_dataset(folder: Path, sizes=(48, 16, 16)) -> Path:
    """WikiANN-bn schema as parquet files (features, ClassLabel included, kept in the metadata)."""
    from datasets import Dataset

    folder.mkdir(parents=True, exist_ok=True)
    for offset, (split, size) in enumerate(
        zip(("train", "validation", "test"), sizes, strict=True)
    ):
        rows = ner_sentences(size, seed=10 + offset)
        Dataset.from_dict(
            {
                "tokens": [words for words, _ in rows],
                "ner_tags": [tags for _, tags in rows],
                "langs": [["bn"] * len(words) for words, _ in rows],
                "spans": [_spans(words, tags) for words, tags in rows],
            },
            features=_ner_features(),
        ).to_parquet(str(folder / f"{split}.parquet"))
    return folder


def make_ncc_dataset(folder: Path, sizes=(48, 16, 16)) -> Path:
    """IndicGLUE sna.bn schema as JSON lines plus a README card declaring the ClassLabel."""
    from datasets import Dataset

    folder.mkdir(parents=True, exist_ok=True)
    for offset, (split, size) in enumerate(
        zip(("train", "validation", "test"), sizes, strict=True)
    ):
        rows = ncc_texts(size, seed=20 + offset)
        Dataset.from_dict(
            {"text": [t for t, _ in rows], "label": [y for _, y in rows]}, features=_ncc_features()
        ).to_json(str(folder / f"{split}.jsonl"))
    card = {"dataset_info": {"features": _ncc_features()._to_yaml_list()}}
    (folder / "README.md").write_text(
        "---\n" + yaml.safe_dump(card, allow_unicode=True) + "---\n", encoding="utf-8"
    )
    return folder
