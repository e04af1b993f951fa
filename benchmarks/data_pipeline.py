"""Benchmark: examples/s of kit's full data pipeline against raw ``tokenizers`` on the same text.

Usage::

    python benchmarks/data_pipeline.py                 # one CPU core (the issue's condition)
    python benchmarks/data_pipeline.py --cores 0       # every core

It prints ONE JSON line per sequence length (128, then 512), each with ``seq_len``,
``pipeline_ex_s``, ``raw_tokenizer_ex_s``, ``ratio`` and the T4 comparison. A generated pseudo-Bengali corpus
(kit.data.synthetic; long, OSCAR-like paragraphs) is written to a temporary text file, and a
Unigram tokenizer with an 8,000-piece vocabulary is trained on part of it (not timed). Then,
in the same process:

* pipeline: ``PretrainingPipeline`` over that file through ``datasets`` streaming, i.e. stream →
  interleave/filter → window shuffle → tokenize → SOP + MLM → collate to torch tensors, until the
  file is exhausted. Opening the source is not timed; everything after is.
* raw: ``Tokenizer.encode_batch`` (what the issue names) over the same documents, held in memory,
  in batches of 256. ``raw_tokenizer_ex_s`` divides the pipeline's example count by this time, so
  ``ratio`` = raw time / pipeline time on identical text. ``raw_fast_ex_s`` does the same for
  ``encode_batch_fast``, which the pipeline itself calls (it skips offsets), for transparency.

How many examples/s a T4 consumes for ALBERT-large (the pipeline must deliver >= 5x that):

* compute per token (forward): 24 applications of the shared layer, each ~12.6M multiply-adds
  (attention projections 4·1024², FFN 2·1024·4096) → 24 · 2 · 12.6M ≈ 604 MFLOP; attention
  scores and weighted sum add 24 · 4 · seq_len · 1024; the MLM head adds ≈ 8.4 MFLOP
  (1024→128 projection + 128×32000 decoder). Training (forward + backward) ≈ 3x forward, so
  ≈ 1.05 TFLOP per 512-token sequence, ≈ 0.24 TFLOP per 128-token one.
* T4: 65 TFLOPS fp16 tensor-core peak, but it is a 70 W card that throttles; BERT-large-class
  training sustains roughly 30% of peak → we assume 20 TFLOPS sustained (generous on purpose:
  a higher T4 rate makes the check stricter).
* So a T4 consumes ≈ 19 examples/s at seq 512 and ≈ 80 at seq 128. Cross-check with the
  sahajBERT run (recipes.md §3.1, §3.7): 19,519 steps × 4,096 sequences ≈ 80M sequences in
  234 peer-days ≈ 4 sequences/s per peer on average (mixed GPUs, with averaging pauses),
  well under the T4 bound used here.

The check ``t4_margin`` = pipeline_ex_s / t4_ex_s must be >= 5 (``meets_t4_5x``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

T4_SUSTAINED_FLOPS = 20e12  # see the module docstring
ALBERT_LARGE = {"layers": 24, "hidden": 1024, "ffn": 4096, "embedding": 128, "vocab": 32_000}


def t4_examples_per_second(seq_len: int) -> float:
    """Training examples/s of ALBERT-large on one T4 at ``seq_len`` tokens (estimate)."""
    layers, hidden, ffn = ALBERT_LARGE["layers"], ALBERT_LARGE["hidden"], ALBERT_LARGE["ffn"]
    per_layer = 2 * (4 * hidden * hidden + 2 * hidden * ffn) + 4 * seq_len * hidden
    head = 2 * (
        hidden * ALBERT_LARGE["embedding"] + ALBERT_LARGE["embedding"] * ALBERT_LARGE["vocab"]
    )
    train_flops_per_sequence = 3 * seq_len * (layers * per_layer + head)
    return T4_SUSTAINED_FLOPS / train_flops_per_sequence


def _pin_cores(cores: int) -> int:
    """Restrict this process (and the tokenizers thread pool) to ``cores`` CPUs; 0 = all."""
    available = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if cores and available:
        os.sched_setaffinity(0, set(available[:cores]))
        os.environ["RAYON_NUM_THREADS"] = str(cores)  # read when tokenizers starts its pool
        os.environ["OMP_NUM_THREADS"] = str(cores)
        return cores
    return len(available) or (os.cpu_count() or 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cores", type=int, default=1, help="CPU cores to use (0 = all)")
    parser.add_argument(
        "--documents", type=int, default=4000, help="documents in the generated corpus"
    )
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--batch-size", type=int, default=32, help="examples per collated batch")
    parser.add_argument("--vocab-size", type=int, default=8000)
    args = parser.parse_args()
    cores = _pin_cores(args.cores)

    import json
    import logging

    import datasets
    import torch

    from kit.config import DataConfig, SourceConfig, TokenizerConfig
    from kit.data.pipeline import PretrainingPipeline
    from kit.data.synthetic import SyntheticBengali
    from kit.data.tokenizer import train_tokenizer

    torch.set_num_threads(cores)
    datasets.disable_progress_bars()
    logging.disable(logging.INFO)
    generator = SyntheticBengali(seed=0, vocabulary_size=20_000)
    documents = list(generator.documents(args.documents, min_sentences=4, max_sentences=40))
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.txt"
        corpus.write_text("\n".join(documents) + "\n", encoding="utf-8")
        tokenizer = train_tokenizer(
            documents[:2000], TokenizerConfig(vocab_size=args.vocab_size), progress=False
        )
        for seq_len in args.seq_lens:
            config = DataConfig(
                sources=(SourceConfig("bench", data_files=(str(corpus),)),),
                max_seq_length=seq_len,
                shuffle_buffer_size=1000,
                repeat=False,
            )
            pipeline = PretrainingPipeline.from_config(
                config, tokenizer, peer_identity=b"benchmark-peer"
            )
            started = time.perf_counter()
            examples = sum(len(batch["input_ids"]) for batch in pipeline.batches(args.batch_size))
            pipeline_seconds = time.perf_counter() - started

            started = time.perf_counter()
            tokens = 0
            for start in range(0, len(documents), 256):
                tokens += sum(
                    len(e) for e in tokenizer.encode_batch(documents[start : start + 256])
                )
            raw_seconds = time.perf_counter() - started
            started = time.perf_counter()
            for start in range(0, len(documents), 256):
                tokenizer.encode_batch_fast(documents[start : start + 256])
            raw_fast_seconds = time.perf_counter() - started

            statistics = pipeline.statistics()
            t4 = t4_examples_per_second(seq_len)
            pipeline_ex_s = examples / pipeline_seconds
            result = {
                "seq_len": seq_len,
                "cpu_cores": cores,
                "documents": len(documents),
                "examples": examples,
                "mean_example_tokens": round(
                    statistics.examples.tokens / max(1, statistics.examples.examples), 1
                ),
                "pipeline_ex_s": round(pipeline_ex_s, 1),
                "raw_tokenizer_ex_s": round(examples / raw_seconds, 1),
                "ratio": round(raw_seconds / pipeline_seconds, 3),
                "raw_fast_ex_s": round(examples / raw_fast_seconds, 1),
                "ratio_vs_fast": round(raw_fast_seconds / pipeline_seconds, 3),
                "raw_tokens_s": round(tokens / raw_seconds),
                "t4_ex_s": round(t4, 1),
                "t4_margin": round(pipeline_ex_s / t4, 1),
                "meets_0_7x_raw": raw_seconds / pipeline_seconds >= 0.7,
                "meets_t4_5x": pipeline_ex_s >= 5 * t4,
            }
            print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
