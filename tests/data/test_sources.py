"""Streaming sources: filtering with counts, bad input, interleaving, per-peer shuffle, resume."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest

from kit.config import SourceConfig
from kit.data.sources import (
    DocumentStream,
    TextSource,
    counter_uniform,
    derive_seed,
    peer_shuffle_seed,
)
from kit.errors import ConfigError, DataSourceNotFound, EmptySource, InvalidText

from .conftest import BENGALI_SENTENCES, write_lines

GOOD = [
    f"{sentence} {BENGALI_SENTENCES[(i + 1) % len(BENGALI_SENTENCES)]}"
    for i, sentence in enumerate(BENGALI_SENTENCES)
]


def text_source(path: Path, **kwargs: object) -> TextSource:
    return TextSource(SourceConfig(path.stem, data_files=(str(path),)), **kwargs)  # type: ignore[arg-type]


def drain(source: TextSource) -> list[str]:
    documents = []
    while (document := source.next_document()) is not None:
        documents.append(document)
    return documents


@pytest.fixture
def messy_file(tmp_path: Path) -> Path:
    """5 good lines, 2 empty, 1 blank, 2 short, 1 with bytes that are not UTF-8."""
    path = tmp_path / "messy.txt"
    lines = [GOOD[0].encode(), b"", GOOD[1].encode(), b"   ", "ছোট".encode(), GOOD[2].encode()]
    lines += [
        "আমি ভাত \xff\xfe খাই।".encode("latin-1", errors="ignore") + b"\xff\xfe bad",
        b"",
        "হ্যাঁ।".encode(),
    ]
    lines += [GOOD[3].encode(), GOOD[4].encode()]
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_seeds_are_stable_and_peer_specific() -> None:
    assert derive_seed("a", 1, b"x") == derive_seed("a", 1, b"x")
    assert derive_seed("a", 1) != derive_seed("a1")  # parts are length-prefixed, not glued
    assert peer_shuffle_seed(b"peer-1", 0) != peer_shuffle_seed(b"peer-2", 0)
    assert peer_shuffle_seed(b"peer-1", 0) != peer_shuffle_seed(b"peer-1", 1)
    draws = [counter_uniform(123, i) for i in range(20_000)]
    assert min(draws) >= 0 and max(draws) < 1 and abs(sum(draws) / len(draws) - 0.5) < 0.01


def test_filters_count_every_dropped_line(messy_file: Path) -> None:
    source = text_source(messy_file, min_chars=8)
    assert drain(source) == GOOD[:5]
    counts = source.counts()
    assert (counts.read, counts.used, counts.empty, counts.too_short, counts.invalid_text) == (
        11,
        5,
        3,
        2,
        1,
    )
    assert counts.read == counts.used + counts.empty + counts.too_short + counts.invalid_text
    assert counts.epochs_completed == 1


def test_invalid_utf8_can_be_an_error(messy_file: Path) -> None:
    source = text_source(messy_file, min_chars=8, on_invalid_text="raise")
    with pytest.raises(InvalidText, match=r"not valid UTF-8.*help:"):
        drain(source)


def test_missing_file_is_a_typed_error(tmp_path: Path) -> None:
    with pytest.raises(DataSourceNotFound, match="help:"):
        text_source(tmp_path / "missing.txt")


def test_empty_source_and_fully_filtered_source(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(EmptySource, match="help:"):
        text_source(empty).next_document()
    short = write_lines(tmp_path / "short.txt", ["ক", "খ", ""])
    with pytest.raises(EmptySource, match=r"read 3, empty 1, shorter than min_chars=4: 2"):
        text_source(short, min_chars=4).next_document()


def test_json_source_same_code_path(tmp_path: Path) -> None:
    path = tmp_path / "docs.jsonl"
    records = [
        json.dumps({"id": i, "content": text}, ensure_ascii=False)
        for i, text in enumerate(GOOD[:3])
    ]
    records.insert(1, json.dumps({"id": 9, "content": ""}))
    write_lines(path, records)
    source = TextSource(
        SourceConfig("json", path="json", data_files=(str(path),), text_column="content")
    )
    assert drain(source) == GOOD[:3]
    assert source.counts().empty == 1
    wrong = TextSource(
        SourceConfig("json", path="json", data_files=(str(path),), text_column="text")
    )
    with pytest.raises(ConfigError, match="not a column"):
        wrong.next_document()


def test_json_with_bytes_that_are_not_utf8_is_an_error(tmp_path: Path) -> None:
    # pyarrow's JSON reader cannot skip one line, so this is an error whatever the policy.
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"text": "' + GOOD[0].encode() + b'"}\n{"text": "bad \xff bytes"}\n')
    source = TextSource(SourceConfig("bad", path="json", data_files=(str(path),)))
    with pytest.raises(InvalidText, match=r"not UTF-8.*help: re-encode"):
        drain(source)


def test_text_source_resumes_exactly_across_passes(corpus: dict[str, Path]) -> None:
    source = text_source(corpus["wiki"])
    for _ in range(290):
        source.next_document()
    state = json.loads(json.dumps(source.state_dict()))
    expected = [source.next_document() for _ in range(20)]
    assert expected[-1] is None  # the 300-document pass ends inside this stretch
    source.start_next_epoch()
    expected_next_pass = [source.next_document() for _ in range(5)]
    resumed = text_source(corpus["wiki"])
    resumed.load_state_dict(state)
    assert [resumed.next_document() for _ in range(20)] == expected
    resumed.start_next_epoch()
    assert [resumed.next_document() for _ in range(5)] == expected_next_pass
    assert resumed.counts() == source.counts()


def make_stream(
    corpus: dict[str, Path], seed: int, *, window: int = 40, repeat: bool = True
) -> DocumentStream:
    sources = [
        TextSource(SourceConfig("wiki", data_files=(str(corpus["wiki"]),), probability=0.23)),
        TextSource(SourceConfig("oscar", data_files=(str(corpus["oscar"]),), probability=0.77)),
    ]
    return DocumentStream(sources, seed=seed, window_size=window, repeat=repeat)


def test_interleaving_follows_the_probabilities(corpus: dict[str, Path]) -> None:
    stream = make_stream(corpus, seed=1)
    for _ in range(3000):
        stream.next_document()
    wiki, oscar = stream.statistics()
    share = wiki.used / (wiki.used + oscar.used)
    assert abs(share - 0.23) < 4 * (0.23 * 0.77 / (wiki.used + oscar.used)) ** 0.5
    assert wiki.epochs_completed >= 1 and oscar.epochs_completed >= 1  # repeat=True loops


def test_one_pass_without_repeat_yields_every_document_once(corpus: dict[str, Path]) -> None:
    documents = list(make_stream(corpus, seed=3, repeat=False))
    expected = [
        line for path in corpus.values() for line in path.read_text(encoding="utf-8").splitlines()
    ]
    assert collections.Counter(documents) == collections.Counter(expected)


def test_orders_depend_on_the_seed_only(corpus: dict[str, Path]) -> None:
    def first(seed: int) -> list[object]:
        stream = make_stream(corpus, seed)
        return [stream.next_document() for _ in range(60)]

    assert first(peer_shuffle_seed(b"alice", 0)) == first(peer_shuffle_seed(b"alice", 0))
    assert first(peer_shuffle_seed(b"alice", 0)) != first(peer_shuffle_seed(b"bob", 0))


@pytest.mark.parametrize("position", [0, 7, 40, 41, 133])
def test_document_stream_resumes_at_the_next_document(
    corpus: dict[str, Path], position: int
) -> None:
    stream = make_stream(corpus, seed=11)
    for _ in range(position):
        stream.next_document()
    state = json.loads(json.dumps(stream.state_dict()))
    expected = [stream.next_document() for _ in range(90)]
    resumed = make_stream(corpus, seed=11)
    resumed.load_state_dict(state)
    assert [resumed.next_document() for _ in range(90)] == expected
    assert resumed.statistics() == stream.statistics()


def test_many_files_are_read_in_a_per_peer_order_and_resume(tmp_path: Path) -> None:
    files = [
        write_lines(tmp_path / f"part{i}.txt", [f"{GOOD[j]} ফাইল {i}" for j in range(8)])
        for i in range(6)
    ]
    config = SourceConfig("parts", data_files=tuple(str(file) for file in files))
    firsts = {TextSource(config, shard_seed=seed).next_document() for seed in range(8)}
    assert len(firsts) > 1  # peers start on different files
    source = TextSource(config, shard_seed=5)
    for _ in range(19):
        source.next_document()
    state = source.state_dict()
    expected = drain(source)
    resumed = TextSource(config, shard_seed=5)
    resumed.load_state_dict(state)
    assert drain(resumed) == expected and len(expected) == 48 - 19
