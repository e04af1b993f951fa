"""Codecs that choose another codec per tensor: by size, by role, or by key (hivemind's
``compression.adaptive``, same names and arguments, so hivemind scripts port).

A chunk of a tensor is judged by the whole tensor (``CompressionInfo.descriptor``), so every chunk
of one tensor goes with the same codec. The chosen codec does the work and its checks
(``kit.averaging.compression``); these only delegate.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kit.averaging.compression import (
    CompressionBase,
    Float16Compression,
    NoCompression,
    Uniform8BitQuantization,
)
from kit.averaging.serialized import CompressionInfo, SerializedTensor, TensorRole
from kit.errors import ConfigError


class AdaptiveCompressionBase(CompressionBase):
    """Hands each tensor to the codec ``choose_compression`` picks from its CompressionInfo."""

    @abstractmethod
    def choose_compression(self, info: CompressionInfo) -> CompressionBase: ...

    def compress(
        self, tensor: torch.Tensor, info: CompressionInfo | None = None, allow_inplace: bool = False
    ) -> SerializedTensor:
        info = info if info is not None else CompressionInfo.from_tensor(tensor)
        return self.choose_compression(info).compress(tensor, info, allow_inplace)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return self.choose_compression(info).estimate_compression_ratio(info)


class SizeAdaptiveCompression(AdaptiveCompressionBase):
    """``less`` for tensors under ``threshold`` elements, ``greater_equal`` from there on.

    The defaults are Training Transformers Together's recipe (which used 2**16 + 1): small
    tensors (norms, biases) keep float16 precision, large matrices go 8-bit.
    """

    def __init__(
        self,
        threshold: int = 2**16,
        less: CompressionBase | None = None,
        greater_equal: CompressionBase | None = None,
    ) -> None:
        self.threshold = threshold  # elements of the WHOLE tensor (info.descriptor), not a chunk
        self.less = less if less is not None else Float16Compression()
        self.greater_equal = greater_equal or Uniform8BitQuantization()

    def choose_compression(self, info: CompressionInfo) -> CompressionBase:
        return self.greater_equal if info.descriptor.numel() >= self.threshold else self.less


class RoleAdaptiveCompression(AdaptiveCompressionBase):
    """A codec per TensorRole; roles left out use ``default`` (NoCompression)."""

    def __init__(
        self,
        *,
        activation: CompressionBase | None = None,
        parameter: CompressionBase | None = None,
        gradient: CompressionBase | None = None,
        optimizer: CompressionBase | None = None,
        default: CompressionBase | None = None,
    ) -> None:
        default = default or NoCompression()
        given = {TensorRole.ACTIVATION: activation, TensorRole.PARAMETER: parameter}
        given |= {TensorRole.GRADIENT: gradient, TensorRole.OPTIMIZER: optimizer}
        self.role_compressions = {role: given.get(role) or default for role in TensorRole}

    def choose_compression(self, info: CompressionInfo) -> CompressionBase:
        return self.role_compressions[info.role]


class PerTensorCompression(AdaptiveCompressionBase):
    """A codec per tensor key (an index into a sequence, or a key of a mapping)."""

    def __init__(
        self, tensor_compressions: Sequence[CompressionBase] | Mapping[Any, CompressionBase]
    ) -> None:
        self.tensor_compressions = tensor_compressions

    def choose_compression(self, info: CompressionInfo) -> CompressionBase:
        try:
            return self.tensor_compressions[info.key]  # type: ignore[index]
        except (KeyError, IndexError, TypeError):
            raise ConfigError(
                f"PerTensorCompression has no codec for tensor key {info.key!r} - help: give one "
                "codec per averaged tensor, keyed like CompressionInfo.key"
            ) from None
