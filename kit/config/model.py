"""The ``model:`` section of the run configuration: which transformer every peer trains.

Holds ``ModelConfig`` (ALBERT, defaults = sahajBERT's albert-large-v2 shape with a 32000-token
vocabulary) with a ``tiny()`` preset for demos and tests, and ``to_transformers()``, which builds
the matching ``transformers.AlbertConfig``. It doesn't build the model (no torch here): the
trainer calls ``AlbertForPreTraining(config.model.to_transformers())``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from kit.config.fields import (
    _check_keys,
    _to_plain,
    check_bool,
    check_choice,
    check_int,
    check_number,
    check_probability,
    config_error,
    store_normalized,
)

if TYPE_CHECKING:  # transformers imports torch: only inside to_transformers()
    from transformers import AlbertConfig

ARCHITECTURES = ("albert",)
HIDDEN_ACTIVATIONS = ("gelu_new", "gelu", "relu", "silu")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The transformer every peer trains (the ``model:`` section of run.yaml).

    Defaults are sahajBERT's (DeDLOC, Diskin et al. 2021 §4.2): albert-large-v2 (Lan et al. 2020)
    with its vocabulary resized to 32000 tokens, ~18M parameters thanks to ALBERT's shared layer
    (ALBERT §3.1 "cross-layer parameter sharing") and factorized embeddings (§3.1, E=128).
    """

    # fmt: off
    architecture: str = "albert"  # model family; only ALBERT (MLM + sentence-order heads) so far
    vocab_size: int = 32_000  # rows of the embedding table; must be >= tokenizer.vocab_size
    embedding_size: int = 128  # ALBERT's factorized embedding width (E); small keeps the table cheap
    hidden_size: int = 1024  # transformer width (H); lower it (e.g. 768) if a step runs out of GPU memory
    num_hidden_layers: int = 24  # depth; layers share weights, so depth costs compute, not parameters
    num_attention_heads: int = 16  # must divide hidden_size (64 dims per head is usual)
    intermediate_size: int = 4096  # feed-forward width, usually 4 x hidden_size
    num_hidden_groups: int = 1  # groups of layers with their own weights; 1 = all layers share one set
    inner_group_num: int = 1  # layers inside one group (ALBERT keeps 1)
    hidden_act: str = "gelu_new"  # activation of the feed-forward block
    hidden_dropout_prob: float = 0.0  # ALBERT trains without dropout (ALBERT §4.7); raise it if it overfits
    attention_probs_dropout_prob: float = 0.0  # dropout on attention weights
    classifier_dropout_prob: float = 0.1  # dropout before fine-tuning heads (not used in pretraining)
    max_position_embeddings: int = 512  # longest sequence the model can read; >= data.max_seq_length
    type_vocab_size: int = 2  # segment ids: A and B of the sentence-order task
    layer_norm_eps: float = 1e-12  # LayerNorm epsilon
    initializer_range: float = 0.02  # std of the initial weights; lower it if the first steps diverge
    pad_token_id: int = 0  # kit's tokenizer: <pad>=0 <unk>=1 [CLS]=2 [SEP]=3 [MASK]=4
    bos_token_id: int = 2  # [CLS]
    eos_token_id: int = 3  # [SEP]
    init_seed: int = 42  # seed of the first peer's weights (others download them); sahajBERT: 42
    compile: bool = False  # torch.compile the shared layer on CUDA GPUs: ~20% faster, ~10-60 s to start (per peer)
    # fmt: on

    SECTION: ClassVar[str] = "model"

    def __post_init__(self) -> None:
        where = self.SECTION
        check_choice(f"{where}.architecture", self.architecture, ARCHITECTURES)
        check_int(f"{where}.vocab_size", self.vocab_size, minimum=16, hint="sahajBERT used 32000")
        check_int(f"{where}.embedding_size", self.embedding_size, minimum=1, hint="ALBERT uses 128")
        check_int(f"{where}.hidden_size", self.hidden_size, minimum=8, hint="e.g. 768 or 1024")
        check_int(f"{where}.num_hidden_layers", self.num_hidden_layers, minimum=1)
        check_int(f"{where}.num_attention_heads", self.num_attention_heads, minimum=1)
        if self.hidden_size % self.num_attention_heads:
            raise config_error(
                f"{where}.num_attention_heads",
                f"({self.num_attention_heads}) must divide hidden_size ({self.hidden_size})",
                "use hidden_size / 64 heads, e.g. 16 for 1024",
            )
        check_int(f"{where}.intermediate_size", self.intermediate_size, minimum=1)
        check_int(f"{where}.num_hidden_groups", self.num_hidden_groups, minimum=1)
        if self.num_hidden_layers % self.num_hidden_groups:
            raise config_error(
                f"{where}.num_hidden_groups",
                f"({self.num_hidden_groups}) must divide num_hidden_layers ({self.num_hidden_layers})",
                "keep 1 (every layer shares one set of weights, as ALBERT does)",
            )
        check_int(f"{where}.inner_group_num", self.inner_group_num, minimum=1)
        check_choice(f"{where}.hidden_act", self.hidden_act, HIDDEN_ACTIVATIONS)
        for name in (
            "hidden_dropout_prob",
            "attention_probs_dropout_prob",
            "classifier_dropout_prob",
        ):
            value = check_probability(f"{where}.{name}", getattr(self, name), hint="e.g. 0.1 or 0")
            store_normalized(self, name, value)
        check_int(
            f"{where}.max_position_embeddings",
            self.max_position_embeddings,
            minimum=8,
            hint="use data.max_seq_length or more (sahajBERT: 512)",
        )
        check_int(f"{where}.type_vocab_size", self.type_vocab_size, minimum=1)
        store_normalized(
            self,
            "layer_norm_eps",
            check_number(f"{where}.layer_norm_eps", self.layer_norm_eps, above=0, maximum=1e-2),
        )
        store_normalized(
            self,
            "initializer_range",
            check_number(
                f"{where}.initializer_range", self.initializer_range, above=0, maximum=1.0
            ),
        )
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            check_int(
                f"{where}.{name}",
                getattr(self, name),
                minimum=0,
                maximum=self.vocab_size - 1,
                hint="use the id the tokenizer gives this token (kit: <pad>=0 [CLS]=2 [SEP]=3)",
            )
        check_int(f"{where}.init_seed", self.init_seed, minimum=0, maximum=2**32 - 1)
        check_bool(f"{where}.compile", self.compile)

    @classmethod
    def tiny(cls) -> ModelConfig:
        """A ~0.76M-parameter ALBERT for demos and tests (hidden 128, 2 layers, vocab 8000); fast on a CPU."""
        return cls(
            vocab_size=8_000,
            embedding_size=64,
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=512,
            max_position_embeddings=128,
        )

    def to_transformers(self) -> AlbertConfig:
        """The equivalent ``transformers.AlbertConfig`` (imports transformers, hence torch).

        Raises:
            ConfigError: transformers is not installed.
        """
        try:
            from transformers import AlbertConfig
        except ImportError as error:
            raise config_error(
                "model", f"needs transformers ({error})", "pip install transformers"
            ) from None
        values = self.to_dict()
        del values["architecture"], values["init_seed"], values["compile"]  # not AlbertConfig's
        return AlbertConfig(**values)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "model") -> ModelConfig:
        """Build from the ``model:`` mapping of a run configuration (raises ConfigError)."""
        return cls(**_check_keys(cls, data, where))

    def to_dict(self) -> dict[str, Any]:
        """Plain dict that ``from_dict`` reads back."""
        return _to_plain(self)
