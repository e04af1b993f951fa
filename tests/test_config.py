"""Run configuration: defaults, validation with hints, YAML/JSON round trips, no torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kit.config import DataConfig, SourceConfig, TokenizerConfig, load_config_file
from kit.errors import ConfigError

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
