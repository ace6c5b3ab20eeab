"""KV geometry: bytes per block and chunk, and typed errors for bad shapes."""

from __future__ import annotations

import pytest

from tiered_kv import AttentionKind, GeometryError, KVGeometry, KVGroup


def llama_8b(**overrides: object) -> KVGeometry:
    fields: dict[str, object] = {
        "dtype": "bfloat16",
        "block_size": 16,
        "chunk_size": 256,
        "groups": (KVGroup(num_layers=32, num_kv_heads=8, head_dim=128),),
    }
    fields.update(overrides)
    return KVGeometry(**fields)  # type: ignore[arg-type]


def test_llama_8b_block_and_chunk_bytes() -> None:
    geometry = llama_8b()
    # K and V × 32 layers × 8 heads × 128 dims × 16 tokens × 2 bytes.
    assert geometry.block_bytes() == 2 * 32 * 8 * 128 * 16 * 2 == 2 * 2**20
    assert geometry.blocks_per_chunk == 16
    assert geometry.chunk_bytes() == 32 * 2**20


def test_mla_group_stores_one_latent_and_is_replicated() -> None:
    geometry = KVGeometry(
        dtype="bfloat16",
        block_size=64,
        chunk_size=256,
        groups=(KVGroup(kind=AttentionKind.MLA, num_layers=61, num_kv_heads=1, head_dim=576),),
    )
    assert geometry.block_bytes() == 61 * 576 * 64 * 2
    assert geometry.replicated


def test_hybrid_groups_have_their_own_sizes() -> None:
    geometry = llama_8b(
        dtype="float8_e4m3fn",
        groups=(
            KVGroup(num_layers=4, num_kv_heads=8, head_dim=128),
            KVGroup(kind=AttentionKind.SLIDING_WINDOW, window=4096, num_layers=20, num_kv_heads=8, head_dim=128),
        ),
    )
    assert geometry.chunk_bytes(0) == 2 * 4 * 8 * 128 * 256
    assert geometry.chunk_bytes(1) == 2 * 20 * 8 * 128 * 256
    assert not geometry.replicated


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: llama_8b(block_size=0), "block_size"),
        (lambda: llama_8b(chunk_size=-256), "chunk_size"),
        (lambda: llama_8b(chunk_size=200), "chunk_size"),
        (lambda: llama_8b(dtype="float13"), "dtype"),
        (lambda: llama_8b(groups=()), "groups"),
        (lambda: llama_8b(kv_layout=""), "kv_layout"),
        (lambda: KVGroup(num_layers=0, num_kv_heads=8, head_dim=128), "num_layers"),
        (lambda: KVGroup(num_layers=2, num_kv_heads=-1, head_dim=128), "num_kv_heads"),
        (lambda: KVGroup(num_layers=2, num_kv_heads=1, head_dim=True), "head_dim"),
        (lambda: KVGroup(kind=AttentionKind.SLIDING_WINDOW, num_layers=2, num_kv_heads=1, head_dim=8), "window"),
        (
            lambda: KVGroup(kind=AttentionKind.SLIDING_WINDOW, window=0, num_layers=2, num_kv_heads=1, head_dim=8),
            "window",
        ),
        (lambda: KVGroup(window=128, num_layers=2, num_kv_heads=1, head_dim=8), "window"),
        (lambda: KVGroup(kind=AttentionKind.MLA, num_layers=2, num_kv_heads=8, head_dim=8), "num_kv_heads"),
    ],
)
def test_bad_geometry_is_a_typed_error_naming_the_field(make, field: str) -> None:
    with pytest.raises(GeometryError) as caught:
        make()
    assert caught.value.field == field
    assert f"[{field}]" in str(caught.value)
