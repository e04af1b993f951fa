"""The streaming pretraining pipeline of one peer: documents in, masked ALBERT examples out.

It holds the wiring of the stages, in order: sources (kit.data.sources / kit.data.shards, or
kit.data.remote for what a coordinator serves) →
interleave → window shuffle → tokenize in batches (``encode_batch_fast``) → examples with SOP +
MLM (kit.data.examples) → padded batches (kit.data.collate). It also holds the resumable state of
the whole chain. ``state_dict()`` records the document-stream state before the current tokenizer
batch, plus how many of that batch's examples were handed out. ``load_state_dict()`` restores
the stream, rebuilds that one batch (deterministic, seeded by its index) and skips what was
already handed out. A restarted peer therefore continues with exactly the next example, and the
state stays small (no buffered text), JSON-serializable, and tied to the peer and the settings
that made it.

It doesn't hold the individual stages, the tokenizer recipe, or the training loop.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import itertools
import json
import logging
from collections.abc import Generator, Sequence
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer

from kit.config import DataConfig, config_error
from kit.errors import KitUsageError

from .collate import AlbertCollator
from .examples import Example, ExampleBuilder, ExampleCounts, VocabularyTables
from .remote import ServedData
from .shards import ShardSource
from .sources import (
    DocumentSource,
    DocumentStream,
    SourceCounts,
    TextSource,
    derive_seed,
    peer_shuffle_seed,
)
from .tokenizer import tokenizer_fingerprint

logger = logging.getLogger(__name__)

STATE_VERSION = 1


@dataclasses.dataclass(frozen=True)
class PipelineStatistics:
    """Counters of the whole pipeline; everything read is either used or counted as dropped."""

    sources: tuple[SourceCounts, ...]  # per source: read, used, empty, short, invalid, passes
    examples: ExampleCounts  # documents turned into examples, single sentences, truncation, masking
    examples_yielded: int  # examples handed to the caller so far
    batches_tokenized: int  # tokenizer batches processed (including the current one)

    @property
    def documents_read(self) -> int:
        """Documents read from all sources."""
        return sum(source.read for source in self.sources)

    @property
    def documents_dropped(self) -> int:
        """Documents dropped by the filters (empty, too short, invalid UTF-8)."""
        return sum(source.empty + source.too_short + source.invalid_text for source in self.sources)


class PretrainingPipeline:
    """Streams MLM + SOP examples for one peer, in that peer's order; resumable.

    Iterate it for :class:`~kit.data.examples.Example` objects, or call :meth:`batches` for padded
    tensors. Iteration continues from the current position: a pipeline is a stream, not a list.
    Use it in the training process itself (like sahajBERT's ``dataloader_num_workers=0``): a
    DataLoader worker would hold its own copy, and ``state_dict()`` would no longer say where the
    peer is. The pipeline is faster than a T4 consumes examples, so workers aren't needed.

    Args:
        stream: the peer's document stream (sources already opened).
        tokenizer: the ``tokenizers`` object of the recipe (special tokens at ids 0-4).
        builder: example construction and masking settings.
        seed: the peer's seed (:func:`~kit.data.sources.peer_shuffle_seed`).
        tokenize_batch_size: documents per tokenizer call.
        fingerprint: identifies the settings; a state from other settings is refused.
    """

    def __init__(
        self,
        stream: DocumentStream,
        tokenizer: Tokenizer,
        builder: ExampleBuilder,
        *,
        seed: int,
        tokenize_batch_size: int = 256,
        fingerprint: str = "",
    ) -> None:
        self._stream = stream
        # A private copy without padding or truncation: the examples decide lengths themselves.
        self._tokenizer = Tokenizer.from_str(tokenizer.to_str())
        self._tokenizer.no_padding()
        self._tokenizer.no_truncation()
        self._builder = builder
        self._seed = seed
        self._batch_size = tokenize_batch_size
        self._fingerprint = fingerprint
        self._batch_index = -1  # index of the tokenizer batch being handed out
        self._batch_start: dict[str, Any] | None = None  # stream state before that batch
        self._counts_before = ExampleCounts()  # builder counts before that batch
        self._examples: list[Example] = []
        self._offset = 0
        self._yielded = 0
        self._initial_stream = stream.state_dict()

    @classmethod
    def from_config(
        cls,
        config: DataConfig,
        tokenizer: Tokenizer | Any,
        *,
        peer_identity: bytes,
        served: ServedData | None = None,
    ) -> PretrainingPipeline:
        """Open the sources of ``config`` and wire the pipeline for the peer ``peer_identity``.

        Args:
            config: the ``data:`` section of the run.
            tokenizer: a ``tokenizers.Tokenizer`` or a transformers fast tokenizer (its backend
                is used).
            peer_identity: bytes that identify this peer, e.g. ``identity.peer_id.to_bytes()``.
            served: the data the coordinator serves (volunteers); its sources are read from
                there instead of the organizer's files. None = open every source here.

        Raises:
            ConfigError: no sources, or a tokenizer without the recipe's special tokens.
            DataSourceNotFound: a data file or dataset does not exist.
        """
        if not config.sources:
            raise config_error(
                "data.sources", "is empty", "list at least one source under data.sources"
            )
        backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        if not isinstance(backend, Tokenizer):
            raise config_error(
                "tokenizer",
                f"must be a tokenizers.Tokenizer, got {type(tokenizer).__name__}",
                "load it with kit.data.load_tokenizer",
            )
        tables = VocabularyTables.from_tokenizer(backend)
        seed = peer_shuffle_seed(peer_identity, config.shuffle_seed)
        fingerprint_text = tokenizer_fingerprint(backend)
        sources: list[DocumentSource] = []
        for source in config.sources:
            source_seed = derive_seed(seed, "source", source.name)
            if served is not None and source.name in served:
                sources.append(
                    served.open_source(
                        source,
                        seed=source_seed,
                        vocab_size=tables.vocab_size,
                        tokenizer=fingerprint_text,
                    )
                )
            elif source.pretokenized:
                sources.append(
                    ShardSource(
                        source.name,
                        source.data_files,
                        probability=source.probability,
                        seed=source_seed,
                        vocab_size=tables.vocab_size,
                        tokenizer=fingerprint_text,
                    )
                )
            else:
                sources.append(
                    TextSource(
                        source,
                        min_chars=config.min_chars,
                        on_invalid_text=config.on_invalid_text,
                        shard_seed=source_seed,
                    )
                )
        stream = DocumentStream(
            sources, seed=seed, window_size=config.shuffle_buffer_size, repeat=config.repeat
        )
        settings = json.dumps(
            {"data": config.to_dict(), "tokenizer": fingerprint_text, "peer": seed}, sort_keys=True
        )
        return cls(
            stream,
            backend,
            ExampleBuilder.from_config(tables, config),
            seed=seed,
            tokenize_batch_size=config.tokenize_batch_size,
            fingerprint=hashlib.sha256(settings.encode("utf-8")).hexdigest()[:16],
        )

    def __iter__(self) -> PretrainingPipeline:
        return self

    def __next__(self) -> Example:
        while self._offset >= len(self._examples):
            if not self._next_batch():
                raise StopIteration
        example = self._examples[self._offset]
        self._offset += 1
        self._yielded += 1
        return example

    def _next_batch(self) -> bool:
        """Read, tokenize and build the next tokenizer batch; False when the data has ended."""
        start = self._stream.state_dict()
        documents = self._read_documents()
        if not documents:
            return False
        self._batch_index += 1
        self._batch_start = start
        self._counts_before = self._builder.counts
        self._examples = self._build(documents, self._batch_index)
        self._offset = 0
        return True

    def _read_documents(self) -> list[str | np.ndarray]:
        documents: list[str | np.ndarray] = []
        while len(documents) < self._batch_size:
            document = self._stream.next_document()
            if document is None:
                break
            documents.append(document)
        return documents

    def _build(self, documents: Sequence[str | np.ndarray], batch_index: int) -> list[Example]:
        texts = [document for document in documents if isinstance(document, str)]
        encoded = (
            iter(self._tokenizer.encode_batch_fast(texts, add_special_tokens=False))
            if texts
            else iter(())
        )
        ids = [
            np.asarray(next(encoded).ids, dtype=np.int32) if isinstance(document, str) else document
            for document in documents
        ]
        return self._builder.build(ids, derive_seed(self._seed, "batch", batch_index))

    def batches(
        self, batch_size: int, collator: AlbertCollator | None = None
    ) -> Generator[dict[str, torch.Tensor], None, None]:
        """Padded batches of ``batch_size`` examples (the last one may be smaller if data ends).

        Args:
            batch_size: examples per batch (per device and micro-step).
            collator: the padding; default pads with the recipe's ``<pad>`` to a multiple of 8.
        """
        if batch_size < 1:
            raise KitUsageError(f"batch_size must be >= 1, got {batch_size} - help: pass e.g. 4")
        collate = collator or AlbertCollator(max_length=self._builder.max_seq_length)
        while True:
            examples = list(itertools.islice(self, batch_size))
            if not examples:
                return
            yield collate(examples)

    def state_dict(self) -> dict[str, Any]:
        """Where this peer is in its data (JSON-serializable; save it with the checkpoint)."""
        return {
            "version": STATE_VERSION,
            "fingerprint": self._fingerprint,
            "batch_index": self._batch_index,
            "batch_start": copy.deepcopy(self._batch_start),
            "offset": self._offset,
            "yielded": self._yielded,
            "counts_before": dataclasses.asdict(self._counts_before),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: the next example is the one after the last one handed out.

        Raises:
            ConfigError: the state comes from another peer identity, other data settings or
                another tokenizer, or from an incompatible kit version.
        """
        if state.get("version") != STATE_VERSION:
            raise config_error(
                "data state",
                f"has version {state.get('version')!r}, expected {STATE_VERSION}",
                "start the data stream afresh",
            )
        if state.get("fingerprint") != self._fingerprint:
            raise config_error(
                "data state",
                "was saved by another peer identity or with other data/tokenizer settings",
                "resume with the same identity file and run.yaml, or start the data stream afresh",
            )
        self._yielded = int(state["yielded"])
        self._builder.counts = ExampleCounts(**state["counts_before"])
        self._counts_before = self._builder.counts
        self._batch_index = int(state["batch_index"])
        self._batch_start = copy.deepcopy(state["batch_start"])
        self._examples = []
        self._offset = 0
        if self._batch_start is None:  # nothing was read yet
            self._stream.load_state_dict(self._initial_stream)
            return
        self._stream.load_state_dict(self._batch_start)
        self._examples = self._build(self._read_documents(), self._batch_index)
        self._offset = int(state["offset"])
        if self._offset > len(self._examples):
            raise config_error(
                "data state", "points past the end of its batch", "start the data stream afresh"
            )

    def statistics(self) -> PipelineStatistics:
        """Counters so far (what was read, used, dropped, masked, truncated)."""
        return PipelineStatistics(
            sources=self._stream.statistics(),
            examples=self._builder.counts,
            examples_yielded=self._yielded,
            batches_tokenized=self._batch_index + 1,
        )
