"""Bench section ``tiers``: each tier driver path against this machine's raw limit.

For each chunk size, in one run:

* ``gpu->cpu`` and ``cpu->gpu`` (a CPU stand-in for the GPU without CUDA) over a cache
  of the model's shape (``--model``, Llama-3.1-8B by default: 32 layers, 8 KV heads of
  128, bf16, 128 KiB per token; a hybrid model's largest group) in two layouts:
  ``per-layer`` tensors ``[2, num_blocks, block, heads, dim]`` (vLLM's; one latent
  instead of K and V for MLA) and one ``fused`` tensor ``[num_blocks, layers, 2, block,
  heads, dim]``; the limit is a ``torch`` copy of the same chunks between the same memory
  (see :mod:`tiered_kv.bench.probe`).
* ``cpu->nvme`` and ``nvme->cpu``: the nvme driver writing and reading slots in order,
  against ``O_DIRECT`` sequential I/O from and into the same slots at the same block size
  and I/O depth; both sides use ``O_DIRECT``, so the page cache flatters neither.

* ``cpu->gpu via manager`` and ``nvme->gpu via manager``: loads through a whole
  ``TieredKV`` (chunks in cpu, or only on nvme and promoted), ``LOAD_CHUNKS`` chunks per
  load and ``LOADS_IN_FLIGHT`` loads at once, against the gpu driver alone copying the
  same chunks in the same parts, and against ``O_DIRECT`` reads of the same bytes.

Raw and driver passes alternate and repeat after a warm-up pass; figures are medians.
On a virtual machine the guest's ``O_DIRECT`` does not bypass the host's page cache: a
file only read (the manager's store) can then read faster than one the probe also
rewrites between reads, and a ratio above 1 says so rather than that the limit is wrong
on real hardware.
Each run also checks that a chunk taken gpu→cpu→nvme→cpu→gpu comes back bit-identical.
The drivers are found by name in :data:`tiered_kv.registry.TIERS`. A chunk size is
rounded down to whole GPU blocks whose bytes fill whole 4 KiB pages (``O_DIRECT``), at
least one such run. The measurements live in :mod:`tiered_kv.bench.tier_paths`, imported
when the section runs.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import tempfile
from pathlib import Path

import msgspec

from tiered_kv.bench import SectionResult
from tiered_kv.bench.models import BenchModel, model_from_args
from tiered_kv.bench.report import Progress, Table
from tiered_kv.cli_errors import positive_int
from tiered_kv.layout import KVGeometry

MiB = 1 << 20
#: ``O_DIRECT`` I/O is page-aligned: a chunk's bytes are a whole number of pages.
PAGE = 4096
#: Loads through the whole ``TieredKV`` path, against the driver (or disk) doing the same alone.
MANAGER_CPU, MANAGER_NVME = "cpu->gpu via manager", "nvme->gpu via manager"
#: Chunks per ``TieredKV.load`` call in the manager passes, and loads in flight at once.
LOAD_CHUNKS, LOADS_IN_FLIGHT = 4, 2
#: Driver throughput as a fraction of the raw limit that the issue asks for.
TARGETS = {
    "gpu->cpu": 0.85,
    "cpu->gpu": 0.85,
    "cpu->nvme": 0.80,
    "nvme->cpu": 0.80,
    MANAGER_CPU: 0.80,
    MANAGER_NVME: 0.80,
    "cpu->remote": 0.80,
    "remote->cpu": 0.80,
}


class TierFigure(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    path: str
    chunk_bytes: int
    gbps: float
    limit_gbps: float
    limit: str
    ratio: float
    #: gpu paths: how the engine holds its KV cache (``per-layer``, ``fused``), and whether
    #: a job's blocks are scattered (``per-layer, scattered``) rather than in order.
    layout: str | None = None


def mib(nbytes: int) -> str:
    """``2`` for 2 MiB, ``2.14`` for a chunk a little larger."""
    return f"{nbytes / MiB:.3g}"


def _chunk_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) * MiB for part in text.split(",") if part.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(size <= 0 for size in sizes):
        raise argparse.ArgumentTypeError(f"expected MiB sizes like 2,32, got {text!r}")
    return sizes


def chunk_geometry(model: BenchModel, target_bytes: int) -> KVGeometry:
    """``model`` (one group) with chunks of about ``target_bytes``: whole blocks, whole pages."""
    token_bytes = model.geometry(model.block_size).block_bytes() // model.block_size
    step = math.lcm(model.block_size, PAGE // math.gcd(token_bytes, PAGE))
    return model.geometry(max(step, target_bytes // token_bytes // step * step))


class TiersSection:
    name = "tiers"
    summary = "tier drivers' throughput against this machine's raw copy and O_DIRECT limits"
    model = "llama-8b"

    def add_arguments(self, parser: argparse._ArgumentGroup) -> None:
        parser.add_argument(
            "--chunk-mib", type=_chunk_sizes, default=_chunk_sizes("2,32"), help="chunk sizes in MiB (default 2,32)"
        )
        parser.add_argument("--tier-mem-mib", type=positive_int, default=512, help="MiB per memory pass (default 512)")
        parser.add_argument("--tier-disk-mib", type=positive_int, default=512, help="MiB per disk pass (default 512)")
        parser.add_argument("--tier-repeats", type=positive_int, default=5, help="timed passes per path (default 5)")
        parser.add_argument(
            "--io-depth", type=positive_int, default=8, help="concurrent disk and remote I/Os (default 8)"
        )
        parser.add_argument(
            "--remote-url", help="a Valkey/Redis server for the remote rows (default: start a local valkey-server)"
        )
        parser.add_argument(
            "--tier-remote-mib", type=positive_int, default=256, help="MiB per remote pass (default 256)"
        )

    def run(self, args: argparse.Namespace, progress: Progress) -> SectionResult:
        from tiered_kv.bench.probe import filesystem
        from tiered_kv.bench.tier_paths import gpu_device

        model = model_from_args(args, self.model).largest_group()
        geometries = [chunk_geometry(model, size) for size in args.chunk_mib]
        figures = asyncio.run(self._run(args, geometries, progress))
        where = args.nvme_dir or Path(tempfile.gettempdir())
        rows = [
            [
                f.path,
                f.layout or "",
                f"{mib(f.chunk_bytes)} MiB",
                f"{f.limit_gbps:.2f}",
                f"{f.gbps:.2f}",
                f"{f.ratio:.2f}",
                f"{TARGETS[f.path]:.2f}",
                f.limit,
            ]
            for f in figures
        ]
        table = Table(
            title=f"tiers: driver throughput vs this machine's limit (GB/s, medians of {args.tier_repeats}), "
            f"{model.describe()}",
            headers=["path", "layout", "chunk", "limit", "driver", "ratio", "target", "limit measured as"],
            rows=rows,
            note=f"disk files in {where} ({filesystem(where)})"
            + ("; gpu paths run on a CPU stand-in without CUDA" if gpu_device() == "cpu" else "")
            + ("" if any(f.path == "cpu->remote" for f in figures) else "; no remote rows: no server at hand"),
        )
        return SectionResult(payload=msgspec.to_builtins(figures), tables=[table])

    async def _run(
        self, args: argparse.Namespace, geometries: list[KVGeometry], progress: Progress
    ) -> list[TierFigure]:
        from tiered_kv.bench import remote
        from tiered_kv.bench.tier_paths import disk_paths, memory_paths

        figures: list[TierFigure] = []
        steps = 2 * len(geometries)
        with tempfile.TemporaryDirectory(dir=args.nvme_dir, prefix="tiered-kv-bench-") as tmp:
            for i, geometry in enumerate(geometries):
                size = mib(geometry.chunk_bytes())
                progress.step(2 * i, steps, f"memory, {size} MiB chunks")
                figures += await memory_paths(geometry, args.tier_mem_mib * MiB, args.tier_repeats)
                progress.step(2 * i + 1, steps, f"disk, {size} MiB chunks")
                figures += await disk_paths(
                    geometry, args.tier_disk_mib * MiB, args.io_depth, args.tier_repeats, Path(tmp)
                )
                figures += await remote.remote_figures(args, geometry) or []
            progress.step(steps, steps, "done")
        return figures
