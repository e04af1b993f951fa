"""Throughput and error of each averaging codec on one all-reduce part (72 MB of float32 N(0, 1)).

Prints one JSON line: per codec, compress and extract throughput in MB/s of float32 input, the
wire bytes per input byte, the max absolute error and the relative L2 error. ``--chunk-bytes``
compresses the part in streaming chunks instead (as the all-reduce sends it; hivemind: 2**19).

    python benchmarks/codecs.py [--megabytes 72] [--repeats 3] [--chunk-bytes 524288] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kit.averaging.compression import CODECS, Codec, SerializedTensor, extract


def measure(codec_name: str, tensor: torch.Tensor, chunk_elements: int, repeats: int) -> dict:
    """Best-of-``repeats`` timings of one codec over ``tensor``, split into chunks."""
    codec = CODECS[Codec[codec_name]]()
    chunks = tensor.split(chunk_elements)
    best_compress = best_extract = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        wire = [codec.compress(chunk) for chunk in chunks]
        best_compress = min(best_compress, time.perf_counter() - start)
        received = [(item.header(), bytes(item.buffer)) for item in wire]  # what a peer receives
        start = time.perf_counter()
        decoded = [extract(SerializedTensor.from_header(header, body)) for header, body in received]
        best_extract = min(best_extract, time.perf_counter() - start)
    restored = torch.cat(decoded)
    megabytes = tensor.numel() * 4 / 1e6
    error = (restored - tensor).abs()
    return {
        "compress_mb_s": round(megabytes / best_compress, 1),
        "extract_mb_s": round(megabytes / best_extract, 1),
        "wire_ratio": round(sum(len(body) for _, body in received) / (tensor.numel() * 4), 4),
        "max_abs_err": float(error.max()),
        "rel_err": float(error.norm() / tensor.norm()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=float, default=72.0, help="size of the float32 part")
    parser.add_argument("--repeats", type=int, default=3, help="runs per codec; the best counts")
    parser.add_argument("--chunk-bytes", type=int, default=0, help="0: the part in one call")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (kit's rounds use 1); 0: torch's"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tensor = torch.randn(int(args.megabytes * 1e6 / 4))
    chunk_elements = args.chunk_bytes // 4 if args.chunk_bytes else tensor.numel()
    results = {
        codec.name: measure(codec.name, tensor, chunk_elements, args.repeats) for codec in CODECS
    }
    summary = {
        "benchmark": "codecs",
        "megabytes": args.megabytes,
        "chunk_bytes": args.chunk_bytes or None,
        "threads": torch.get_num_threads(),
        "codecs": results,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
