"""The bench's model shapes: presets, custom shapes, and the chunk sizes the tiers section
derives from them."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tiered_kv.bench.models import PRESETS, add_model_arguments, model_from_args
from tiered_kv.bench.tiers import MiB, chunk_geometry
from tiered_kv.cli import main
from tiered_kv.cli_errors import UsageError
from tiered_kv.layout import AttentionKind
from tiered_kv.testing.valkey_server import missing


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_model_arguments(parser.add_argument_group("model"), {"x": "llama-1b"})
    return parser.parse_args(argv)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_is_a_namespace_of_256_token_chunks(name: str) -> None:
    namespace = PRESETS[name].namespace(256)
    assert namespace.model_id == PRESETS[name].model_id and namespace.geometry.chunk_size == 256
    assert PRESETS[name].model_id in PRESETS[name].describe()


def test_a_section_without_model_options_gets_its_own_preset() -> None:
    assert model_from_args(parse(), "llama-8b") == PRESETS["llama-8b"]
    assert model_from_args(parse("--model", "gemma-swa"), "llama-8b") == PRESETS["gemma-swa"]


def test_block_size_and_dtype_apply_to_a_preset() -> None:
    model = model_from_args(parse("--model", "llama-70b", "--block-size", "32", "--dtype", "float8_e4m3fn"), "x")
    assert (model.groups, model.block_size, model.dtype) == (PRESETS["llama-70b"].groups, 32, "float8_e4m3fn")


def test_a_custom_model_may_be_hybrid() -> None:
    args = parse("--model", "custom", "--layers", "2", "--kv-heads", "4", "--head-dim", "64")
    (full,) = model_from_args(args, "llama-1b").groups
    assert (full.kind, full.num_layers, full.num_kv_heads, full.head_dim) == (AttentionKind.FULL, 2, 4, 64)
    args = parse("--model", "custom", "--layers", "1", "--kv-heads", "1", "--head-dim", "8", "--window", "64")
    with pytest.raises(UsageError, match="--window and --window-layers go together"):
        model_from_args(args, "llama-1b")
    args.window_layers = 3
    _, window = model_from_args(args, "llama-1b").groups
    assert (window.kind, window.window, window.num_layers) == (AttentionKind.SLIDING_WINDOW, 64, 3)


def test_a_bad_custom_dimension_is_a_usage_error() -> None:
    with pytest.raises(SystemExit):  # the command line refuses it (exit 2) ...
        parse("--model", "custom", "--layers", "0", "--kv-heads", "1", "--head-dim", "8")
    args = parse("--model", "custom", "--layers", "1", "--kv-heads", "1", "--head-dim", "8")
    args.layers = 0  # ... and so does the model, for a caller that builds the arguments
    with pytest.raises(UsageError, match="num_layers"):
        model_from_args(args, "x")


def test_the_largest_group_of_a_hybrid_model_is_moved_as_full_attention() -> None:
    (group,) = PRESETS["gemma-swa"].largest_group().groups
    assert (group.kind, group.window, group.num_layers) == (AttentionKind.FULL, None, 52)


@given(name=st.sampled_from(sorted(PRESETS)), target_mib=st.integers(1, 64), block=st.sampled_from([None, 8, 32]))
def test_a_tiers_chunk_is_whole_blocks_and_whole_pages_near_its_size(name: str, target_mib: int, block: int) -> None:
    model = PRESETS[name].largest_group()
    model = model._replace(block_size=block or model.block_size)
    geometry = chunk_geometry(model, target_mib * MiB)
    assert geometry.chunk_size % geometry.block_size == 0
    assert geometry.chunk_bytes() % 4096 == 0
    smallest = chunk_geometry(model, 1)  # one run of whole blocks and whole pages
    assert geometry.chunk_bytes() <= max(target_mib * MiB, smallest.chunk_bytes())
    assert geometry.chunk_bytes() > target_mib * MiB - smallest.chunk_bytes()


@pytest.mark.parametrize("model", ["deepseek-mla", "gemma-swa"])
def test_bench_tiers_moves_chunks_of_mla_and_hybrid_presets(tmp_path: Path, model: str) -> None:
    out = tmp_path / "bench.json"
    args = ["bench", "tiers", "--model", model, "--chunk-mib", "1", "--tier-mem-mib", "1", "--tier-disk-mib", "1"]
    args += ["--tier-remote-mib", "1"]
    assert main([*args, "--tier-repeats", "1", "--io-depth", "2", "--nvme-dir", str(tmp_path), "--json", str(out)]) == 0
    figures = json.loads(out.read_text())["tiers"]
    expected = chunk_geometry(PRESETS[model].largest_group(), MiB).chunk_bytes()
    remote_rows = 0 if missing() else 2  # cpu->remote and remote->cpu when a valkey-server is at hand
    assert len(figures) == 10 + remote_rows and {f["chunk_bytes"] for f in figures} == {expected}
