"""Task datasets through ``datasets.load_dataset``: schemas, clear errors, label alignment."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kit.errors import DatasetSchemaError, UnknownTask
from kit.evaluation.metrics import IGNORE_INDEX
from kit.evaluation.tasks import (
    NCC,
    NER,
    DatasetSource,
    align_labels,
    collate,
    encode,
    get_task,
    load_task_data,
)
from tests.evaluation import tiny
from tests.evaluation.conftest import TinyWorld


def _write_jsonl(folder: Path, rows: list[dict], splits=("train", "validation", "test")) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for split in splits:
        lines = [json.dumps(row, ensure_ascii=False) for row in rows]
        (folder / f"{split}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder


def test_task_names_and_aliases() -> None:
    assert get_task("ner") is NER and get_task("NCC") is NCC
    assert get_task("wikiann") is NER and get_task("sna.bn") is NCC


def test_unknown_task_names_the_known_ones() -> None:
    with pytest.raises(UnknownTask) as caught:
        get_task("squad")
    message = str(caught.value)
    assert "'squad'" in message and "ner" in message and "ncc" in message and "help:" in message


def test_wikiann_schema_from_parquet_keeps_the_class_labels(world: TinyWorld) -> None:
    data = load_task_data("ner", DatasetSource(str(world.ner), cache_dir=world.cache))
    assert data.label_names == tuple(tiny.NER_TAGS)
    assert set(data.splits) == {"train", "validation", "test"}
    assert data.splits["train"].column_names == ["tokens", "ner_tags", "langs", "spans"]
    assert len(data.split("train", limit=5)) == 5


def test_sna_schema_from_json_gets_class_labels_from_the_card(world: TinyWorld) -> None:
    data = load_task_data(NCC, DatasetSource(str(world.ncc), cache_dir=world.cache))
    assert data.label_names == tuple(tiny.NCC_LABELS)
    assert data.splits["test"].features["label"].names == tiny.NCC_LABELS


def test_plain_ids_or_names_get_the_task_labels(tmp_path: Path) -> None:
    folder = _write_jsonl(tmp_path / "ids", [{"text": "ক্রিকেট খেলা", "label": 3}])
    data = load_task_data("ncc", DatasetSource(str(folder), cache_dir=str(tmp_path / "c")))
    assert data.label_names == NCC.label_names
    assert data.splits["train"][0]["label"] == 3
    folder = _write_jsonl(
        tmp_path / "names", [{"tokens": ["রহিম", "এল"], "ner_tags": ["B-PER", "O"]}]
    )
    data = load_task_data("ner", DatasetSource(str(folder), cache_dir=str(tmp_path / "c")))
    assert data.splits["train"][0]["ner_tags"] == [1, 0]


def test_missing_columns_are_named(tmp_path: Path) -> None:
    folder = _write_jsonl(tmp_path / "bad", [{"words": ["a"], "ner_tags": [0]}])
    with pytest.raises(DatasetSchemaError) as caught:
        load_task_data("ner", DatasetSource(str(folder), cache_dir=str(tmp_path / "c")))
    message = str(caught.value)
    assert "lacks column(s) tokens;" in message and "words" in message and "help:" in message
    folder = _write_jsonl(tmp_path / "bad2", [{"content": "x", "category": 1}])
    with pytest.raises(DatasetSchemaError, match="lacks column\\(s\\) text, label"):
        load_task_data("ncc", DatasetSource(str(folder), cache_dir=str(tmp_path / "c")))


def test_non_iob_tags_and_unknown_label_names_are_refused(tmp_path: Path) -> None:
    from datasets import ClassLabel, Dataset, Features, Sequence, Value

    features = Features(
        {
            "tokens": Sequence(Value("string")),
            "ner_tags": Sequence(ClassLabel(names=["O", "PERSON"])),
        }
    )
    folder = tmp_path / "bio"
    folder.mkdir()
    Dataset.from_dict({"tokens": [["a"]], "ner_tags": [[1]]}, features=features).to_parquet(
        str(folder / "train.parquet")
    )
    with pytest.raises(DatasetSchemaError, match="IOB2"):
        load_task_data("ner", DatasetSource(str(folder), cache_dir=str(tmp_path / "c")))
    folder = _write_jsonl(tmp_path / "names", [{"text": "x", "label": "weather"}])
    with pytest.raises(DatasetSchemaError, match="neither class ids nor the names"):
        load_task_data("ncc", DatasetSource(str(folder), cache_dir=str(tmp_path / "c")))


def test_out_of_range_label_and_missing_split(tmp_path: Path, world: TinyWorld) -> None:
    folder = _write_jsonl(tmp_path / "range", [{"text": "x", "label": 9}], splits=("train",))
    data = load_task_data("ncc", DatasetSource(str(folder), cache_dir=str(tmp_path / "c")))
    with pytest.raises(DatasetSchemaError, match="outside 0..5"):
        encode(data, "train", world.tokenizer, max_length=32)
    with pytest.raises(DatasetSchemaError, match="no 'test' split"):
        data.split("test")


def test_align_labels_first_sub_token_only() -> None:
    # [CLS] w0 w1 w1 w1 w2 [SEP]
    word_ids = [None, 0, 1, 1, 1, 2, None]
    assert align_labels(word_ids, [5, 1, 0]) == [
        IGNORE_INDEX,
        5,
        1,
        IGNORE_INDEX,
        IGNORE_INDEX,
        0,
        IGNORE_INDEX,
    ]


def test_encode_ner_labels_each_word_once(world: TinyWorld) -> None:
    data = load_task_data("ner", DatasetSource(str(world.ner), cache_dir=world.cache))
    examples = encode(data, "test", world.tokenizer, max_length=64)
    rows = data.splits["test"]
    split_words = 0
    for example, tags in zip(examples, rows["ner_tags"], strict=True):
        labelled = [label for label in example["labels"] if label != IGNORE_INDEX]
        assert labelled == tags  # every word scored once, in order
        split_words += len(example["input_ids"]) - 2 > len(tags)
    assert split_words > 0  # the tiny tokenizer does split some words into pieces


def test_truncation_drops_words_from_scoring(world: TinyWorld) -> None:
    data = load_task_data("ner", DatasetSource(str(world.ner), cache_dir=world.cache))
    examples = encode(data, "test", world.tokenizer, max_length=4)
    assert all(len(example["input_ids"]) <= 4 for example in examples)
    assert all(sum(label != IGNORE_INDEX for label in e["labels"]) <= 2 for e in examples)


def test_collate_pads_ids_and_labels() -> None:
    batch = collate(
        [
            {"input_ids": [2, 7, 3], "attention_mask": [1, 1, 1], "labels": [-100, 1, -100]},
            {"input_ids": [2, 3], "attention_mask": [1, 1], "labels": [-100, -100]},
        ],
        pad_token_id=0,
    )
    assert batch["input_ids"].tolist() == [[2, 7, 3], [2, 3, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["labels"].tolist() == [[-100, 1, -100], [-100, -100, -100]]
    batch = collate([{"input_ids": [2], "labels": 4}, {"input_ids": [2, 5], "labels": 1}], 0)
    assert batch["labels"].tolist() == [4, 1]
