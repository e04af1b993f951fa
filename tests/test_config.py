"""Run configuration: defaults, validation with hints, YAML/JSON round trips, no torch."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kit.config import (
    AccessConfig,
    CheckpointConfig,
    CollaborationConfig,
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    RunConfig,
    SourceConfig,
    TokenizerConfig,
    load_config_file,
)
from kit.config.run import PEER_LOCAL_FIELDS
from kit.errors import ConfigError
from kit.p2p.identity import Identity, PeerID, b58encode

WIKI = {"name": "wiki", "path": "lhoestq/wikipedia_bn", "probability": 0.23}
OSCAR = {
    "name": "oscar",
    "path": "oscar",
    "subset": "unshuffled_deduplicated_bn",
    "probability": 0.77,
}


def test_defaults_are_the_sahajbert_recipe() -> None:
    tokenizer = TokenizerConfig()
    assert (
        tokenizer.preset,
        tokenizer.vocab_size,
        tokenizer.lowercase,
        tokenizer.model_max_length,
    ) == ("bengali", 32_000, True, 512)
    data = DataConfig()
    assert (data.max_seq_length, data.shuffle_buffer_size, data.mlm_probability) == (
        512,
        10_000,
        0.15,
    )
    assert (
        data.mask_replace_probability,
        data.random_replace_probability,
        data.sop_swap_probability,
    ) == (0.8, 0.1, 0.5)
    assert (
        data.whole_word_masking is False and data.repeat is True and data.on_invalid_text == "skip"
    )


def test_sahajbert_sources_round_trip_through_yaml(tmp_path: Path) -> None:
    data = DataConfig.from_dict({"sources": [WIKI, OSCAR], "max_seq_length": 256})
    assert [source.probability for source in data.sources] == [0.23, 0.77]
    path = tmp_path / "run.yaml"
    path.write_text(
        yaml.safe_dump({"data": data.to_dict(), "tokenizer": {"train_sources": "oscar"}}),
        encoding="utf-8",
    )
    assert DataConfig.from_file(path) == data
    assert TokenizerConfig.from_file(path).train_sources == ("oscar",)
    json_path = tmp_path / "run.json"
    json_path.write_text(json.dumps({"data": data.to_dict()}), encoding="utf-8")
    assert DataConfig.from_file(json_path) == data
    assert TokenizerConfig.from_file(json_path) == TokenizerConfig()  # absent section: defaults
    assert data.source_named("oscar").subset == "unshuffled_deduplicated_bn"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"sources": [WIKI, {**OSCAR, "probability": 0.7}]}, r"must sum to 1, got 0\.93"),
        ({"sources": [WIKI, {**WIKI}]}, "two sources named 'wiki'"),
        ({"sources": [{**WIKI, "probability": 0}]}, r"must be in \(0, 1\]"),
        ({"sources": [{"name": "local", "path": "text"}]}, "data_files"),
        ({"sources": [{"path": "text", "data_files": "a.txt"}]}, "name"),
        ({"max_seq_lenght": 128}, "did you mean 'max_seq_length'"),
        ({"max_seq_length": True}, "must be an integer"),
        ({"max_seq_length": 4}, "must be >= 8"),
        ({"mlm_probability": 1.5}, r"must be in \(0, 1\]"),
        ({"mlm_probability": "0.15"}, "must be a number"),
        (
            {"mask_replace_probability": 0.95, "random_replace_probability": 0.1},
            "must not exceed 1",
        ),
        ({"on_invalid_text": "ignore"}, "must be one of 'skip', 'raise'"),
        ({"whole_word_masking": "yes"}, "true or false"),
        ({"sources": "not a list"}, "must be a mapping"),
    ],
)
def test_bad_data_config_names_the_field_and_helps(data: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        DataConfig.from_dict(data)
    assert "help:" in str(caught.value)


def test_bad_tokenizer_config() -> None:
    with pytest.raises(ConfigError, match="preset.*help:"):
        TokenizerConfig(preset="thai")
    with pytest.raises(ConfigError, match="vocab_size"):
        TokenizerConfig.from_dict({"vocab_size": 10})
    with pytest.raises(ConfigError, match="did you mean 'vocab_size'"):
        TokenizerConfig.from_dict({"vocabsize": 1000})
    with pytest.raises(ConfigError, match="max_train_documents"):
        TokenizerConfig(max_train_documents=0)


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot be read.*help:"):
        load_config_file(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("data: [unclosed", encoding="utf-8")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config_file(broken)
    listing = tmp_path / "list.yaml"
    listing.write_text("- a\n- b\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="mapping"):
        DataConfig.from_file(listing)
    with pytest.raises(ConfigError, match="valid names: 'wiki'"):
        DataConfig(sources=(SourceConfig.from_dict({**WIKI, "probability": 1}),)).source_named(
            "oscar"
        )


def test_config_is_frozen_and_torch_free() -> None:
    with pytest.raises(AttributeError):
        DataConfig().max_seq_length = 128  # type: ignore[misc]
    code = "import sys, kit.config; sys.exit('torch' in sys.modules or 'datasets' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


# --- RunConfig: every section together --------------------------------------------------------

AUTHORITY = Identity.generate()
AUTHORITY_KEY = b58encode(AUTHORITY.public_key)
COORDINATOR = f"/ip4/127.0.0.1/tcp/31337/ws/p2p/{PeerID.from_public_key(AUTHORITY.public_key)}"


def _full_demo() -> RunConfig:
    """tiny_demo with every optional field set, so round trips cover them."""
    config = RunConfig.tiny_demo(data_files=("corpus/a.txt", "corpus/b*.txt"))
    return dataclasses.replace(
        config,
        tokenizer=dataclasses.replace(config.tokenizer, train_sources=("demo",)),
        access=AccessConfig(
            usernames=("alice", "bob.b"),
            organizations=("neuropark",),
            authority_public_key=AUTHORITY_KEY,
            coordinator=COORDINATOR,
            token_lifetime=600,
        ),
        checkpoint=CheckpointConfig(hub_repo="neuropark/demo-albert", keep_last=3),
    )


def test_run_defaults_are_sahajbert() -> None:
    config = RunConfig()
    model = config.model
    assert (model.hidden_size, model.num_hidden_layers, model.num_attention_heads) == (1024, 24, 16)
    assert (model.intermediate_size, model.embedding_size, model.vocab_size) == (4096, 128, 32_000)
    assert model.max_position_embeddings == 512
    optimizer = config.optimizer
    assert (optimizer.name, optimizer.lr, optimizer.betas, optimizer.eps) == (
        "lamb",
        0.00176,
        (0.9, 0.999),
        1e-6,
    )
    assert (optimizer.weight_decay, optimizer.clip_grad_norm, optimizer.warmup_steps) == (
        0.01,
        1.0,
        5_000,
    )
    assert config.collaboration.target_batch_size == 4096
    assert config.collaboration.grad_compression == "fp16"
    assert RunConfig.from_dict({}) == config == RunConfig.from_dict(config.to_dict())
    tiny = ModelConfig.tiny()
    assert (tiny.hidden_size, tiny.num_hidden_layers, tiny.vocab_size) == (128, 2, 8_000)


def test_tiny_demo_is_complete_and_small() -> None:
    demo = RunConfig.tiny_demo()
    assert demo.model == ModelConfig.tiny()
    assert demo.data.sources[0].data_files == ("demo_corpus/*.txt",)
    assert demo.collaboration.target_batch_size <= 128
    assert demo.collaboration.matchmaking_time <= 5
    assert demo.tokenizer.model_max_length == demo.data.max_seq_length
    assert RunConfig.from_dict(demo.to_dict()) == demo


@pytest.mark.parametrize("suffix", [".yaml", ".yml", ".json"])
def test_run_config_round_trips_through_files(tmp_path: Path, suffix: str) -> None:
    config = _full_demo()
    path = config.to_file(tmp_path / f"run{suffix}")
    loaded = RunConfig.from_file(path)
    assert loaded == config
    assert loaded.config_hash() == config.config_hash()
    assert loaded.access.usernames == ("alice", "bob.b")
    # The existing per-section readers read the same file.
    assert DataConfig.from_file(path) == config.data


def test_yaml_spellings_are_normalized(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(
        "optimizer: {lr: 1, betas: [0, 0.5]}\ncollaboration: {matchmaking_time: 5}\naccess:\n",
        encoding="utf-8",
    )
    config = RunConfig.from_file(path)
    assert isinstance(config.optimizer.lr, float) and config.optimizer.betas == (0.0, 0.5)
    assert config == RunConfig.from_dict(config.to_dict())
    assert config.access == AccessConfig()  # a null section gets its defaults


def _replace(config: RunConfig, section: str, **changes: object) -> RunConfig:
    return dataclasses.replace(
        config, **{section: dataclasses.replace(getattr(config, section), **changes)}
    )


BAD_RUNS: list[tuple[dict[str, object], str]] = [
    ({"modle": {}}, "did you mean 'model'"),
    ({"model": {"hiden_size": 64}}, "did you mean 'hidden_size'"),
    ({"model": {"hidden_size": 100, "num_attention_heads": 16}}, "must divide hidden_size"),
    ({"model": {"num_hidden_groups": 5}}, "must divide num_hidden_layers"),
    ({"model": {"hidden_act": "tanh"}}, "must be one of"),
    ({"model": {"architecture": "gpt2"}}, "must be one of 'albert'"),
    ({"model": {"hidden_dropout_prob": 2}}, r"must be in \[0, 1\]"),
    ({"model": {"layer_norm_eps": 0}}, "must be > 0"),
    ({"model": {"pad_token_id": 32_000}}, "must be <= 31999"),
    ({"model": {"vocab_size": 1000}}, "smaller than tokenizer.vocab_size"),
    ({"model": {"max_position_embeddings": 256}}, "shorter than data.max_seq_length"),
    ({"model": {"type_vocab_size": 1}}, "two segments"),
    ({"tokenizer": {"model_max_length": 256}}, "differs from data.max_seq_length"),
    (
        {
            "tokenizer": {"train_sources": ["oscar"]},
            "data": {"sources": [WIKI | {"probability": 1}]},
        },
        "not in data.sources",
    ),
    ({"optimizer": {"name": "sgd"}}, "must be one of 'lamb', 'lamb8bit', 'adamw'"),
    ({"optimizer": {"lr": 0}}, "must be > 0"),
    ({"optimizer": {"lr": "1e-3"}}, "must be a number"),
    ({"optimizer": {"betas": [0.9]}}, "must be two numbers"),
    ({"optimizer": {"betas": [0.9, 1.0]}}, "betas"),
    ({"optimizer": {"clip_grad_norm": -1}}, "clip_grad_norm"),
    ({"optimizer": {"warmup_steps": 10, "total_steps": 5}}, "must not exceed total_steps"),
    ({"optimizer": {"schedule": "cosine"}}, "must be one of 'linear', 'constant'"),
    ({"collaboration": {"run_id": "my run!"}}, "letters, digits"),
    ({"collaboration": {"run_id": ""}}, "non-empty"),
    (
        {"collaboration": {"batch_size_per_step": 64, "target_batch_size": 32}},
        "must not exceed target_batch_size",
    ),
    ({"collaboration": {"target_batch_size": 0}}, "must be >= 1"),
    ({"collaboration": {"grad_compression": "float16"}}, "must be one of 'none', 'fp16'"),
    ({"collaboration": {"state_compression": "int8"}}, "blockwise8bit"),
    ({"collaboration": {"matchmaking_time": 30, "averaging_timeout": 20}}, "must exceed"),
    ({"collaboration": {"averaging_timeout": float("nan")}}, "must be a number"),
    ({"collaboration": {"target_group_size": 1}}, "must be >= 2"),
    ({"access": {"usernames": ["@alice"]}}, "not a Hugging Face name"),
    ({"access": {"usernames": 5}}, "must be a list"),
    ({"access": {"open": "yes"}}, "true or false"),
    ({"access": {"authority_public_key": "0OIl", "coordinator": COORDINATOR}}, "not base58"),
    ({"access": {"authority_public_key": "abc", "coordinator": COORDINATOR}}, "not an Ed25519"),
    ({"access": {"coordinator": "127.0.0.1:31337"}}, "is not a kit address"),
    ({"access": {"token_lifetime": 5}}, "must be >= 60"),
    ({"access": {"check_seconds": 0.1}}, "must be >= 0.5"),
    ({"checkpoint": {"hub_repo": "no-owner"}}, "repo id"),
    ({"checkpoint": {"every_epochs": 0}}, "must be >= 1"),
    ({"checkpoint": {"push_every_minutes": -1}}, "must be >= 0"),
    ({"checkpoint": {"keep_last": 0}}, "keep at least 1"),
    ({"checkpoint": {"folder": ""}}, "non-empty"),
    ({"model": [1, 2]}, "must be a mapping"),
]


@pytest.mark.parametrize(("data", "message"), BAD_RUNS)
def test_bad_run_config_names_the_field_and_helps(data: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        RunConfig.from_dict(data)
    assert "help:" in str(caught.value)


def test_bad_sections_and_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="must be a ModelConfig.*help:"):
        RunConfig(model={"hidden_size": 128})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="unknown suffix.*help:"):
        RunConfig().to_file(tmp_path / "run.toml")
    with pytest.raises(ConfigError, match="cannot be written.*help:"):
        RunConfig().to_file(tmp_path / "missing" / "run.yaml")
    path = tmp_path / "run.yaml"
    path.write_text("collaboration:\n  grad_compresion: fp16\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"run\.yaml: collaboration\.grad_compresion.*did you"):
        RunConfig.from_file(path)
    # A cross-section problem introduced by dataclasses.replace is caught too.
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        _replace(RunConfig(), "model", max_position_embeddings=128)


def _reordered(value: Any) -> Any:
    """The same data with every mapping's keys in reverse order."""
    if isinstance(value, dict):
        return {key: _reordered(value[key]) for key in reversed(list(value))}
    return value


def test_config_hash_is_stable_across_key_order_and_processes(tmp_path: Path) -> None:
    config = _full_demo()
    digest = config.config_hash()
    assert len(digest) == 64 and int(digest, 16) >= 0
    reordered = _reordered(config.to_dict())
    assert list(reordered) != list(config.to_dict())
    assert RunConfig.from_dict(reordered).config_hash() == digest
    path = config.to_file(tmp_path / "run.json")
    code = "import sys; from kit.config import RunConfig; print(RunConfig.from_file(sys.argv[1]).config_hash())"
    for seed in ("1", "2"):
        result = subprocess.run(
            [sys.executable, "-c", code, str(path)],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        )
        assert result.stdout.strip() == digest


SHARED_CHANGES = [
    ("model", {"hidden_size": 256, "num_attention_heads": 4}),
    ("model", {"init_seed": 7}),
    ("tokenizer", {"lowercase": False}),
    ("data", {"mlm_probability": 0.2}),
    ("data", {"sources": (SourceConfig(name="demo", path="text", data_files=("other.txt",)),)}),
    ("optimizer", {"lr": 0.002}),
    ("optimizer", {"schedule": "constant"}),
    ("collaboration", {"run_id": "kit-demo-2"}),
    ("collaboration", {"target_batch_size": 128}),
    ("collaboration", {"grad_compression": "uniform8bit"}),
]


@pytest.mark.parametrize(("section", "changes"), SHARED_CHANGES)
def test_config_hash_changes_with_shared_fields(section: str, changes: dict[str, object]) -> None:
    config = _full_demo()
    changed = _replace(config, section, **changes)
    assert changed.config_hash() != config.config_hash()
    assert {f"{section}.{name}" for name in changes} <= set(config.hash_differences(changed))


LOCAL_CHANGES = [
    ("access", {"usernames": ("carol",), "open": True}),
    ("access", {"authority_public_key": None, "coordinator": None, "token_lifetime": 60}),
    ("access", {"check_seconds": 2.0}),
    ("checkpoint", {"folder": "elsewhere", "hub_repo": None, "every_epochs": 1, "keep_last": 9}),
    ("collaboration", {"batch_size_per_step": 1, "load_state_timeout": 1200.0}),
    ("data", {"shuffle_buffer_size": 10, "tokenize_batch_size": 16}),
    ("tokenizer", {"output_dir": "tok", "hub_repo": "org/tok"}),
]


@pytest.mark.parametrize(("section", "changes"), LOCAL_CHANGES)
def test_config_hash_ignores_organizer_and_peer_local_fields(
    section: str, changes: dict[str, object]
) -> None:
    config = _full_demo()
    changed = _replace(config, section, **changes)
    assert changed != config
    assert changed.config_hash() == config.config_hash()
    assert config.hash_differences(changed) == []


def test_peer_local_fields_exist() -> None:
    config = RunConfig().to_dict()
    for dotted in PEER_LOCAL_FIELDS:
        section, name = dotted.split(".")
        assert name in config[section], dotted
    assert (
        RunConfig.from_dict({"optimizer": {"lr": 1}}).config_hash()
        == RunConfig.from_dict({"optimizer": {"lr": 1.0}}).config_hash()
    )


#: Every AlbertConfig setting different from transformers' default, so a dropped one shows.
UNUSUAL_MODEL = ModelConfig(
    vocab_size=1_000,
    embedding_size=32,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    intermediate_size=96,
    num_hidden_groups=2,
    inner_group_num=2,
    hidden_act="relu",
    hidden_dropout_prob=0.05,
    attention_probs_dropout_prob=0.06,
    classifier_dropout_prob=0.07,
    max_position_embeddings=64,
    type_vocab_size=3,
    layer_norm_eps=1e-5,
    initializer_range=0.03,
    pad_token_id=1,
    bos_token_id=5,
    eos_token_id=6,
)


@pytest.mark.parametrize(
    "model",
    [ModelConfig(), ModelConfig.tiny(), UNUSUAL_MODEL],
    ids=["sahajbert", "tiny", "unusual"],
)
def test_to_transformers_matches(model: ModelConfig) -> None:
    albert = model.to_transformers()
    assert albert.model_type == "albert"
    expected = model.to_dict()
    del expected["architecture"], expected["init_seed"], expected["compile"]  # kit's own
    assert {name: getattr(albert, name) for name in expected} == expected
    if model is UNUSUAL_MODEL:
        defaults = type(albert)()
        assert all(getattr(defaults, name) != value for name, value in expected.items())


def test_run_config_imports_no_torch() -> None:
    code = (
        "import sys\n"
        "from kit.config import AccessConfig, RunConfig\n"
        f"AccessConfig(authority_public_key={AUTHORITY_KEY!r}, coordinator={COORDINATOR!r})\n"
        "RunConfig.tiny_demo().config_hash()\n"
        "heavy = [m for m in ('torch', 'transformers', 'datasets') if m in sys.modules]\n"
        "sys.exit(str(heavy) if heavy else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_sections_are_frozen() -> None:
    config = RunConfig.tiny_demo()
    for section in (config, config.model, config.optimizer, config.collaboration):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(section, "run_id", "other")  # noqa: B010 (mypy knows they are frozen)
    assert isinstance(CollaborationConfig().size_adaptive_threshold, int)
    assert OptimizerConfig(lr=1).lr == 1.0


def test_an_authority_needs_no_coordinator_address() -> None:
    """Volunteers reach the coordinator through its join link; the address is informational."""
    access = AccessConfig.from_dict({"authority_public_key": AUTHORITY_KEY})
    assert access.authority_public_key == AUTHORITY_KEY and access.coordinator is None
