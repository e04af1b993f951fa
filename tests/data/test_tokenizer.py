"""The tokenizer recipe: normalization, pre-tokenization, templates, training, save/load, Hub push."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import pytest
from tokenizers import Tokenizer, normalizers

from kit.config import TokenizerConfig
from kit.data.tokenizer import (
    SPECIAL_TOKENS,
    build_normalizer,
    build_pre_tokenizer,
    load_tokenizer,
    push_tokenizer_to_hub,
    save_tokenizer,
    tokenizer_fingerprint,
    train_tokenizer,
)
from kit.errors import ConfigError, DataSourceNotFound

from .conftest import BENGALI_SENTENCES

BENGALI = build_normalizer("bengali")


def pieces(text: str) -> list[str]:
    return [
        piece for piece, _ in build_pre_tokenizer().pre_tokenize_str(BENGALI.normalize_str(text))
    ]


# --- normalization ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "normalized"),
    [
        ("Hello  World 2021!", "hello world 2021!"),  # recipes.md §1.7 vector
        ("ক:খ | গ\u09e4 ঘ\u09e5 ঙ\u09f7", "কঃখ । গ। ঘ॥ ঙ।"),  # the five Bengali homogenizations
        ("আমি   ভাত\tখাই\n", "আমি ভাত খাই "),  # tab/newline -> space, runs of spaces collapsed
        ("র\u200d্যাব", "র ্যাব"),  # ZWJ becomes a space (NMT rules)
        ("\u09df", "\u09af\u09bc"),  # NFKC decomposes the composition-excluded য়
        ("ক\u09c7\u09be", "ক\u09cb"),  # ...and composes e + aa into o
        ("ＡＢＣ ফোন", "abc ফোন"),  # full-width Latin folds, then lowercases
        ("a\u0001b\u007fc", "abc"),  # control characters are deleted
    ],
)
def test_bengali_normalization_cases(raw: str, normalized: str) -> None:
    assert BENGALI.normalize_str(raw) == normalized


def test_vowel_signs_and_marks_survive_normalization() -> None:
    # Every combining mark (vowel signs ু ূ ৃ, hasanta ্, chandrabindu ঁ, nukta ়) must stay.
    for sentence in BENGALI_SENTENCES:
        expected = unicodedata.normalize("NFKC", sentence)
        assert BENGALI.normalize_str(sentence) == expected
    marks = "কু কূ কৃ ক্ষ পৌঁছে য়"
    kept = BENGALI.normalize_str(marks)
    for mark in ("\u09c1", "\u09c2", "\u09c3", "\u09cd", "\u0981", "\u09bc"):
        assert mark in kept
    # The stock ALBERT chain (NFKD + StripAccents) would delete them: the reason for the recipe.
    stock = normalizers.Sequence([normalizers.NFKD(), normalizers.StripAccents()])
    assert "\u09c1" not in stock.normalize_str(marks)


def test_generic_preset_leaves_bengali_punctuation_alone() -> None:
    generic = build_normalizer("generic")
    assert generic.normalize_str("ক:খ | Ab") == "ক:খ | ab"
    assert build_normalizer("generic", lowercase=False).normalize_str("Ab") == "Ab"
    with pytest.raises(ConfigError, match="help:"):
        build_normalizer("klingon")


# --- pre-tokenization ---------------------------------------------------------------------------


def test_pre_tokenization_boundaries() -> None:
    assert pieces("আমি ভাত খাই। তুমি কী খাও?") == ["▁আমি", "▁ভাত", "▁খাই", "।", "▁তুমি", "▁কী", "▁খাও", "?"]
    # Digits (Bengali and ASCII) one by one; the word-start marker before them stands alone.
    assert pieces("সালে ১৯১৩, 2021!") == [
        "▁সালে",
        "▁",
        "১",
        "৯",
        "১",
        "৩",
        ",",
        "▁",
        "2",
        "0",
        "2",
        "1",
        "!",
    ]
    assert pieces("গ্রাম আছে ।") == ["▁গ্রাম", "▁আছে", "▁", "।"]


# --- training, templates, save/load -------------------------------------------------------------


def test_trained_tokenizer_has_recipe_ids_and_templates(tokenizer: Tokenizer) -> None:
    assert [tokenizer.token_to_id(token) for token in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert tokenizer.get_vocab_size() == 1000
    state = json.loads(tokenizer.to_str())
    assert state["model"]["type"] == "Unigram" and state["model"]["unk_id"] == 1
    assert [token["lstrip"] for token in state["added_tokens"]] == [
        False,
        False,
        False,
        False,
        True,
    ]

    single = tokenizer.encode("আমি ভাত খাই।")
    assert single.ids[0] == 2 and single.ids[-1] == 3 and set(single.type_ids) == {0}
    pair = tokenizer.encode("আমি ভাত খাই।", "তুমি কী খাও?")
    first_sep = pair.ids.index(3)
    assert pair.ids[0] == 2 and pair.ids[-1] == 3 and pair.ids.count(3) == 2
    assert pair.type_ids == [0] * (first_sep + 1) + [1] * (len(pair.ids) - first_sep - 1)
    # [MASK] swallows the space before it: no stray "▁" piece in front of it.
    plain = tokenizer.encode("আমি", add_special_tokens=False).ids
    assert tokenizer.encode("আমি [MASK]", add_special_tokens=False).ids == [*plain, 4]


def test_training_shows_progress_and_rejects_empty_text(capsys: pytest.CaptureFixture[str]) -> None:
    texts = [" ".join(BENGALI_SENTENCES)] * 20
    train_tokenizer(texts, TokenizerConfig(vocab_size=120), progress=True)
    assert "tokenizer: reading text" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="no vocabulary"):
        train_tokenizer([], TokenizerConfig(vocab_size=120), progress=False)


def test_save_then_load_through_auto_tokenizer(tokenizer: Tokenizer, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    folder = save_tokenizer(tokenizer, tmp_path / "tok", model_max_length=256)
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    loaded = AutoTokenizer.from_pretrained(str(folder))
    encoded = loaded("আমি ভাত খাই।", "তুমি কী খাও?")
    reference = tokenizer.encode("আমি ভাত খাই।", "তুমি কী খাও?")
    assert encoded["input_ids"] == reference.ids
    assert encoded["token_type_ids"] == reference.type_ids
    assert (
        loaded.pad_token_id,
        loaded.unk_token_id,
        loaded.cls_token_id,
        loaded.sep_token_id,
        loaded.mask_token_id,
    ) == (0, 1, 2, 3, 4)
    assert loaded.model_max_length == 256
    assert (
        loaded.decode(loaded("আমি ভাত খাই।")["input_ids"], skip_special_tokens=True) == "আমি ভাত খাই।"
    )
    reloaded = load_tokenizer(folder)
    assert tokenizer_fingerprint(reloaded) == tokenizer_fingerprint(tokenizer)
    assert reloaded.encode("তোমার নাম কী?").ids == tokenizer.encode("তোমার নাম কী?").ids


def test_fingerprint_changes_with_the_vocabulary(tokenizer: Tokenizer) -> None:
    other = train_tokenizer(
        [" ".join(BENGALI_SENTENCES)] * 5, TokenizerConfig(vocab_size=100), progress=False
    )
    assert tokenizer_fingerprint(other) != tokenizer_fingerprint(tokenizer)
    padded = Tokenizer.from_str(tokenizer.to_str())
    padded.enable_padding(length=32)
    assert tokenizer_fingerprint(padded) == tokenizer_fingerprint(tokenizer)


def test_load_tokenizer_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(DataSourceNotFound, match="help:"):
        load_tokenizer(tmp_path / "nowhere")
    with pytest.raises(DataSourceNotFound):
        push_tokenizer_to_hub(tmp_path, "org/name", endpoint="http://127.0.0.1:9")


@pytest.mark.sockets
def test_push_to_hub_and_load_back(
    tokenizer: Tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kit.testing.fake_hub import FakeHub

    folder = save_tokenizer(tokenizer, tmp_path / "tok")
    with FakeHub() as hub, hub.patched_client(tmp_path / "hf_home"):
        hub.add_user("alice", token="hf_alice", orgs=["neuropark"])
        # No endpoint argument: HF_ENDPOINT (set by patched_client) must be honoured.
        url = push_tokenizer_to_hub(folder, "neuropark/bn-tokenizer", token="hf_alice")
        assert "neuropark/bn-tokenizer" in url
        files = hub.commits("neuropark/bn-tokenizer")[0].files
        assert files["tokenizer.json"] == (folder / "tokenizer.json").read_bytes()
        assert "tokenizer_config.json" in files
        loaded = load_tokenizer("neuropark/bn-tokenizer")
        assert loaded.encode("আমি ভাত খাই।").ids == tokenizer.encode("আমি ভাত খাই।").ids


@pytest.mark.sockets
def test_load_tokenizer_from_a_hub_repo_that_does_not_exist(tmp_path: Path) -> None:
    from kit.testing.fake_hub import FakeHub

    with (
        FakeHub() as hub,
        hub.patched_client(tmp_path / "hf_home"),
        pytest.raises(DataSourceNotFound, match="help:"),
    ):
        load_tokenizer("neuropark/no-such-tokenizer")
