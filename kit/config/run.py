"""``RunConfig``: every section of a run in one validated, frozen tree, and its config hash.

Holds ``RunConfig`` (model, tokenizer, data, optimizer, collaboration, access, checkpoint), the
checks that need two sections at once, reading and writing whole ``run.yaml``/``run.json`` files,
``config_hash()`` (what the p2p handshake compares), and the presets: ``sahajbert()`` (the seed
run, data included), ``tiny_demo()``, and the optimizer recipes of ``with_recipe()``. It doesn't
hold the sections themselves (their own modules in ``kit.config``) and reads no environment
variables: everything a run depends on is in the file, so two peers with the same file agree.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from kit.config.access import AccessConfig, CheckpointConfig
from kit.config.data import DataConfig, SourceConfig, TokenizerConfig
from kit.config.fields import _check_keys, config_error, load_config_file
from kit.config.model import ModelConfig
from kit.config.training import (
    SAHAJBERT_COLLABORATION,
    SAHAJBERT_OPTIMIZER,
    TTT_COLLABORATION,
    TTT_OPTIMIZER,
    CollaborationConfig,
    OptimizerConfig,
)

#: Bumped whenever what goes into ``config_hash()`` changes, so old and new kits never match.
CONFIG_HASH_VERSION = 1
#: Sections that every peer of a run must agree on: they go into ``config_hash()``.
HASHED_SECTIONS = ("model", "tokenizer", "data", "optimizer", "collaboration")
#: Fields of hashed sections left out of the hash: per-peer knobs that may differ between peers
#: without changing what is trained (memory, speed, local folders), e.g. sahajBERT's volunteers
#: ran 4 samples per step on a T4 and 1 elsewhere (DeDLOC ``contributor_notebook.ipynb``).
PEER_LOCAL_FIELDS = (
    "tokenizer.output_dir",  # where this machine keeps the tokenizer folder
    "tokenizer.hub_repo",  # where the organizer pushes it
    "data.shuffle_buffer_size",  # this peer's memory
    "data.tokenize_batch_size",  # this peer's speed
    "collaboration.batch_size_per_step",  # this peer's GPU memory
    "collaboration.load_state_timeout",  # this peer's download link
    "collaboration.offload_optimizer",  # this peer's GPU memory (the same numbers, on CPU copies)
    "model.compile",  # this peer's start-up time against its speed (the same numbers)
)
#: File suffixes ``to_file``/``from_file`` understand.
YAML_SUFFIXES = (".yaml", ".yml")
#: Optimizer/collaboration recipes of ``with_recipe()``: name -> (optimizer, collaboration fields).
RECIPES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "sahajbert": (SAHAJBERT_OPTIMIZER, SAHAJBERT_COLLABORATION),
    "ttt": (TTT_OPTIMIZER, TTT_COLLABORATION),
}
#: sahajBERT's corpus today (its 2021 sources no longer load, see ``RunConfig.sahajbert``).
SAHAJBERT_WIKIPEDIA = ("wikimedia/wikipedia", "20231101.bn")
SAHAJBERT_WEB = ("HuggingFaceFW/fineweb-2", "ben_Beng")
#: The placeholder data files of ``tiny_demo()``; the demo writes its corpus there.
DEMO_DATA_FILES = ("demo_corpus/*.txt",)

_SECTION_TYPES: dict[str, Any] = {
    "model": ModelConfig,
    "tokenizer": TokenizerConfig,
    "data": DataConfig,
    "optimizer": OptimizerConfig,
    "collaboration": CollaborationConfig,
    "access": AccessConfig,
    "checkpoint": CheckpointConfig,
}


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One training run: every section of run.yaml, validated together.

    Defaults reproduce sahajBERT (DeDLOC, Diskin et al. 2021) except for ``data.sources``, which
    every run names itself. Change a section with ``dataclasses.replace``; the result is
    validated again.

    Example::

        config = RunConfig.from_file("run.yaml")
        peer_options = PeerOptions(run_id=config.collaboration.run_id,
                                   config_hash=config.config_hash())
    """

    # fmt: off
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)  # the transformer to train
    tokenizer: TokenizerConfig = dataclasses.field(default_factory=TokenizerConfig)  # how text becomes ids
    data: DataConfig = dataclasses.field(default_factory=DataConfig)  # the streamed pretraining corpus
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)  # local optimizer, schedule
    collaboration: CollaborationConfig = dataclasses.field(default_factory=CollaborationConfig)  # global batch, averaging
    access: AccessConfig = dataclasses.field(default_factory=AccessConfig)  # who may join (not hashed)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)  # saving (not hashed)
    # fmt: on

    def __post_init__(self) -> None:
        for name, section_type in _SECTION_TYPES.items():
            if not isinstance(getattr(self, name), section_type):
                raise config_error(
                    name,
                    f"must be a {section_type.__name__}, got {type(getattr(self, name)).__name__}",
                    "build the config with RunConfig.from_dict(...) from plain dicts",
                )
        self._check_across_sections()

    def _check_across_sections(self) -> None:
        model, tokenizer, data = self.model, self.tokenizer, self.data
        if tokenizer.model_max_length != data.max_seq_length:
            raise config_error(
                "tokenizer.model_max_length",
                f"({tokenizer.model_max_length}) differs from data.max_seq_length"
                f" ({data.max_seq_length})",
                "set both to the same length (sahajBERT: 512)",
            )
        if model.max_position_embeddings < data.max_seq_length:
            raise config_error(
                "model.max_position_embeddings",
                f"({model.max_position_embeddings}) is shorter than data.max_seq_length"
                f" ({data.max_seq_length})",
                "raise model.max_position_embeddings or lower data.max_seq_length",
            )
        if model.vocab_size < tokenizer.vocab_size:
            raise config_error(
                "model.vocab_size",
                f"({model.vocab_size}) is smaller than tokenizer.vocab_size"
                f" ({tokenizer.vocab_size}), so some token ids have no embedding",
                "set model.vocab_size to tokenizer.vocab_size",
            )
        if model.type_vocab_size < 2:
            raise config_error(
                "model.type_vocab_size",
                f"is {model.type_vocab_size}, but sentence-order examples have two segments",
                "use 2",
            )
        if self.collaboration.reuse_grad_buffers and self.optimizer.clip_grad_norm is not None:
            raise config_error(
                "optimizer.clip_grad_norm",
                "clips each local step's gradients, but with collaboration.reuse_grad_buffers "
                ".grad holds the sum of several steps",
                "set clip_grad_norm: null and clip inside the optimizer (max_grad_norm: 4.0)",
            )
        names = {source.name for source in data.sources}
        for name in tokenizer.train_sources:
            if data.sources and name not in names:
                valid = ", ".join(repr(source.name) for source in data.sources)
                raise config_error(
                    "tokenizer.train_sources",
                    f"names {name!r}, which is not in data.sources",
                    f"use one of {valid}, or an empty list for all",
                )

    # --- dicts and files ------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "") -> RunConfig:
        """Build from a mapping of sections; absent (or null) sections get their defaults.

        Args:
            data: ``{"model": {...}, "data": {...}, ...}`` as read from run.yaml.
            where: prefix of error messages (the file name), empty for none.

        Raises:
            ConfigError: an unknown section or key (with a did-you-mean), a bad value, or
                sections that disagree.
        """
        values = _check_keys(cls, data, where or "run")
        sections = {}
        for name, raw in values.items():
            label = f"{where}: {name}" if where else name
            sections[name] = _SECTION_TYPES[name].from_dict({} if raw is None else raw, where=label)
        return cls(**sections)

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dicts and lists (YAML/JSON-ready) that ``from_dict`` reads back."""
        return {name: getattr(self, name).to_dict() for name in _SECTION_TYPES}

    @classmethod
    def from_file(cls, path: str | Path) -> RunConfig:
        """Read a whole run configuration from ``.yaml``/``.yml`` or ``.json``.

        Raises:
            ConfigError: the file is missing or unreadable, or a value is bad (see ``from_dict``).
        """
        return cls.from_dict(load_config_file(path), where=str(path))

    def to_file(self, path: str | Path) -> Path:
        """Write the configuration as YAML (``.yaml``/``.yml``) or JSON (``.json``).

        Returns:
            The path written.

        Raises:
            ConfigError: another suffix, or the file cannot be written.
        """
        file = Path(path)
        if file.suffix == ".json":
            text = json.dumps(self.to_dict(), indent=2, ensure_ascii=False) + "\n"
        elif file.suffix in YAML_SUFFIXES:
            text = (
                f"# kit run configuration; config hash when written: {self.config_hash()}\n"
                + yaml.safe_dump(self.to_dict(), sort_keys=False, allow_unicode=True)
            )
        else:
            raise config_error(
                str(file), "has an unknown suffix", "name it run.yaml, run.yml or run.json"
            )
        try:
            file.write_text(text, encoding="utf-8")
        except OSError as error:
            raise config_error(
                str(file),
                f"cannot be written ({error.strerror or error})",
                "check that the folder exists and is writable",
            ) from None
        return file

    # --- the hash peers compare -----------------------------------------------------------------

    def hashed_fields(self) -> dict[str, Any]:
        """What ``config_hash()`` covers, as canonical plain data.

        The ``model``, ``tokenizer``, ``data``, ``optimizer`` and ``collaboration`` sections, minus
        ``PEER_LOCAL_FIELDS``; whole numbers written as floats (``1.0``) become ints so that
        ``lr: 1`` and ``lr: 1.0`` agree. ``access`` and ``checkpoint`` are left out: the
        organizer may change the allowlist or the checkpoint folder during a run without
        splitting it in two.
        """
        shared: dict[str, Any] = {"version": CONFIG_HASH_VERSION}
        for name in HASHED_SECTIONS:
            shared[name] = _canonical(getattr(self, name).to_dict())
        for dotted in PEER_LOCAL_FIELDS:
            section, field = dotted.split(".")
            del shared[section][field]
        return shared

    def config_hash(self) -> str:
        """SHA-256 (hex) of the canonical JSON of ``hashed_fields()``.

        Stable across processes, machines, Python versions and the key order of the file (keys
        are sorted; no ``hash()`` salt is involved). Pass it to ``PeerOptions(config_hash=...)``:
        the handshake then refuses peers that train with another model, data, optimizer or
        collaboration setting, instead of letting them average incompatible tensors.
        """
        text = json.dumps(
            self.hashed_fields(),
            sort_keys=True,
            separators=(",", ":"),
            ensure_ascii=True,
            allow_nan=False,
        )
        return hashlib.sha256(text.encode("ascii")).hexdigest()

    def hash_differences(self, other: RunConfig) -> list[str]:
        """Dotted names of the hashed fields where ``other`` differs (why two hashes differ)."""
        mine, theirs = self.hashed_fields(), other.hashed_fields()
        return [
            f"{section}.{field}"
            for section in HASHED_SECTIONS
            for field in sorted(set(mine[section]) | set(theirs[section]))
            if mine[section].get(field) != theirs[section].get(field)
        ]

    # --- presets --------------------------------------------------------------------------------

    @classmethod
    def sahajbert(cls, run_id: str = "sahajbert") -> RunConfig:
        """sahajBERT, the seed run (DeDLOC, Diskin et al. 2021; recipes.md §1-3), data included.

        Model: albert-large-v2 with a 32,000-token vocabulary (~18M parameters, one shared
        layer run 24 times). Tokenizer: the Bengali recipe (NMT + NFKC + Bengali normalizer,
        Unigram 32k), trained on the web corpus only, as sahajBERT trained it on OSCAR only.
        Optimizer: LAMB as ``torch_optimizer.Lamb(debias=True, clamp_value=10000)``, lr 0.00176,
        betas (0.9, 0.999), eps 1e-6, weight decay 0.01 (not on biases and LayerNorm weights),
        local gradients clipped to 1.0, ``get_linear_schedule_with_warmup`` with 5,000 warmup
        and 1,000,000 total global steps (the run stopped at 19,519). Collaboration: 4,096
        sequences of up to 512 tokens per global step, groups of up to 256, fp16 on the wire,
        averaging timeout 120 s. Checkpoints every 50 global steps (as the Hub history shows).

        Data, mixed as sahajBERT mixed it (``merge_datasets(..., probabilities=[0.23, 0.77])``):

        * ``wiki`` (0.23): Bengali Wikipedia, ``wikimedia/wikipedia`` config ``20231101.bn``
          (parquet, no loading script; CC BY-SA 3.0 and GFDL). sahajBERT read the dump of
          2021-03-20 through ``lhoestq/wikipedia_bn``, a loading script that current
          ``datasets`` (>= 4) refuses to run.
        * ``web`` (0.77): ``HuggingFaceFW/fineweb-2`` config ``ben_Beng`` (parquet, no loading
          script; ODC-By 1.0, and Common Crawl's terms of use). sahajBERT read OSCAR
          (``oscar``/``unshuffled_deduplicated_bn``), a script dataset that no longer loads;
          FineWeb-2's Bengali is also Common Crawl, deduplicated and quality-filtered per
          language, and the largest Bengali web corpus that loads as plain parquet.

        Both stream; nothing is downloaded before training starts. Pin ``revision`` of each
        source to a commit for a long run, so that peers joining later read the same data.

        Args:
            run_id: the collaboration's name (peers of another run id are refused).
        """
        wiki_path, wiki_subset = SAHAJBERT_WIKIPEDIA
        web_path, web_subset = SAHAJBERT_WEB
        return cls(
            # torch.compile of the shared layer on CUDA GPUs: measured on an H200, MFU 37.5% ->
            # 44.8% at micro-batch 64 for ~10 s of compiling (kit.training.albert_speed).
            model=ModelConfig(compile=True),
            tokenizer=TokenizerConfig(train_sources=("web",)),
            data=DataConfig(
                sources=(
                    SourceConfig(name="wiki", path=wiki_path, subset=wiki_subset, probability=0.23),
                    SourceConfig(name="web", path=web_path, subset=web_subset, probability=0.77),
                ),
            ),
            optimizer=OptimizerConfig(**SAHAJBERT_OPTIMIZER),
            collaboration=CollaborationConfig(run_id=run_id, **SAHAJBERT_COLLABORATION),
            checkpoint=CheckpointConfig(every_epochs=50),
        )

    def with_recipe(self, name: str) -> RunConfig:
        """This run with the optimizer and collaboration recipe ``name``, for any model.

        ``"sahajbert"``: LAMB with debias, lr 0.00176, local clipping 1.0, warmup 5,000 / total
        1,000,000 global steps, fp16 codecs (see :meth:`sahajbert`). ``"ttt"``: Training
        Transformers Together's 8-bit LAMB offloaded to the CPU, lr 0.0025, betas (0.9, 0.96),
        weight decay 0.045, no debias, clipping at 4.0 inside the optimizer, warmup 3,125 /
        total 31,250, size-adaptive codecs, ``delay_optimizer_step``, ``reuse_grad_buffers``
        (``kit.config.training.ttt_optimizer``). The run id, the per-peer batch and the timeouts
        not named by the recipe are kept.

        Raises:
            ConfigError: an unknown recipe name.
        """
        if name not in RECIPES:
            raise config_error(
                "recipe", f"{name!r} is not a recipe", f"use one of {', '.join(RECIPES)}"
            )
        optimizer, collaboration = RECIPES[name]
        return dataclasses.replace(
            self,
            optimizer=OptimizerConfig(**optimizer),
            collaboration=dataclasses.replace(self.collaboration, **collaboration),
        )

    @classmethod
    def tiny_demo(cls, data_files: Sequence[str] = DEMO_DATA_FILES) -> RunConfig:
        """A complete config for a local demo: a tiny ALBERT, a small global batch, short waits.

        Args:
            data_files: the demo's text files (globs work); one document per line. The default
                ``demo_corpus/*.txt`` is a placeholder that the demo fills before training.
        """
        return cls(
            model=ModelConfig.tiny(),
            tokenizer=TokenizerConfig(
                preset="generic",
                vocab_size=8_000,
                model_max_length=128,
                output_dir="demo_tokenizer",
            ),
            data=DataConfig(
                sources=(SourceConfig(name="demo", path="text", data_files=tuple(data_files)),),
                max_seq_length=128,
                shuffle_buffer_size=1_000,
            ),
            optimizer=OptimizerConfig(lr=0.01, warmup_steps=5, total_steps=1_000),
            collaboration=CollaborationConfig(
                run_id="kit-demo",
                target_batch_size=64,
                batch_size_per_step=8,
                target_group_size=None,
                matchmaking_time=2.0,
                averaging_timeout=30.0,
                load_state_timeout=60.0,
            ),
            checkpoint=CheckpointConfig(
                folder="demo_checkpoints", every_epochs=5, push_every_minutes=0.0, keep_last=1
            ),
        )


def _canonical(value: Any) -> Any:
    """Plain data with whole-number floats as ints (JSON-stable across YAML spellings)."""
    if isinstance(value, dict):
        return {str(key): _canonical(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(item) for item in value]
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    return value
