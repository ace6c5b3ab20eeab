"""Bench section ``keys``: chunk-key hashing throughput for a long prompt.

vLLM reports 100–200 ns per token for its SHA-256 prefix hashing; the figure here is the
whole :func:`tiered_kv.keys.chunk_keys` path (token packing, chained block hashes, chunk
keys) for one prompt, best and median of several repetitions.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np

from tiered_kv.bench import SectionResult
from tiered_kv.bench.models import model_from_args
from tiered_kv.bench.report import Progress, Table
from tiered_kv.bench.schema import KeysCase, KeysFigures
from tiered_kv.cli_errors import positive_int
from tiered_kv.keys import chunk_keys, chunk_keys_from_block_hashes

#: GPU blocks per chunk: 256-token chunks over 16-token blocks, as the workload's.
BLOCKS_PER_CHUNK = 16


class KeysSection:
    name = "keys"
    summary = "chunk-key hashing throughput (ns per token)"
    model = "llama-8b"

    def add_arguments(self, parser: argparse._ArgumentGroup) -> None:
        parser.add_argument("--key-tokens", type=positive_int, default=131072, help="prompt length (default 131072)")
        parser.add_argument("--key-repeats", type=positive_int, default=7, help="timed repetitions (default 7)")

    def run(self, args: argparse.Namespace, progress: Progress) -> SectionResult:
        n_tokens, repeats = args.key_tokens, args.key_repeats
        model = model_from_args(args, self.model)
        block_size, chunk_size = model.block_size, model.block_size * BLOCKS_PER_CHUNK
        namespace = model.namespace(chunk_size)
        rng = np.random.default_rng(0)
        token_array = rng.integers(0, 128_256, n_tokens, dtype=np.int64)
        token_list = token_array.tolist()
        engine_hashes = [rng.bytes(32) for _ in range(n_tokens // block_size)]
        cases: list[tuple[str, int, Callable[[], object]]] = [
            ("token ids (list)", n_tokens, lambda: chunk_keys(namespace, token_list)),
            ("token ids (numpy)", n_tokens, lambda: chunk_keys(namespace, token_array)),
            ("engine block hashes", n_tokens, lambda: chunk_keys_from_block_hashes(namespace, engine_hashes)),
        ]
        rows, payload_cases = [], []
        for i, (label, tokens, fn) in enumerate(cases):
            progress.step(i, len(cases), label)
            times = []
            for _ in range(repeats):
                started = time.perf_counter()
                fn()
                times.append(time.perf_counter() - started)
            best, median = min(times), statistics.median(times)
            payload_cases.append(
                KeysCase(
                    input=label,
                    tokens=tokens,
                    ns_per_token_best=best * 1e9 / tokens,
                    ns_per_token_median=median * 1e9 / tokens,
                    tokens_per_s_median=tokens / median,
                )
            )
            rows.append(
                [
                    label,
                    f"{tokens:,}",
                    f"{best * 1e9 / tokens:.1f}",
                    f"{median * 1e9 / tokens:.1f}",
                    f"{tokens / median / 1e6:.1f}",
                ]
            )
        progress.step(len(cases), len(cases), "done")
        table = Table(
            title=f"keys: SHA-256 chunk keys, block {block_size}, chunk {chunk_size} tokens",
            headers=["input", "tokens", "ns/token best", "ns/token median", "Mtokens/s"],
            rows=rows,
            note="reference: vLLM reports 100-200 ns/token for SHA-256 prefix hashing",
        )
        return SectionResult(
            payload=KeysFigures(block_size=block_size, chunk_size=chunk_size, repeats=repeats, cases=payload_cases),
            tables=[table],
        )
