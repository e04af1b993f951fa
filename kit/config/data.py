"""The ``tokenizer:`` and ``data:`` sections of the run configuration (moved here unchanged).

Holds ``TokenizerConfig``, ``SourceConfig`` and ``DataConfig``: frozen dataclasses, one commented
line per field, validated on creation, with ``from_dict``/``to_dict``/``from_file``. It doesn't
hold the tokenizer or the data pipeline themselves (``kit.data``), nor the checks across sections
(``kit.config.run``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from kit.config.fields import (
    _as_tuple,
    _check_keys,
    _to_plain,
    check_bool,
    check_choice,
    check_int,
    check_probability,
    check_text,
    config_error,
    read_section,
)

#: Builders of ``datasets`` that read local (or URL) files given as ``data_files``.
FILE_BUILDERS = ("text", "json", "csv", "parquet", "arrow")
#: Tolerance on "the source probabilities sum to 1" (YAML floats such as 0.23 + 0.77).
PROBABILITY_SUM_TOLERANCE = 1e-6


# --- tokenizer: -----------------------------------------------------------------------------


TOKENIZER_PRESETS = ("bengali", "generic")


@dataclasses.dataclass(frozen=True)
class TokenizerConfig:
    """How to build and train the tokenizer (the ``tokenizer:`` section of run.yaml).

    The defaults reproduce sahajBERT's tokenizer (DeDLOC, Diskin et al. 2021, appendix; HF blog
    "Deep Learning over the Internet: Training Language Models Collaboratively").
    """

    # fmt: off
    preset: str = "bengali"  # "bengali": sahajBERT's normalizer; "generic": without Bengali replacements
    vocab_size: int = 32_000  # incl. the 5 special tokens; raise it if common words split into many pieces
    lowercase: bool = True  # fold Latin case (Bengali has none); false for languages that need case
    train_sources: tuple[str, ...] = ()  # data.sources names to train on; empty = all (sahajBERT: OSCAR)
    max_train_documents: int | None = None  # stop after this many documents; None = one full pass
    max_piece_length: int = 16  # longest piece in characters (UnigramTrainer default)
    model_max_length: int = 512  # written to tokenizer_config.json; keep it = data.max_seq_length
    output_dir: str = "tokenizer"  # folder that `kit tokenizer train` writes
    hub_repo: str | None = None  # push the folder to this Hub repo after training, e.g. "org/bn-tok"
    # fmt: on

    SECTION: ClassVar[str] = "tokenizer"

    def __post_init__(self) -> None:
        where = self.SECTION
        check_choice(f"{where}.preset", self.preset, TOKENIZER_PRESETS)
        check_int(
            f"{where}.vocab_size",
            self.vocab_size,
            minimum=64,
            hint="use at least a few hundred; sahajBERT used 32000",
        )
        check_bool(f"{where}.lowercase", self.lowercase)
        for index, name in enumerate(self.train_sources):
            check_text(
                f"{where}.train_sources[{index}]", name, hint="name a source from data.sources"
            )
        if self.max_train_documents is not None:
            check_int(
                f"{where}.max_train_documents",
                self.max_train_documents,
                minimum=1,
                hint="use null for a full pass",
            )
        check_int(f"{where}.max_piece_length", self.max_piece_length, minimum=1, maximum=256)
        check_int(f"{where}.model_max_length", self.model_max_length, minimum=8)
        check_text(f"{where}.output_dir", self.output_dir, hint="name a folder")
        if self.hub_repo is not None:
            check_text(f"{where}.hub_repo", self.hub_repo, hint='write "owner/name" or null')

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "tokenizer") -> TokenizerConfig:
        """Build from the ``tokenizer:`` mapping of a run configuration (raises ConfigError)."""
        values = _check_keys(cls, data, where)
        if "train_sources" in values:
            values["train_sources"] = _as_tuple(f"{where}.train_sources", values["train_sources"])
        return cls(**values)

    @classmethod
    def from_file(cls, path: str | Path) -> TokenizerConfig:
        """Read the ``tokenizer:`` section of a YAML/JSON run configuration (defaults if absent)."""
        return cls.from_dict(read_section(path, cls.SECTION), where=f"{path}: {cls.SECTION}")

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (lists, not tuples) that ``from_dict`` reads back."""
        return _to_plain(self)


# --- data: ----------------------------------------------------------------------------------


INVALID_TEXT_POLICIES = ("skip", "raise")


@dataclasses.dataclass(frozen=True)
class SourceConfig:
    """One stream of documents: a Hub dataset, or files on the organizer's disk.

    A Hub dataset (``path: "org/name"``) and file URLs (``https://``, ``hf://``) are read by every
    peer itself with ``datasets`` streaming. Files on the organizer's disk (a file builder such
    as ``text``, or kit token shards, with local ``data_files``) are :attr:`served`: only the
    organizer has them; the coordinator tokenizes them into shards and serves those on its port.
    """

    # fmt: off
    name: str  # label in logs and statistics; what tokenizer.train_sources refers to
    path: str = "text"  # Hub dataset ("oscar") or a file builder ("text", "json", "parquet", ...)
    data_files: tuple[str, ...] = ()  # the organizer's files (globs work; the coordinator serves them) or URLs
    subset: str | None = None  # the Hub dataset's configuration, e.g. "unshuffled_deduplicated_bn"
    split: str = "train"  # which split to stream
    text_column: str = "text"  # the column that holds the document text
    probability: float = 1.0  # share of documents drawn from here (sahajBERT: wiki 0.23, OSCAR 0.77)
    revision: str | None = None  # pin a Hub dataset revision so every peer reads the same data
    pretokenized: bool = False  # data_files are kit token shards (kit.data.shards), not text
    # fmt: on

    def __post_init__(self) -> None:
        check_text("data.sources[].name", self.name, hint="give every source a short name")
        where = f"data.sources[{self.name}]"
        check_text(f"{where}.path", self.path, hint='write a Hub dataset name or "text"/"json"')
        for index, file in enumerate(self.data_files):
            check_text(f"{where}.data_files[{index}]", file, hint="write a path or a glob")
        if (self.path in FILE_BUILDERS or self.pretokenized) and not self.data_files:
            raise config_error(
                f"{where}.data_files",
                f"is empty but path {self.path!r} reads files"
                if not self.pretokenized
                else "is empty",
                "list the files (globs like corpus/*.txt work), or set path to a Hub dataset name",
            )
        check_text(f"{where}.split", self.split)
        check_text(f"{where}.text_column", self.text_column)
        check_probability(
            f"{where}.probability",
            self.probability,
            allow_zero=False,
            hint="remove the source instead of giving it 0",
        )
        check_bool(f"{where}.pretokenized", self.pretokenized)

    @property
    def served(self) -> bool:
        """True when the documents are files on the organizer's disk, which the coordinator
        serves as token shards; False for Hub datasets and URLs, which every peer reads."""
        reads_files = self.path in FILE_BUILDERS or self.pretokenized
        return reads_files and not all("://" in file for file in self.data_files)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "data.sources[]") -> SourceConfig:
        """Build one source from its mapping (raises ConfigError)."""
        values = _check_keys(cls, data, where)
        if "name" not in values:
            raise config_error(
                f"{where}.name", "is missing", "give every source a short name, e.g. `name: wiki`"
            )
        if "data_files" in values:
            values["data_files"] = _as_tuple(f"{where}.data_files", values["data_files"])
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict that ``from_dict`` reads back."""
        return _to_plain(self)


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The streaming pretraining data (the ``data:`` section of run.yaml).

    Defaults follow sahajBERT's pipeline (DeDLOC §4.2 and its ``dataset_streaming.py``): examples
    of up to 512 tokens, 15% masked LM with 80/10/10 replacement, 50% swapped sentence order.
    """

    # fmt: off
    sources: tuple[SourceConfig, ...] = ()  # where documents come from; probabilities sum to 1
    max_seq_length: int = 512  # tokens per example incl. [CLS]/[SEP]; lower it if GPU memory runs out
    shuffle_buffer_size: int = 10_000  # documents per shuffle window; lower it if batch 1 is slow
    shuffle_seed: int = 0  # mixed with each peer's identity: peers differ, a restart keeps its order
    min_chars: int = 16  # drop documents shorter than this (after stripping); counted
    on_invalid_text: str = "skip"  # undecodable text lines: "skip" (counted) or "raise"; JSON raises
    repeat: bool = True  # loop over every source forever; false = stop after one pass
    tokenize_batch_size: int = 256  # documents per tokenizer call; raise it if tokenizing is slow
    mlm_probability: float = 0.15  # share of tokens the MLM objective predicts (BERT §3.1)
    mask_replace_probability: float = 0.8  # of those, share replaced by [MASK]
    random_replace_probability: float = 0.1  # of those, share replaced by a random token
    whole_word_masking: bool = False  # mask all pieces of a word together (sahajBERT: off)
    sop_swap_probability: float = 0.5  # share of examples with A and B swapped (ALBERT §4.2 SOP)
    pad_to_multiple_of: int = 8  # pad batch length to a multiple of this (fp16 tensor cores)
    # fmt: on

    SECTION: ClassVar[str] = "data"

    def __post_init__(self) -> None:
        where = self.SECTION
        names = [source.name for source in self.sources]
        for name in names:
            if names.count(name) > 1:
                raise config_error(
                    f"{where}.sources",
                    f"has two sources named {name!r}",
                    "give each source its own name",
                )
        if self.sources:
            total = sum(source.probability for source in self.sources)
            if abs(total - 1.0) > PROBABILITY_SUM_TOLERANCE:
                shares = ", ".join(f"{source.name}={source.probability}" for source in self.sources)
                raise config_error(
                    f"{where}.sources[].probability",
                    f"must sum to 1, got {total:.6g} ({shares})",
                    "scale them so they add up to 1, e.g. 0.23 and 0.77",
                )
        check_int(f"{where}.max_seq_length", self.max_seq_length, minimum=8, hint="use 128 or 512")
        check_int(f"{where}.shuffle_buffer_size", self.shuffle_buffer_size, minimum=1)
        check_int(f"{where}.shuffle_seed", self.shuffle_seed, minimum=0, maximum=2**63 - 1)
        check_int(
            f"{where}.min_chars",
            self.min_chars,
            minimum=1,
            hint="1 keeps everything but empty lines",
        )
        check_choice(f"{where}.on_invalid_text", self.on_invalid_text, INVALID_TEXT_POLICIES)
        check_bool(f"{where}.repeat", self.repeat)
        check_int(f"{where}.tokenize_batch_size", self.tokenize_batch_size, minimum=1)
        check_probability(f"{where}.mlm_probability", self.mlm_probability, allow_zero=False)
        check_probability(f"{where}.mask_replace_probability", self.mask_replace_probability)
        check_probability(f"{where}.random_replace_probability", self.random_replace_probability)
        if (
            self.mask_replace_probability + self.random_replace_probability
            > 1 + PROBABILITY_SUM_TOLERANCE
        ):
            raise config_error(
                f"{where}.mask_replace_probability",
                "plus random_replace_probability must not exceed 1",
                "BERT uses 0.8 and 0.1 (the remaining 0.1 keeps the token)",
            )
        check_bool(f"{where}.whole_word_masking", self.whole_word_masking)
        check_probability(f"{where}.sop_swap_probability", self.sop_swap_probability)
        check_int(
            f"{where}.pad_to_multiple_of", self.pad_to_multiple_of, minimum=1, hint="1 disables it"
        )

    def source_named(self, name: str) -> SourceConfig:
        """The source called ``name`` (ConfigError naming the valid ones if there is none)."""
        for source in self.sources:
            if source.name == name:
                return source
        valid = ", ".join(repr(source.name) for source in self.sources) or "none"
        raise config_error(f"source {name!r}", "is not in data.sources", f"valid names: {valid}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "data") -> DataConfig:
        """Build from the ``data:`` mapping of a run configuration (raises ConfigError)."""
        values = _check_keys(cls, data, where)
        if "sources" in values:
            raw = _as_tuple(f"{where}.sources", values["sources"])
            values["sources"] = tuple(
                SourceConfig.from_dict(item, where=f"{where}.sources[{index}]")
                for index, item in enumerate(raw)
            )
        return cls(**values)

    @classmethod
    def from_file(cls, path: str | Path) -> DataConfig:
        """Read the ``data:`` section of a YAML/JSON run configuration (defaults if absent)."""
        return cls.from_dict(read_section(path, cls.SECTION), where=f"{path}: {cls.SECTION}")

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (lists of dicts for sources) that ``from_dict`` reads back."""
        return _to_plain(self)
