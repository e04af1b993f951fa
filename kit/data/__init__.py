"""kit.data: the streaming tokenization pipeline and the language-aware tokenizer recipe.

Map of the package (data flows down the list):

    tokenizer.py   the sahajBERT tokenizer recipe: build, train, save, load, push to the Hub
    sources.py     datasets streaming sources, interleaving, filtering, per-peer window shuffle
    shards.py      zstd-compressed pre-tokenized shards (writer, validating reader, source)
    examples.py    ALBERT examples: segments A/B, sentence order (SOP), masked LM
    collate.py     padding into the tensors AlbertForPreTraining takes
    manifest.py    what a coordinator serves: shards per source, their SHA-256 (strict JSON)
    serving.py     the organizer's files as shards, cached; the manifest and range routes
    remote.py      a volunteer's verified, resumable shard downloads, in its own order
    pipeline.py    the resumable chain of all of the above, for one peer
    synthetic.py   generated pseudo-Bengali text for tests and benchmarks
    cli.py         ``kit tokenizer train --config run.yaml``

Names below are imported lazily, so ``import kit.data`` (and ``kit --help``) stays fast and
does not load torch, datasets or transformers until they are used.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AlbertCollator": "collate",
    "Example": "examples",
    "ExampleBuilder": "examples",
    "VocabularyTables": "examples",
    "PipelineStatistics": "pipeline",
    "PretrainingPipeline": "pipeline",
    "DataManifest": "manifest",
    "ServedData": "remote",
    "ServedShardSource": "remote",
    "prepare_served_data": "serving",
    "ShardSource": "shards",
    "ShardWriter": "shards",
    "read_shard": "shards",
    "write_shards": "shards",
    "DocumentStream": "sources",
    "SourceCounts": "sources",
    "TextSource": "sources",
    "peer_shuffle_seed": "sources",
    "SyntheticBengali": "synthetic",
    "build_normalizer": "tokenizer",
    "build_pre_tokenizer": "tokenizer",
    "load_tokenizer": "tokenizer",
    "push_tokenizer_to_hub": "tokenizer",
    "save_tokenizer": "tokenizer",
    "tokenizer_fingerprint": "tokenizer",
    "train_tokenizer": "tokenizer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kit.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__() -> list[str]:
    return __all__
