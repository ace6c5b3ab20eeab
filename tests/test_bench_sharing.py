"""The workload section's two-engine trace: engines sharing a remote tier on a real
valkey-server serve more of the trace from cache than the same engines alone."""

from __future__ import annotations

import argparse

from conftest import make_namespace
from remote_support import requires_valkey

from tiered_kv.bench.schema import SharingFigures
from tiered_kv.bench.sharing import TRACE, sharing_table, two_engine_figures
from tiered_kv.layout import KVGeometry, KVGroup
from tiered_kv.trace_file import parse_lines
from tiered_kv.traces import CHUNK_TOKENS, standard_traces

pytestmark = requires_valkey

TINY = make_namespace(
    model_id="acme/tiny-256",
    geometry=KVGeometry(
        dtype="float16",
        block_size=16,
        chunk_size=CHUNK_TOKENS,
        groups=(KVGroup(num_layers=1, num_kv_heads=1, head_dim=8),),
    ),
)


async def test_sharing_a_remote_tier_buys_hits_the_engines_alone_miss() -> None:
    requests = standard_traces(7, scale=60 / 4000)[TRACE]
    args = argparse.Namespace(cpu_fraction=0.1, nvme_fraction=0.4, nvme_dir=None, prefill_tokens_per_s=10_000.0)
    figures = await two_engine_figures(TRACE, requests, TINY, args)
    assert isinstance(figures, SharingFigures)
    alone, shared = figures.runs
    assert (alone.mode, shared.mode) == ("alone", "shared")
    assert "remote" not in alone.staged_from and shared.staged_from["remote"] > 0
    assert shared.hit_rate > alone.hit_rate
    assert figures.extra_hit_rate == shared.hit_rate - alone.hit_rate
    assert alone.chunks_looked_up == shared.chunks_looked_up == sum(len(r.keys) for r in requests)
    assert "sharing buys +" in sharing_table(figures).render()


async def test_the_engines_load_prompts_longer_than_32_chunks() -> None:
    # Their block tables used to wrap at 32 chunks: every load of a longer prompt was rejected.
    line = b'{"timestamp": 0, "input_length": 10240, "hash_ids": [%s]}' % b",".join(b"%d" % i for i in range(40))
    requests = parse_lines([line] * 4, name="long", block_tokens=256, chunk_tokens=CHUNK_TOKENS).requests
    args = argparse.Namespace(cpu_fraction=1.0, nvme_fraction=1.0, nvme_dir=None, prefill_tokens_per_s=10_000.0)
    figures = await two_engine_figures("long", requests, TINY, args)
    assert isinstance(figures, SharingFigures)
    assert all(run.tokens_from_cache > 0 for run in figures.runs)


def test_without_a_server_the_part_says_it_was_left_out() -> None:
    assert "left out: no valkey-server at hand" in sharing_table(None).render()
