"""The workload section's two-engine trace: engines sharing a remote tier on a real
valkey-server serve more of the trace from cache than the same engines alone."""

from __future__ import annotations

import argparse

from conftest import make_namespace
from remote_support import requires_valkey

from tiered_kv.bench.schema import SharingFigures
from tiered_kv.bench.sharing import TRACE, sharing_table, two_engine_figures
from tiered_kv.layout import KVGeometry, KVGroup
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


def test_without_a_server_the_part_says_it_was_left_out() -> None:
    assert "left out: no valkey-server at hand" in sharing_table(None).render()
