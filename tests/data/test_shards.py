"""Pre-tokenized zstd shards: round trip, compression, validation of hostile files, resume."""

from __future__ import annotations

from pathlib import Path

import msgpack
import numpy as np
import pytest
import zstandard
from tokenizers import Tokenizer

from kit.data.shards import ShardSource, ShardWriter, read_shard, write_shards
from kit.data.tokenizer import tokenizer_fingerprint
from kit.errors import DataSourceNotFound, EmptySource, InvalidShard

HEADER = {
    "format": "kit-token-shard",
    "version": 1,
    "dtype": "uint16",
    "vocab_size": 100,
    "tokenizer": "t",
    "block_documents": 4,
}


def documents(count: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [
        rng.integers(0, 100, size=int(rng.integers(0, 30))).astype(np.int32) for _ in range(count)
    ]


def raw_shard(path: Path, *objects: object) -> Path:
    """A shard file made of arbitrary msgpack objects (to build broken ones)."""
    path.write_bytes(
        zstandard.ZstdCompressor().compress(b"".join(msgpack.packb(item) for item in objects))
    )
    return path


def test_round_trip(tmp_path: Path) -> None:
    docs = documents(50)
    with ShardWriter(
        tmp_path / "a.kitshard.zst", vocab_size=100, tokenizer="t", block_documents=8
    ) as writer:
        for ids in docs:
            writer.write(ids)
    back = list(read_shard(tmp_path / "a.kitshard.zst", vocab_size=100, tokenizer="t"))
    assert len(back) == len(docs) and all(
        np.array_equal(x, y) for x, y in zip(back, docs, strict=True)
    )


def test_write_shards_splits_and_compresses(
    tokenizer: Tokenizer, corpus: dict[str, Path], tmp_path: Path
) -> None:
    text = corpus["oscar"].read_text(encoding="utf-8").splitlines()
    ids = [encoding.ids for encoding in tokenizer.encode_batch(text, add_special_tokens=False)]
    paths = write_shards(
        ids,
        tmp_path / "shards",
        vocab_size=1000,
        tokenizer=tokenizer_fingerprint(tokenizer),
        documents_per_shard=150,
        progress=False,
    )
    assert [path.name for path in paths] == [f"shard-0000{i}.kitshard.zst" for i in range(3)]
    back = [doc.tolist() for path in paths for doc in read_shard(path)]
    assert back == ids
    text_bytes = sum(len(line.encode("utf-8")) for line in text)
    shard_bytes = sum(path.stat().st_size for path in paths)
    assert (
        text_bytes / shard_bytes > 4
    )  # Bengali UTF-8 is ~3 bytes a character; ids are 2 bytes a piece


@pytest.mark.parametrize(
    ("objects", "problem"),
    [
        (({"format": "other"},), "is not a kit-token-shard"),
        (({**HEADER, "version": 2},), "format version 2"),
        (({**HEADER, "dtype": "float64"},), "dtype 'float64'"),
        (({**HEADER, "dtype": "uint16", "vocab_size": 70_000},), "vocab_size 70000"),
        (
            (HEADER, {"lengths": b"\x01\x00\x00\x00", "tokens": b"\x01\x00\x02\x00"}),
            "add up to 1, not 2",
        ),
        (
            (HEADER, {"lengths": b"\x01\x00\x00\x00", "tokens": b"\xff\x00"}),
            "token id 255 >= vocab_size 100",
        ),
        ((HEADER, {"lengths": b"\x01\x00\x00", "tokens": b""}), "bad size"),
        ((HEADER, {"lengths": [1], "tokens": b"\x01\x00"}), "not bytes"),
        ((HEADER, {"lengths": b"", "tokens": b"", "extra": 1}), "exactly the fields"),
        ((HEADER, {"end": True, "documents": 3, "tokens": 0}), "trailer says 3 documents"),
        ((HEADER, {"lengths": b"\x01\x00\x00\x00", "tokens": b"\x01\x00"}), "without a trailer"),
        (
            (HEADER, {"end": True, "documents": 0, "tokens": 0}, {"lengths": b"", "tokens": b""}),
            "after its trailer",
        ),
    ],
)
def test_hostile_shards_are_rejected(
    tmp_path: Path, objects: tuple[object, ...], problem: str
) -> None:
    path = raw_shard(tmp_path / "bad.kitshard.zst", *objects)
    with pytest.raises(InvalidShard, match=problem):
        list(read_shard(path))


def test_garbage_truncation_and_mismatches(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.kitshard.zst"
    garbage.write_bytes(b"definitely not zstd" * 10)
    with pytest.raises(InvalidShard, match="not valid zstd"):
        list(read_shard(garbage))
    good = tmp_path / "good.kitshard.zst"
    with ShardWriter(good, vocab_size=100, tokenizer="t") as writer:
        for ids in documents(200):
            writer.write(ids)
    truncated = tmp_path / "truncated.kitshard.zst"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(InvalidShard):
        list(read_shard(truncated))
    with pytest.raises(InvalidShard, match="written with tokenizer 't'"):
        list(read_shard(good, tokenizer="other"))
    with pytest.raises(InvalidShard, match="vocabulary of 100"):
        list(read_shard(good, vocab_size=1000))
    with pytest.raises(DataSourceNotFound, match="help:"):
        list(read_shard(tmp_path / "missing.kitshard.zst"))
    with pytest.raises(ValueError):
        ShardWriter(tmp_path / "x.kitshard.zst", vocab_size=10, tokenizer="t").write([10])


def test_shard_source_per_peer_order_and_resume(tmp_path: Path) -> None:
    docs = [doc for doc in documents(60, seed=1) if len(doc)]
    paths = [
        str(path)
        for path in write_shards(
            docs, tmp_path, vocab_size=100, tokenizer="t", documents_per_shard=10, progress=False
        )
    ]

    def source(seed: int) -> ShardSource:
        return ShardSource(
            "shards", paths, probability=1.0, seed=seed, vocab_size=100, tokenizer="t"
        )

    firsts = {source(seed).next_document().tobytes() for seed in range(6)}  # type: ignore[union-attr]
    assert len(firsts) > 1
    reader = source(3)
    for _ in range(23):
        reader.next_document()
    state = reader.state_dict()
    rest = []
    while (doc := reader.next_document()) is not None:
        rest.append(doc.tolist())
    resumed = source(3)
    resumed.load_state_dict(state)
    again = []
    while (doc := resumed.next_document()) is not None:
        again.append(doc.tolist())
    assert again == rest and len(rest) == len(docs) - 23
    assert resumed.counts().used == len(docs)


def test_shard_source_of_empty_documents_is_empty(tmp_path: Path) -> None:
    paths = write_shards([[], []], tmp_path, vocab_size=100, tokenizer="t", progress=False)
    source = ShardSource(
        "empty",
        [str(path) for path in paths],
        probability=1.0,
        seed=0,
        vocab_size=100,
        tokenizer="t",
    )
    with pytest.raises(EmptySource):
        source.next_document()
