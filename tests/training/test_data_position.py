"""A volunteer's data position survives a restart; a fresh machine gets its own order."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from tokenizers import Tokenizer

from kit.config import DataConfig
from kit.data.pipeline import PretrainingPipeline
from kit.training.data_position import DataPosition, data_position_path
from tests.data.conftest import corpus, make_config, tokenizer  # noqa: F401  (fixtures)


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_restart_resumes_where_the_stream_stopped_and_a_new_identity_starts_afresh(
    tokenizer: Tokenizer,  # noqa: F811
    make_config: Callable[..., DataConfig],  # noqa: F811
    tmp_path: Path,
) -> None:
    config = make_config()
    path = data_position_path(tmp_path / ".kit", "run", "12D3KooWabcdefghijklmnop")
    clock = Clock()
    pipeline = PretrainingPipeline.from_config(config, tokenizer, peer_identity=b"volunteer")
    position = DataPosition(pipeline, path, every_seconds=30.0, clock=clock)
    assert not position.restore()  # nothing saved yet: the peer's own fresh order
    batches = pipeline.batches(4)
    first = [next(batches) for _ in range(3)]
    position.on_step(12, 1.0, 0.1)
    assert not path.exists()  # not due yet
    clock.now = 31.0
    position.on_step(12, 1.0, 0.1)  # due: saved after the third batch
    assert path.is_file()
    expected = [next(batches) for _ in range(3)]

    # The kernel restarts: same identity, same run.yaml.
    restarted = PretrainingPipeline.from_config(config, tokenizer, peer_identity=b"volunteer")
    assert DataPosition(restarted, path).restore()
    resumed = restarted.batches(4)
    got = [next(resumed) for _ in range(3)]
    assert all(same(x, y) for x, y in zip(got, expected, strict=True))
    assert not any(same(x, y) for x, y in zip(got, first, strict=True))  # no replay

    # A fresh machine: another identity. Its order is its own, and a stray file is not used.
    fresh = PretrainingPipeline.from_config(config, tokenizer, peer_identity=b"other machine")
    assert not DataPosition(fresh, path).restore()
    fresh_first = next(fresh.batches(4))
    assert not same(fresh_first, first[0])

    # A torn or foreign file never stops training: the stream starts afresh.
    path.write_text("{not json", encoding="utf-8")
    again = PretrainingPipeline.from_config(config, tokenizer, peer_identity=b"volunteer")
    assert not DataPosition(again, path).restore()
    assert same(next(again.batches(4)), first[0])
