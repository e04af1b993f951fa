"""The organizer's memory calculator (Training Transformers Together's, for a kit run).

Holds :func:`memory_table`: for a ``RunConfig``, the GPU memory (and CPU RAM) one volunteer needs
per micro-batch size under each memory layout (fp32, fp16/bf16 autocast, 8-bit optimizer
statistics, optimizer offloaded to the CPU), from the analytic model :func:`estimate_memory`,
and :func:`memory_table_html` to show it in the config notebook. Parameter sharing is in the
numbers already (ALBERT's shared layer is counted once in the weights, every time in the
activations). It decides nothing: ``kit.hardware.plan`` does that on each volunteer's machine.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kit.hardware.memory import estimate_memory, needs_from_model

if TYPE_CHECKING:
    from kit.config import RunConfig

#: (label, precision, 8-bit optimizer, offload) of each column, cheapest memory last.
LAYOUTS = (
    ("fp32", "fp32", False, False),
    ("fp16", "fp16", False, False),
    ("fp16 + 8-bit optimizer", "fp16", True, False),
    ("fp16 + offload", "fp16", False, True),
)
#: GPUs volunteers bring, with the memory a run may use on them (bytes).
COMMON_GPUS = (
    ("T4 (Colab/Kaggle)", 15 * 2**30),
    ("P100 (Kaggle)", 16 * 2**30),
    ("8 GB", 8 * 2**30),
)


def memory_table(
    config: RunConfig, micro_batches: Sequence[int] = (1, 2, 4, 8, 16)
) -> list[dict[str, Any]]:
    """One row per micro-batch and layout: GPU bytes, CPU RAM bytes, and which GPUs fit it.

    Args:
        config: the run (its model, sequence length and optimizer).
        micro_batches: the micro-batch sizes to show.
    """
    from kit.training.components import build_model

    model = build_model(config)
    needs = needs_from_model(
        model,
        sequence_length=config.data.max_seq_length,
        batch_size_per_step=config.collaboration.batch_size_per_step,
        optimizer=config.optimizer.name,
    )
    rows = []
    for micro_batch in micro_batches:
        for label, precision, eight_bit, offload in LAYOUTS:
            estimate = estimate_memory(
                needs, micro_batch, precision=precision, optimizer_8bit=eight_bit, offload=offload
            )
            rows.append(
                {
                    "micro_batch": micro_batch,
                    "layout": label,
                    "gpu_bytes": estimate.device_bytes,
                    "cpu_bytes": estimate.host_bytes,
                    "fits": [name for name, size in COMMON_GPUS if estimate.device_bytes <= size],
                }
            )
    return rows


def memory_table_html(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a small HTML table (for ``IPython.display.HTML``)."""
    head = (
        "<tr><th>micro-batch</th><th>layout</th><th>GPU</th><th>CPU RAM</th><th>fits on</th></tr>"
    )
    body = "".join(
        "<tr>"
        f"<td>{row['micro_batch']}</td><td>{html.escape(row['layout'])}</td>"
        f"<td>{row['gpu_bytes'] / 2**30:.2f} GiB</td><td>{row['cpu_bytes'] / 2**30:.2f} GiB</td>"
        f"<td>{html.escape(', '.join(row['fits']) or '-')}</td>"
        "</tr>"
        for row in rows
    )
    return f"<table>{head}{body}</table>"
