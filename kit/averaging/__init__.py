"""Averaging: peers of a group average tensors with a butterfly all-reduce (DeDLOC, hivemind).

Pure cores (no networking, no clocks), in dependency order:

    compression.py   codecs with hivemind's wire ids and byte layouts, validated on receipt
    balancing.py     which share of the vector each peer aggregates (DeDLOC's LP)
    partition.py     tensors -> parts -> chunks, the aggregator's reducer, the round report

The codec classes are re-exported here (lazily) under hivemind's names, so that
``from kit.averaging import Float16Compression`` reads like hivemind scripts do.
"""

from __future__ import annotations

from typing import Any

_CODEC_NAMES = frozenset(
    {
        "BlockwiseQuantization",
        "CompressionBase",
        "CompressionInfo",
        "Float16Compression",
        "NoCompression",
        "PerTensorCompression",
        "Quantile8BitQuantization",
        "RoleAdaptiveCompression",
        "ScaledFloat16Compression",
        "SizeAdaptiveCompression",
        "TensorRole",
        "Uniform8BitQuantization",
    }
)


def __getattr__(name: str) -> Any:
    # Lazy (PEP 562): importing a torch-free submodule of kit.averaging must not import torch.
    if name in _CODEC_NAMES:
        from kit.averaging import compression

        return getattr(compression, name)
    raise AttributeError(f"module 'kit.averaging' has no attribute {name!r}")
