"""The namespace of a vLLM engine's KV cache: from what a worker reads off vLLM, checked
against the bytes per block its registered tensors hold, one per engine over every TP rank,
never shared with another layout, vLLM release or checkpoint."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import pytest

from tiered_kv.errors import ConfigError
from tiered_kv.integrations.vllm.engine_namespace import EngineFacts, cache_dtype, engine_namespace, model_revision

FACTS = EngineFacts(
    model="/models/tiny",
    revision="local-abc",
    cache_dtype="float32",
    block_sizes=(32,),
    group_layers=(2,),
    blocks_per_chunk=4,
    kv_heads_per_rank=2,
    head_dim=64,
    use_mla=False,
    sliding_window=None,
    world_size=1,
    tp_size=1,
    pp_size=1,
    pcp_size=1,
    dcp_size=1,
    kv_cache_layout="LBHNC",
    platform="cpu",
    vllm_version="0.32.0",
)
#: One rank's bytes per block of the tiny Llama: 2 layers × K,V × 2 heads × 64 × 32 tokens × 4 bytes.
PAGE = 2 * 2 * 2 * 64 * 32 * 4


def facts(**changes: object) -> EngineFacts:
    return msgspec.structs.replace(FACTS, **changes)


def test_the_tiny_llamas_namespace_describes_its_chunks() -> None:
    namespace = engine_namespace(FACTS, [PAGE])
    geometry = namespace.geometry
    assert (namespace.model_id, namespace.model_revision) == ("/models/tiny", "local-abc")
    assert (geometry.block_size, geometry.chunk_size, geometry.dtype) == (32, 128, "float32")
    assert geometry.chunk_bytes(0) == PAGE * 4
    assert geometry.kv_layout == "LBHNC/ranks-concat/vllm-0.32.0/cpu"
    assert (namespace.tp_size, namespace.tp_rank) == (1, 0)


def test_tensor_parallel_ranks_share_one_namespace_whose_chunks_hold_every_rank() -> None:
    tp4 = facts(world_size=4, tp_size=4, kv_heads_per_rank=1)
    namespace = engine_namespace(tp4, [PAGE // 2])
    assert namespace.tp_size == 4 and namespace.tp_rank == 0
    assert namespace.geometry.chunk_bytes(0) == 4 * (PAGE // 2) * 4
    # never the fingerprint of the single-rank engine, nor of another layout or release
    others = [
        engine_namespace(FACTS, [PAGE]),
        engine_namespace(facts(world_size=4, tp_size=4, kv_heads_per_rank=1, kv_cache_layout="NHD"), [PAGE // 2]),
        engine_namespace(facts(world_size=4, tp_size=4, kv_heads_per_rank=1, vllm_version="0.33.0"), [PAGE // 2]),
        engine_namespace(facts(world_size=4, tp_size=4, kv_heads_per_rank=1, platform="cuda"), [PAGE // 2]),
    ]
    assert len({n.fingerprint for n in [namespace, *others]}) == 5


def test_tensors_that_hold_other_bytes_per_block_stop_the_engine() -> None:
    with pytest.raises(ConfigError, match=f"hold {PAGE + 64} bytes per block") as err:
        engine_namespace(FACTS, [PAGE + 64])  # a quantized cache with scales, say
    assert err.value.field == "kv_caches"


@pytest.mark.parametrize(
    ("changes", "what"),
    [
        ({"use_mla": True}, "MLA"),
        ({"sliding_window": 4096}, "sliding-window"),
        ({"pp_size": 2, "world_size": 2}, "pipeline"),
        ({"dcp_size": 2}, "context parallelism"),
        ({"block_sizes": (32, 16), "group_layers": (1, 1)}, "block sizes"),
    ],
)
def test_what_the_adapter_does_not_support_yet_is_refused_by_name(changes: dict[str, object], what: str) -> None:
    with pytest.raises(ConfigError, match=what):
        engine_namespace(facts(**changes), [PAGE] * len(facts(**changes).group_layers))


def test_vllms_fp8_cache_dtypes_map_onto_tiered_kvs() -> None:
    assert cache_dtype("torch.bfloat16") == "bfloat16"
    assert cache_dtype("fp8") == cache_dtype("fp8_e4m3") == "float8_e4m3fn"
    assert cache_dtype("fp8_e5m2") == "float8_e5m2"


def test_a_local_checkpoints_revision_changes_when_its_files_do(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"layers": 2}')
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"w" * 100)
    first = model_revision(str(tmp_path), None)
    assert first.startswith("local-") and model_revision(str(tmp_path), None) == first
    os.utime(weights, ns=(1, 1))  # rewritten in place, same size
    second = model_revision(str(tmp_path), None)
    (tmp_path / "config.json").write_text('{"layers": 3}')
    third = model_revision(str(tmp_path), None)
    assert len({first, second, third}) == 3
    assert model_revision(str(tmp_path), "v2") == "v2"
