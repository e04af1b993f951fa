"""The whole per-peer pipeline: orders per identity, exact resume, statistics, shards, bad input."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models

from kit.config import DataConfig, SourceConfig
from kit.data.pipeline import PretrainingPipeline
from kit.data.shards import write_shards
from kit.data.tokenizer import tokenizer_fingerprint
from kit.errors import ConfigError, DataSourceNotFound, EmptySource

from .conftest import write_lines

MakeConfig = Callable[..., DataConfig]


def first_batches(
    pipeline: PretrainingPipeline, count: int, batch_size: int = 8
) -> list[dict[str, torch.Tensor]]:
    batches = pipeline.batches(batch_size)
    return [next(batches) for _ in range(count)]


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[key].shape == b[key].shape and torch.equal(a[key], b[key]) for key in a
    )


def test_peers_see_different_orders_and_a_peer_repeats_its_own(
    tokenizer: Tokenizer, make_config: MakeConfig
) -> None:
    config = make_config()
    alice = first_batches(
        PretrainingPipeline.from_config(config, tokenizer, peer_identity=b"alice"), 3
    )
    alice_again = first_batches(
        PretrainingPipeline.from_config(config, tokenizer, peer_identity=b"alice"), 3
    )
    bob = first_batches(PretrainingPipeline.from_config(config, tokenizer, peer_identity=b"bob"), 3)
    reseeded = first_batches(
        PretrainingPipeline.from_config(
            make_config(shuffle_seed=1), tokenizer, peer_identity=b"alice"
        ),
        3,
    )
    assert all(same(x, y) for x, y in zip(alice, alice_again, strict=True))
    assert not any(same(x, y) for x, y in zip(alice, bob, strict=True))
    assert not any(same(x, y) for x, y in zip(alice, reseeded, strict=True))


@pytest.mark.parametrize("completed", [0, 1, 5, 17])
def test_resume_after_n_batches_yields_batch_n_plus_1(
    tokenizer: Tokenizer, make_config: MakeConfig, completed: int
) -> None:
    config = make_config()
    pipeline = PretrainingPipeline.from_config(config, tokenizer, peer_identity=b"volunteer")
    batches = pipeline.batches(8)
    for _ in range(completed):
        next(batches)
    state = json.loads(json.dumps(pipeline.state_dict()))  # what a checkpoint would store
    expected = [next(batches) for _ in range(4)]
    statistics = pipeline.statistics()

    restarted = PretrainingPipeline.from_config(config, tokenizer, peer_identity=b"volunteer")
    restarted.load_state_dict(state)
    resumed = restarted.batches(8)
    got = [next(resumed) for _ in range(4)]
    assert same(got[0], expected[0])  # exactly batch N+1
    assert all(same(x, y) for x, y in zip(got[1:], expected[1:], strict=True))
    assert restarted.statistics() == statistics


def test_resume_refuses_another_peers_state(tokenizer: Tokenizer, make_config: MakeConfig) -> None:
    pipeline = PretrainingPipeline.from_config(make_config(), tokenizer, peer_identity=b"alice")
    next(iter(pipeline))
    other = PretrainingPipeline.from_config(make_config(), tokenizer, peer_identity=b"bob")
    with pytest.raises(ConfigError, match="another peer identity"):
        other.load_state_dict(pipeline.state_dict())
    with pytest.raises(ConfigError, match="version"):
        other.load_state_dict({**pipeline.state_dict(), "version": 99})


def test_one_pass_accounts_for_every_document(
    tokenizer: Tokenizer, corpus: dict[str, Path], tmp_path: Path, make_config: MakeConfig
) -> None:
    lines = corpus["wiki"].read_text(encoding="utf-8").splitlines()[:40]
    messy = tmp_path / "messy.txt"
    messy.write_bytes(
        b"\n".join(
            [line.encode() for line in lines] + [b"", b"short", b"bad \xff\xfe bytes here!!"]
        )
        + b"\n"
    )
    config = make_config(sources=(SourceConfig("messy", data_files=(str(messy),)),), repeat=False)
    pipeline = PretrainingPipeline.from_config(config, tokenizer, peer_identity=b"counter")
    yielded = sum(len(batch["input_ids"]) for batch in pipeline.batches(8))
    statistics = pipeline.statistics()
    (source,) = statistics.sources
    assert (source.read, source.used, source.empty, source.too_short, source.invalid_text) == (
        43,
        40,
        1,
        1,
        1,
    )
    assert statistics.documents_read == source.used + statistics.documents_dropped
    assert statistics.examples.documents == 40
    assert statistics.examples_yielded == yielded == statistics.examples.examples > 0
    assert statistics.examples.single_sentence_chunks >= 0
    with pytest.raises(StopIteration):
        next(pipeline)


def test_examples_fit_and_carry_the_right_tensors(
    tokenizer: Tokenizer, make_config: MakeConfig
) -> None:
    pipeline = PretrainingPipeline.from_config(
        make_config(max_seq_length=32), tokenizer, peer_identity=b"shapes"
    )
    for batch in first_batches(pipeline, 10):
        assert batch["input_ids"].shape[1] <= 32
        assert (batch["input_ids"][:, 0] == 2).all()
        assert set(batch["sentence_order_label"].tolist()) <= {0, 1}
        picked = batch["labels"] != -100
        assert (batch["attention_mask"][picked] == 1).all()
    statistics = pipeline.statistics()
    assert (
        0.10 < statistics.examples.masked_tokens / statistics.examples.tokens < 0.16
    )  # 15% of non-special


def test_pretokenized_shards_mix_with_text_and_resume(
    tokenizer: Tokenizer, corpus: dict[str, Path], tmp_path: Path, make_config: MakeConfig
) -> None:
    text = corpus["oscar"].read_text(encoding="utf-8").splitlines()
    ids = [encoding.ids for encoding in tokenizer.encode_batch(text, add_special_tokens=False)]
    paths = write_shards(
        ids,
        tmp_path,
        vocab_size=1000,
        tokenizer=tokenizer_fingerprint(tokenizer),
        documents_per_shard=100,
        progress=False,
    )
    config = make_config(
        sources=(
            SourceConfig("wiki", data_files=(str(corpus["wiki"]),), probability=0.5),
            SourceConfig(
                "oscar-tokens",
                data_files=tuple(str(path) for path in paths),
                probability=0.5,
                pretokenized=True,
            ),
        )
    )
    pipeline = PretrainingPipeline.from_config(config, tokenizer, peer_identity=b"shards")
    batches = pipeline.batches(8)
    for _ in range(6):
        next(batches)
    state = pipeline.state_dict()
    expected = next(batches)
    wiki, shards = pipeline.statistics().sources
    assert wiki.used > 0 and shards.used > 0
    restarted = PretrainingPipeline.from_config(config, tokenizer, peer_identity=b"shards")
    restarted.load_state_dict(state)
    assert same(next(restarted.batches(8)), expected)


def test_bad_input_gives_typed_errors(
    tokenizer: Tokenizer, tmp_path: Path, make_config: MakeConfig
) -> None:
    with pytest.raises(DataSourceNotFound, match="help:"):
        PretrainingPipeline.from_config(
            make_config(sources=(SourceConfig("gone", data_files=(str(tmp_path / "gone.txt"),)),)),
            tokenizer,
            peer_identity=b"p",
        )
    empty = write_lines(tmp_path / "empty.txt", [])
    pipeline = PretrainingPipeline.from_config(
        make_config(sources=(SourceConfig("empty", data_files=(str(empty),)),)),
        tokenizer,
        peer_identity=b"p",
    )
    with pytest.raises(EmptySource, match="help:"):
        next(pipeline)
    with pytest.raises(ConfigError, match="data.sources"):
        PretrainingPipeline.from_config(DataConfig(), tokenizer, peer_identity=b"p")
    bare = Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>"))
    with pytest.raises(ConfigError, match="help:"):
        PretrainingPipeline.from_config(make_config(), bare, peer_identity=b"p")


@pytest.mark.sockets
def test_hub_names_take_the_same_path_as_local_files(
    tokenizer: Tokenizer, corpus: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import datasets.config

    from kit.testing.fake_hub import FakeHub

    text = corpus["oscar"].read_text(encoding="utf-8").splitlines()
    ids = [encoding.ids for encoding in tokenizer.encode_batch(text, add_special_tokens=False)]
    shard_paths = write_shards(
        ids,
        tmp_path / "shards",
        vocab_size=1000,
        tokenizer=tokenizer_fingerprint(tokenizer),
        documents_per_shard=200,
        progress=False,
    )
    with FakeHub() as hub, hub.patched_client(tmp_path / "hf_home"):
        monkeypatch.setattr(datasets.config, "HF_ENDPOINT", hub.endpoint)  # frozen at import too
        hub.create_repo("neuropark/bn-corpus", repo_type="dataset")
        files = {"data/wiki.txt": corpus["wiki"].read_bytes()}
        files.update({f"tokens/{path.name}": path.read_bytes() for path in shard_paths})
        hub.commit("neuropark/bn-corpus", files, "add corpus", repo_type="dataset")
        config = make_hub_config(shard_paths)
        hub_pipeline = PretrainingPipeline.from_config(config, tokenizer, peer_identity=b"hub")
        from_hub = first_batches(hub_pipeline, 5)
        wiki, tokens = hub_pipeline.statistics().sources
        assert wiki.used > 0 and tokens.used > 0
        with pytest.raises(DataSourceNotFound, match="help:"):
            PretrainingPipeline.from_config(
                DataConfig(sources=(SourceConfig("gone", path="neuropark/missing"),)),
                tokenizer,
                peer_identity=b"hub",
            )
    local = DataConfig(
        sources=(
            SourceConfig("wiki", data_files=(str(corpus["wiki"]),), probability=0.5),
            SourceConfig(
                "tokens",
                data_files=tuple(str(path) for path in shard_paths),
                probability=0.5,
                pretokenized=True,
            ),
        ),
        **{key: value for key, value in config.to_dict().items() if key != "sources"},
    )
    from_disk = first_batches(
        PretrainingPipeline.from_config(local, tokenizer, peer_identity=b"hub"), 5
    )
    assert all(same(x, y) for x, y in zip(from_hub, from_disk, strict=True))


def make_hub_config(shard_paths: list[Path]) -> DataConfig:
    base = "hf://datasets/neuropark/bn-corpus/tokens/"
    return DataConfig(
        sources=(
            SourceConfig("wiki", path="neuropark/bn-corpus", probability=0.5),
            SourceConfig(
                "tokens",
                data_files=tuple(base + path.name for path in shard_paths),
                probability=0.5,
                pretokenized=True,
            ),
        ),
        max_seq_length=64,
        shuffle_buffer_size=40,
        tokenize_batch_size=16,
    )
