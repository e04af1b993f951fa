"""The organizer's memory table: one row per micro-batch and layout, cheaper layouts need less."""

from __future__ import annotations

from kit.config import RunConfig
from kit.training.calculator import LAYOUTS, memory_table, memory_table_html


def test_memory_table_rows_grow_with_the_micro_batch_and_shrink_with_the_layout() -> None:
    config = RunConfig.tiny_demo(data_files=["unused/*.txt"])
    rows = memory_table(config, micro_batches=(1, 8))
    assert [(r["micro_batch"], r["layout"]) for r in rows] == [
        (m, layout[0]) for m in (1, 8) for layout in LAYOUTS
    ]
    by_key = {(r["micro_batch"], r["layout"]): r for r in rows}
    for label, *_ in LAYOUTS:  # activations grow with the micro-batch
        assert by_key[(8, label)]["gpu_bytes"] > by_key[(1, label)]["gpu_bytes"]
    fp32, fp16, fp16_8bit, offload = (by_key[(1, label)]["gpu_bytes"] for label, *_ in LAYOUTS)
    assert fp32 > fp16 > fp16_8bit and fp16 > offload
    assert by_key[(1, "fp16 + offload")]["cpu_bytes"] > by_key[(1, "fp16")]["cpu_bytes"]
    assert all(r["fits"] for r in rows)  # a tiny model fits every GPU volunteers bring
    page = memory_table_html(rows)
    assert page.count("<tr>") == len(rows) + 1 and "fp16 + 8-bit optimizer" in page
