"""The averager's settings and the checks made before a first round (no networking)."""

from __future__ import annotations

import pytest
import torch

from kit.averaging.adaptive_compression import PerTensorCompression, RoleAdaptiveCompression
from kit.averaging.averager import DecentralizedAverager
from kit.averaging.compression import (
    CompressionInfo,
    Float16Compression,
    NoCompression,
    TensorRole,
    Uniform8BitQuantization,
)
from kit.averaging.settings import AveragerSettings, check_infos, check_tensors, chunk_elements
from kit.errors import ConfigError, KitUsageError


def test_defaults_follow_hivemind() -> None:
    settings = AveragerSettings(prefix="run_grads")
    assert (settings.min_group_size, settings.min_matchmaking_time) == (2, 5.0)
    assert (settings.request_timeout, settings.part_size_bytes) == (3.0, 2**19)
    assert settings.sender_timeout == 15.0 and settings.aggregator_timeout == 30.0
    assert isinstance(settings.compression, NoCompression)
    assert settings.matchmaking.target_group_size is None


@pytest.mark.parametrize(
    "changes",
    [
        {"prefix": ""},
        {"auxiliary": True, "client_mode": True},
        {"min_group_size": 1},
        {"target_group_size": 2, "min_group_size": 3},
        {"allreduce_timeout": 0},
        {"bandwidth": -1.0},
        {"part_size_bytes": 16},
        {"initial_group_bits": "01x"},
    ],
)
def test_bad_settings_raise_config_errors_with_a_hint(changes: dict) -> None:
    with pytest.raises(ConfigError, match="help:"):
        AveragerSettings(**{"prefix": "x", **changes})


def test_tensors_are_checked() -> None:
    assert len(check_tensors([torch.zeros(3), torch.zeros(2, 2)])) == 2
    for bad in ([], [torch.zeros(3, dtype=torch.int64)], [torch.zeros(4, 4).t()], [3.0]):
        with pytest.raises(ConfigError, match="help:"):
            check_tensors(bad)  # type: ignore[arg-type]


def test_chunks_hold_about_part_size_bytes_on_the_wire() -> None:
    tensors = [torch.zeros(10**6), torch.zeros(10**6, dtype=torch.float16)]
    assert chunk_elements(tensors, NoCompression(), 2**19) == [2**17, 2**18]
    assert chunk_elements(tensors, Float16Compression(), 2**19) == [2**18, 2**18]
    per_tensor = PerTensorCompression([Uniform8BitQuantization(), NoCompression()])
    assert chunk_elements(tensors, per_tensor, 2**19) == [2**19, 2**18]  # keyed by index


def test_the_facade_maps_hivemind_options() -> None:
    tensors = [torch.zeros(3)]
    averager = DecentralizedAverager(
        tensors, dht=None, start=False, prefix="x", daemon=True, sender_timeout=7.0
    )
    assert averager.settings.next_chunk_timeout == 7.0
    with pytest.raises(ConfigError, match="help:"):
        DecentralizedAverager(tensors, dht=None, start=False, prefix="x", averaging_alpha=0.5)
    with pytest.raises(ConfigError, match="help:"):
        DecentralizedAverager([torch.zeros(3, dtype=torch.int64)], dht=None, prefix="x")
    with pytest.raises(KitUsageError, match="help:"):
        averager.step()  # not started


def test_tensor_infos_must_describe_the_averaged_tensors() -> None:
    tensors = [torch.zeros(3, 4), torch.zeros(5)]
    infos = [CompressionInfo.from_tensor(t, key=i) for i, t in enumerate(tensors)]
    assert check_infos(None, tensors) is None
    assert check_infos(infos, tensors) == tuple(infos)
    with pytest.raises(ConfigError, match="one CompressionInfo per averaged tensor"):
        check_infos(infos[:1], tensors)
    with pytest.raises(
        ConfigError, match=r"describes a \[5\] tensor, the averaged tensor is \[3, 4\]"
    ):
        check_infos(infos[::-1], tensors)
    # the estimate of a chunk's size sees the infos too (a role-adaptive codec's ratio)
    role_adaptive = RoleAdaptiveCompression(parameter=Float16Compression(), default=NoCompression())
    parameters = [CompressionInfo.from_tensor(t, role=TensorRole.PARAMETER) for t in tensors]
    assert chunk_elements(tensors, role_adaptive, 4096, parameters) == [2048, 2048]
    assert chunk_elements(tensors, role_adaptive, 4096) == [1024, 1024]
