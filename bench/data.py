"""Data line throughput: the reader (samples/s, tokens/s) and tokenization (`encode_batch`, tokens/s).

Runs on the embedded demo line (created under --work if it is not there yet) and prints one JSON
row per measurement:

    python bench/data.py --work /tmp/nsconsole-bench-line [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def bench_reader(line: object, seq_len: int, batch: int, seconds: float) -> dict[str, object]:
    from datalines.dataline import DataLine

    assert isinstance(line, DataLine)
    cycle = line.cycle(0)
    total = cycle.num_samples(seq_len)
    cycle.samples(seq_len, 0, 1, seed=0)  # the sample order is computed once per (seq_len, seed)
    samples = 0
    start = time.perf_counter()
    position = 0
    while time.perf_counter() - start < seconds:
        count = min(batch, total - position)
        cycle.samples(seq_len, position, count, seed=0)
        samples += count
        position = (position + count) % (total - batch)
    elapsed = time.perf_counter() - start
    return {
        "bench": "reader",
        "seq_len": seq_len,
        "batch": batch,
        "samples_per_s": round(samples / elapsed),
        "tokens_per_s": round(samples * seq_len / elapsed),
    }


def bench_order(line: object, seq_len: int) -> dict[str, object]:
    from datalines.dataline import DataLine

    assert isinstance(line, DataLine)
    cycle = line.cycle(0)
    start = time.perf_counter()
    count = cycle.num_samples(seq_len)
    return {"bench": "sample_order", "seq_len": seq_len, "samples": count,
            "seconds": round(time.perf_counter() - start, 4)}


def bench_interleave(samples: int) -> dict[str, object]:
    """The multi-source sample order (pure Python, computed once per cycle, seq_len and seed)."""
    from datalines.mixture import interleave_sources

    weights = [500_000, 300_000, 150_000, 50_000]
    start = time.perf_counter()
    order = interleave_sources(weights, [samples] * len(weights))
    elapsed = time.perf_counter() - start
    return {"bench": "interleave_4_sources", "samples": len(order), "seconds": round(elapsed, 3),
            "samples_per_s": round(len(order) / elapsed)}


def bench_tokenization(line: object, threads: int) -> dict[str, object]:
    from datalines.corpus import file_documents
    from datalines.dataline import DataLine

    assert isinstance(line, DataLine)
    source = line.source("stdlib")
    texts = [text for file in source.files for text in file_documents(source, file, 0).training]
    start = time.perf_counter()
    documents = line.tokenizer.encode_documents(texts)
    elapsed = time.perf_counter() - start
    tokens = sum(len(document) for document in documents)
    text_bytes = sum(len(text.encode("utf-8")) for text in texts)
    return {
        "bench": "tokenize_encode_batch",
        "threads": threads,
        "documents": len(texts),
        "tokens": tokens,
        "tokens_per_s": round(tokens / elapsed),
        "mb_per_s": round(text_bytes / elapsed / 1e6, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/nsconsole-bench-line"))
    parser.add_argument("--threads", type=int, default=2, help="tokenizers threads (RAYON_NUM_THREADS)")
    parser.add_argument("--seconds", type=float, default=3.0, help="time per reader measurement")
    args = parser.parse_args()
    # Must be set before tokenizers starts its thread pool (first encode).
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)

    from datalines import open_data_line
    from datalines.creation import init_embedded_line
    from datalines.preparer import prepare_cycle

    start = time.perf_counter()
    exists = (args.work / "dataline.json").exists()
    line = open_data_line(args.work) if exists else init_embedded_line(args.work)
    print(json.dumps({"bench": "embedded_init_or_open", "seconds": round(time.perf_counter() - start, 2)}))
    start = time.perf_counter()
    prepare_cycle(line, 0)
    print(json.dumps({"bench": "prepare_cycle0_or_verify", "seconds": round(time.perf_counter() - start, 2),
                      "tokens": line.cycle(0).manifest["tokens"]}))
    print(json.dumps(bench_tokenization(line, args.threads)))
    for seq_len in (512, 4096):
        print(json.dumps(bench_order(line, seq_len)))
    print(json.dumps(bench_interleave(1_000_000)))
    for seq_len, batch in ((512, 64), (4096, 8), (64, 512)):
        print(json.dumps(bench_reader(line, seq_len, batch, args.seconds)))


if __name__ == "__main__":
    main()
