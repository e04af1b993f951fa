"""``kit tokenizer train --config run.yaml`` end to end on local files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from kit.cli import main


def run_yaml(tmp_path: Path, corpus: dict[str, Path], **tokenizer: object) -> Path:
    config = {
        "tokenizer": {
            "vocab_size": 400,
            "train_sources": ["oscar"],
            "output_dir": str(tmp_path / "tok"),
            **tokenizer,
        },
        "data": {
            "sources": [
                {"name": "wiki", "data_files": [str(corpus["wiki"])], "probability": 0.23},
                {"name": "oscar", "data_files": [str(corpus["oscar"])], "probability": 0.77},
            ]
        },
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config, allow_unicode=True), encoding="utf-8")
    return path


def test_train_writes_a_loadable_tokenizer(
    tmp_path: Path, corpus: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoTokenizer

    config = run_yaml(tmp_path, corpus)
    assert (
        main(
            [
                "tokenizer",
                "train",
                "--config",
                str(config),
                "--no-progress",
                "--max-documents",
                "300",
            ]
        )
        == 0
    )
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["output_dir"] == str(tmp_path / "tok") and summary["vocab_size"] == 400
    assert set(summary["sources"]) == {"oscar"} and summary["sources"]["oscar"]["used"] == 300
    loaded = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert loaded("আমি ভাত খাই।")["input_ids"][0] == 2


def test_train_reports_config_errors(
    tmp_path: Path, corpus: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    config = run_yaml(tmp_path, corpus, train_sources=["nonexistent"])
    assert main(["tokenizer", "train", "--config", str(config), "--no-progress"]) == 1
    assert "help:" in capsys.readouterr().err
    assert main(["tokenizer", "train", "--config", str(tmp_path / "missing.yaml")]) == 1


@pytest.mark.sockets
def test_train_and_push_to_the_hub(
    tmp_path: Path,
    corpus: dict[str, Path],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kit.testing.fake_hub import FakeHub

    config = run_yaml(tmp_path, corpus, hub_repo="neuropark/bn-tokenizer", max_train_documents=200)
    with FakeHub() as hub, hub.patched_client(tmp_path / "hf_home"):
        hub.add_user("alice", token="hf_alice", orgs=["neuropark"])
        hub.add_token("alice", "hf_alice_read", role="read")
        monkeypatch.setenv("HF_TOKEN", "hf_alice_read")
        assert main(["tokenizer", "train", "--config", str(config), "--no-progress"]) == 1
        assert "the Hub refused the push" in capsys.readouterr().err
        assert (tmp_path / "tok" / "tokenizer.json").is_file()  # saved before the push failed
        monkeypatch.setenv("HF_TOKEN", "hf_alice")
        assert main(["tokenizer", "train", "--config", str(config), "--no-progress"]) == 0
        summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert "neuropark/bn-tokenizer" in summary["pushed"]
        files = hub.commits("neuropark/bn-tokenizer")[0].files
        assert files["tokenizer.json"] == (tmp_path / "tok" / "tokenizer.json").read_bytes()
