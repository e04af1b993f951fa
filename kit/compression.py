"""hivemind's ``hivemind.compression`` codecs, re-exported for ported hivemind scripts.

For ported hivemind scripts only (``hivemind.compression.Float16Compression()`` after
``import kit as hivemind``); the codecs live in ``kit.averaging.compression`` and
``kit.averaging.adaptive_compression``, where kit's own code imports them from. hivemind's protobuf helpers (``serialize_torch_tensor``) have no
counterpart: kit's chunks are a msgpack header plus raw bytes (``kit.averaging.chunk_stream``).
"""

from kit.averaging.adaptive_compression import (
    AdaptiveCompressionBase,
    PerTensorCompression,
    RoleAdaptiveCompression,
    SizeAdaptiveCompression,
)
from kit.averaging.compression import (
    BlockwiseQuantization,
    CompressionBase,
    CompressionInfo,
    Float16Compression,
    NoCompression,
    Quantile8BitQuantization,
    ScaledFloat16Compression,
    TensorRole,
    Uniform8BitQuantization,
)

__all__ = [
    "AdaptiveCompressionBase",
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
]
