"""Served data end to end over a real peer's HTTP port: the organizer's text becomes shards once
(cached), volunteers download them by range, resume, verify digests, spread over shards, survive
a bad digest and a coordinator that does not answer, and read exactly what the organizer wrote."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from kit.config import DataConfig, SourceConfig
from kit.data import remote
from kit.data.manifest import DataManifest
from kit.data.pipeline import PretrainingPipeline
from kit.data.remote import ServedData, ServedShardSource, download_shard
from kit.data.serving import (
    MAX_RANGE_BYTES,
    DataServer,
    parse_range,
    prepare_served_data,
    prepare_source,
)
from kit.data.shards import read_shard
from kit.data.sources import derive_seed
from kit.data.tokenizer import tokenizer_fingerprint
from kit.errors import (
    DataSourceNotFound,
    DataSourceUnreachable,
    InvalidShard,
    ShardDigestMismatch,
)
from kit.http_client import http_request
from kit.p2p.peer import create_peer
from kit.runtime import get_runtime

pytestmark = pytest.mark.sockets


@pytest.fixture
def data_config(corpus: dict[str, Path]) -> DataConfig:
    return DataConfig(
        sources=(
            SourceConfig("files", data_files=(str(corpus["oscar"]),), probability=0.5),
            SourceConfig("wiki", data_files=(str(corpus["wiki"]),), probability=0.5),
        ),
        max_seq_length=64,
        shuffle_buffer_size=40,
        tokenize_batch_size=16,
    )


@pytest.fixture
def served(
    data_config: DataConfig, tokenizer: Tokenizer, tmp_path: Path
) -> Iterator[tuple[DataServer, str]]:
    """The organizer's two sources as shards, served by a real peer; (server, manifest URL)."""
    server = prepare_served_data(
        data_config, tokenizer, tmp_path / "state", shard_tokens=3_000, progress=False
    )
    assert server is not None
    peer = get_runtime().call(create_peer(host="127.0.0.1"), timeout=30)
    server.register(peer)
    try:
        yield server, f"http://127.0.0.1:{peer.listen_port}/api/data/manifest.json"
    finally:
        get_runtime().call(peer.shutdown(), timeout=30)


def read_all(source: ServedShardSource) -> list[np.ndarray]:
    documents = []
    while (document := source.next_document()) is not None:
        documents.append(document)
    return documents


def test_text_becomes_shards_once_and_again_when_the_files_change(
    data_config: DataConfig, tokenizer: Tokenizer, tmp_path: Path, corpus: dict[str, Path]
) -> None:
    source = data_config.sources[0]
    assert source.served and not SourceConfig("hub", path="org/data").served
    assert not SourceConfig("url", data_files=("https://example.org/a.txt",)).served
    shards, paths = prepare_source(
        source, data_config, tokenizer, tmp_path, shard_tokens=3_000, progress=False
    )
    assert len(shards.shards) > 3  # small shards: peers get different first ones
    lines = [line for line in corpus["oscar"].read_text("utf-8").splitlines() if line.strip()]
    assert shards.documents == len(lines)  # every line was long enough
    expected = [e.ids for e in tokenizer.encode_batch(lines, add_special_tokens=False)]
    written = [
        ids.tolist()
        for shard in shards.shards
        for ids in read_shard(paths[shard.sha256], tokenizer=tokenizer_fingerprint(tokenizer))
    ]
    assert written == expected  # what volunteers get is the organizer's text, tokenized
    stamps = {path: path.stat().st_mtime_ns for path in paths.values()}
    again, same_paths = prepare_source(
        source, data_config, tokenizer, tmp_path, shard_tokens=3_000, progress=False
    )
    assert again == shards and {p: p.stat().st_mtime_ns for p in same_paths.values()} == stamps
    changed = tmp_path / "changed.txt"
    changed.write_text("".join(line + "\n" for line in lines[:50]), "utf-8")
    moved = dataclasses.replace(source, data_files=(str(changed),))
    smaller, _ = prepare_source(moved, data_config, tokenizer, tmp_path, progress=False)
    assert smaller.documents == 50
    assert (
        len(list((tmp_path / next(tmp_path.glob("files-*")).name).iterdir())) == 1
    )  # old cache gone


def test_missing_files_are_a_typed_error_with_help(
    data_config: DataConfig, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    gone = SourceConfig("gone", data_files=(str(tmp_path / "nothing" / "*.txt"),))
    with pytest.raises(DataSourceNotFound, match="no file matches .* help:"):
        prepare_source(gone, data_config, tokenizer, tmp_path, progress=False)


def test_ranges_are_parsed_and_bounded() -> None:
    assert parse_range(None, 100) is None
    assert parse_range("bytes=0-9", 100) == (0, 9)
    assert parse_range("bytes=90-", 100) == (90, 99)
    assert parse_range("bytes=-5", 100) == (95, 99)
    assert parse_range("bytes=10-500", 100) == (10, 99)
    assert parse_range(f"bytes=0-{10 * MAX_RANGE_BYTES}", 20 * MAX_RANGE_BYTES) == (
        0,
        MAX_RANGE_BYTES - 1,
    )
    for bad in ("bytes=100-", "bytes=5-2", "bytes=0-1,4-5", "items=0-1", "bytes=-"):
        with pytest.raises(ValueError):
            parse_range(bad, 100)


def test_shards_download_by_range_resume_and_match_the_organizer(
    served: tuple[DataServer, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server, manifest_url = served
    data = ServedData.fetch(manifest_url, tmp_path / "cache")
    entry = data.manifest.sources["files"].shards[0]
    url = manifest_url.replace("manifest.json", "shard") + f"?sha256={entry.sha256}"
    asked: list[str] = []

    def spy(*args, **kwargs):
        asked.append(kwargs["headers"]["Range"])
        answer = http_request(*args, **kwargs)
        assert len(answer.body) <= kwargs["limit"]  # one range in memory at a time
        return answer

    monkeypatch.setattr(remote, "http_request", spy)
    original = server._paths[entry.sha256].read_bytes()
    target = tmp_path / "one.kitshard.zst"
    target.with_name(target.name + ".part").write_bytes(original[:1000])  # a broken transfer
    download_shard(url, entry, target, chunk_bytes=512)
    assert target.read_bytes() == original
    assert asked[0] == "bytes=1000-1511"  # resumed where it stopped, in ranges of 512 bytes
    assert len(asked) == -(-(entry.bytes - 1000) // 512) > 2
    # Bytes that are not the published ones are thrown away, never read.
    other = tmp_path / "two.kitshard.zst"
    other.with_name(other.name + ".part").write_bytes(b"\0" * 1000)
    with pytest.raises(ShardDigestMismatch, match="help:"):
        download_shard(url, entry, other, chunk_bytes=512)
    assert not other.with_name(other.name + ".part").exists() and not other.exists()


def test_a_shard_with_a_wrong_digest_is_retried_later_and_the_pass_goes_on(
    served: tuple[DataServer, str], tmp_path: Path
) -> None:
    server, manifest_url = served
    shards = server.manifest.sources["files"]
    bad = shards.shards[1]
    broken = tmp_path / "flipped.kitshard.zst"
    content = bytearray(server._paths[bad.sha256].read_bytes())
    content[len(content) // 2] ^= 0xFF
    broken.write_bytes(bytes(content))
    server._paths[bad.sha256] = broken
    data = ServedData.fetch(manifest_url, tmp_path / "cache")
    source = data.open_source(
        SourceConfig("files", data_files=("x",)),
        seed=7,
        vocab_size=shards.vocab_size,
        tokenizer=shards.tokenizer,
    )
    documents = read_all(source)  # no crash
    assert source.digest_failures == 2  # tried, deferred, tried again at the end, left out
    assert len(documents) == sum(shard.documents for shard in shards.shards if shard is not bad)
    assert source.counts().epochs_completed == 1


def test_peers_spread_over_shards_and_resume_where_they_were(
    served: tuple[DataServer, str], tmp_path: Path
) -> None:
    server, manifest_url = served
    shards = server.manifest.sources["files"]
    data = ServedData.fetch(manifest_url, tmp_path / "cache", ssl_context=None)
    config = SourceConfig("files", data_files=("x",))

    def source(seed: int) -> ServedShardSource:
        return data.open_source(
            config, seed=seed, vocab_size=shards.vocab_size, tokenizer=shards.tokenizer
        )

    firsts = {tuple(source(derive_seed("peer", i)).next_document().tolist()) for i in range(8)}
    assert len(firsts) >= 3  # volunteers do not all start on the same shard
    reader = source(11)
    for _ in range(shards.shards[0].documents + 3):  # into the second shard
        reader.next_document()
    state = json.loads(json.dumps(reader.state_dict()))
    expected = [reader.next_document().tolist() for _ in range(5)]
    resumed = source(11)
    resumed.load_state_dict(state)
    assert [resumed.next_document().tolist() for _ in range(5)] == expected
    assert len(list((tmp_path / "cache").glob("*.kitshard.zst"))) <= remote.KEEP_SHARDS


def test_the_pipeline_reads_served_sources_like_local_ones(
    served: tuple[DataServer, str], data_config: DataConfig, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    _, manifest_url = served
    data = ServedData.fetch(manifest_url, tmp_path / "cache")
    pipeline = PretrainingPipeline.from_config(
        data_config, tokenizer, peer_identity=b"volunteer", served=data
    )
    batch = next(pipeline.batches(4))
    assert batch["input_ids"].shape[0] == 4
    files, wiki = pipeline.statistics().sources
    assert files.used > 0 and wiki.used > 0
    with pytest.raises(InvalidShard, match="another tokenizer|written with tokenizer"):
        data.open_source(data_config.sources[0], seed=1, vocab_size=999, tokenizer="not-this-one")


def test_a_coordinator_that_does_not_answer_is_waited_for_then_reported(
    served: tuple[DataServer, str], tmp_path: Path
) -> None:
    server, manifest_url = served
    shards = server.manifest.sources["files"]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}/api/data/manifest.json"
    data = ServedData(closed, server.manifest, tmp_path / "cache")
    waits: list[float] = []
    source = ServedShardSource(
        shards, data, probability=1.0, seed=1, unreachable_timeout=0.3, sleep=waits.append
    )
    with pytest.raises(DataSourceUnreachable, match="help:"):
        source.next_document()
    assert waits and waits == sorted(waits)  # backing off


def test_a_hostile_manifest_is_refused() -> None:
    for bad in (
        [],
        {"version": 2, "sources": {}},
        {"version": 1, "sources": {"a": {"tokenizer": "t", "vocab_size": 10, "shards": []}}},
        {
            "version": 1,
            "sources": {
                "a": {
                    "tokenizer": "t",
                    "vocab_size": 10,
                    "shards": [{"sha256": "zz", "bytes": 1, "documents": 1, "tokens": 1}],
                }
            },
        },
        {
            "version": 1,
            "sources": {
                "a": {
                    "tokenizer": "t",
                    "vocab_size": 10,
                    "shards": [{"sha256": "a" * 64, "bytes": -1, "documents": 1, "tokens": 1}],
                }
            },
        },
    ):
        with pytest.raises(InvalidShard, match="help:"):
            DataManifest.from_dict(bad)


def test_the_server_answers_ranges_and_refuses_the_rest(served: tuple[DataServer, str]) -> None:
    server, manifest_url = served
    entry = server.manifest.sources["wiki"].shards[0]
    url = manifest_url.replace("manifest.json", "shard") + f"?sha256={entry.sha256}"
    whole = http_request(url)  # small: answered in one piece
    assert whole.status == 200 and len(whole.body) == entry.bytes
    part = http_request(url, headers={"Range": "bytes=10-19"})
    assert part.status == 206 and part.body == whole.body[10:20]
    assert part.headers["content-range"] == f"bytes 10-19/{entry.bytes}"
    for headers in ({"Range": f"bytes={entry.bytes}-"}, {}):
        target = url if headers else url.replace(entry.sha256, "0" * 64)
        with pytest.raises(Exception, match="HTTP 41[6]|HTTP 404"):
            http_request(target, headers=headers)
    assert os.path.getsize(server._paths[entry.sha256]) == entry.bytes
