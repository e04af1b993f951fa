"""Averaging: peers of a group average tensors with a butterfly all-reduce (DeDLOC, hivemind).

Pure cores (no networking, no clocks), in dependency order:

    quantization.py        the 8-bit codecs' kernels: each value's bucket, fast, in work chunks
    compression.py         codecs with hivemind's wire ids and byte layouts, validated on receipt
    adaptive_compression.py  codecs that pick one of those per tensor: by size, role or key
    balancing.py           which share of the vector each peer aggregates (DeDLOC's LP)
    widening.py            float16 operands summed in float32, a cache-sized slice at a time
    partition.py           tensors -> parts -> chunks, the round report
    reducer.py             the aggregator's running average; NaN/inf found once a chunk completes
    declarations.py        what matchmaking peers tell each other; the state machine's actions
    chunking.py            ranks and chunks of looking peers, whom each one asks to lead
    matchmaking.py         who averages with whom: the group-assembly state machine
    group.py               the assembled group and the join messages, as they travel
    control.py             one step's stage, trigger and result (hivemind's ``StepControl``)
    averages.py            what an aggregator sends back: the average, or each sender's delta
    grid.py                Moshpit: group keys as grid coordinates, weights of averaged values
    deadlines.py           "auto" matchmaking time and round timeout

With I/O (asyncio, over ``kit.p2p`` streams and ``kit.dht``):

    chunk_stream.py        how one chunk travels on a stream, and the buffers it lands in
    round_tasks.py         a round's tasks, deadline and timeline: owned, bounded, stopped together
    sender_side.py         a sender's streams in a round: its parts out, the averages back, staged
    allreduce.py           one peer's side of one butterfly all-reduce round
    declaration_board.py   an averager's declaration in the DHT while it looks, and the polls
    matchmaking_driver.py  the state machine's driver (join streams, invitations)
    router.py              one peer's averaging protocols, each stream to its averager's prefix
    served_rounds.py       which round an all-reduce stream belongs to (it may wait for it, bounded)
    state_sharing.py       ``load_state_from_peers``: donors by priority, the state on the wire
    settings.py            the averager's settings
    async_averager.py      ``AsyncAverager``: steps, retries and served streams on the event loop
    averager.py            ``DecentralizedAverager``: the blocking facade (hivemind's API)
    moshpit.py             the rounds of one grid average on the event loop

The public classes are re-exported here (lazily) under hivemind's names, so that
``from kit.averaging import DecentralizedAverager, Float16Compression`` reads like hivemind
scripts do.
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
        "Quantile8BitQuantization",
        "ScaledFloat16Compression",
        "TensorRole",
        "Uniform8BitQuantization",
    }
)


_ADAPTIVE_CODEC_NAMES = frozenset(
    {"PerTensorCompression", "RoleAdaptiveCompression", "SizeAdaptiveCompression"}
)
_AVERAGER_NAMES = frozenset(
    {"AsyncAverager", "DecentralizedAverager", "RoundResult", "StepControl"}
)


def __getattr__(name: str) -> Any:
    # Lazy (PEP 562): importing a torch-free submodule of kit.averaging must not import torch.
    if name in _CODEC_NAMES:
        from kit.averaging import compression

        return getattr(compression, name)
    if name in _ADAPTIVE_CODEC_NAMES:
        from kit.averaging import adaptive_compression

        return getattr(adaptive_compression, name)
    if name in _AVERAGER_NAMES:
        from kit.averaging import averager

        return getattr(averager, name)
    if name == "AveragerSettings":
        from kit.averaging import settings

        return settings.AveragerSettings
    raise AttributeError(f"module 'kit.averaging' has no attribute {name!r}")
