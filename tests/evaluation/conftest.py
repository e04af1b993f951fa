"""Tiny evaluation inputs shared by the tests of ``kit/evaluation/`` (built once per session)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.evaluation import tiny


@dataclass(frozen=True)
class TinyWorld:
    root: Path
    tokenizer: Any  # PreTrainedTokenizerFast
    checkpoint: Path  # AlbertForPreTraining + tokenizer, save_pretrained layout
    ner: Path  # WikiANN-bn schema, parquet
    ncc: Path  # IndicGLUE sna.bn schema, JSON lines + README features
    cache: str  # datasets' Arrow cache, kept out of ~/.cache


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Models this small run fastest on one thread, and two threads thrash on a busy 2-core box."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def world(tmp_path_factory: pytest.TempPathFactory) -> TinyWorld:
    root = tmp_path_factory.mktemp("evaluation")
    tokenizer = tiny.make_tokenizer(root / "tokenizer")
    return TinyWorld(
        root=root,
        tokenizer=tokenizer,
        checkpoint=tiny.make_checkpoint(root / "checkpoint", tokenizer),
        ner=tiny.make_ner_dataset(root / "ner"),
        ncc=tiny.make_ncc_dataset(root / "ncc"),
        cache=str(root / "datasets-cache"),
    )
