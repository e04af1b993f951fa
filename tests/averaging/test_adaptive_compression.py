"""The codecs that choose another codec per tensor: by size, by role, by key."""

from __future__ import annotations

import pytest
import torch

from kit.averaging.adaptive_compression import (
    PerTensorCompression,
    RoleAdaptiveCompression,
    SizeAdaptiveCompression,
)
from kit.averaging.compression import (
    BlockwiseQuantization,
    Codec,
    CompressionInfo,
    Float16Compression,
    TensorRole,
)
from kit.errors import ConfigError

from .test_compression import normal, round_trip


def test_adaptive_codecs_choose_by_whole_tensor() -> None:
    codec = SizeAdaptiveCompression()  # TTT: fp16 under 2**16 elements, uniform 8-bit above
    big, small = normal(300, 300), normal(10)
    assert codec.compress(small).codec == Codec.FLOAT16
    assert codec.compress(big).codec == Codec.UNIFORM_8BIT
    chunk_of_big = CompressionInfo.from_tensor(big).get_part(3, 100)
    assert codec.compress(big.view(-1)[:100], chunk_of_big).codec == Codec.UNIFORM_8BIT
    assert codec.estimate_compression_ratio(CompressionInfo.from_tensor(small)) == 0.5
    roles = RoleAdaptiveCompression(gradient=BlockwiseQuantization())
    gradient = CompressionInfo.from_tensor(big, role=TensorRole.GRADIENT)
    assert roles.compress(big, gradient).codec == Codec.BLOCKWISE_8BIT
    assert roles.compress(big).codec == Codec.NONE
    per_tensor = PerTensorCompression({"w": Float16Compression()})
    assert per_tensor.compress(small, CompressionInfo.from_tensor(small, key="w")).codec == 2
    with pytest.raises(ConfigError, match="help:"):
        per_tensor.compress(small, CompressionInfo.from_tensor(small, key="b"))
    assert torch.equal(
        codec.extract(codec.compress(small)), round_trip(Float16Compression(), small)
    )
