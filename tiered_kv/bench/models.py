"""Model shape presets for the bench (``--model``), and custom dimensions.

Each preset is the KV geometry of a public model family, as one tensor-parallel rank
holds it: layer counts, KV heads and head sizes from the models' published configs.
"""

from __future__ import annotations

import argparse

from tiered_kv.layout import AttentionKind, KVGeometry, KVGroup
from tiered_kv.namespace import Namespace


def _full(layers: int, heads: int, head_dim: int) -> KVGroup:
    return KVGroup(num_layers=layers, num_kv_heads=heads, head_dim=head_dim)


PRESETS: dict[str, tuple[str, tuple[KVGroup, ...], int]] = {
    # name: (model id, KV groups, GPU block size in tokens)
    "llama-1b": ("meta-llama/Llama-3.2-1B", (_full(16, 8, 64),), 16),
    "llama-8b": ("meta-llama/Llama-3.1-8B", (_full(32, 8, 128),), 16),
    # 80 layers x 8 KV heads; one rank of TP=8 holds one head.
    "llama-70b": ("meta-llama/Llama-3.1-70B", (_full(80, 1, 128),), 16),
    # One 576-wide latent (512 + 64 rope) per token and layer, identical on every rank.
    "deepseek-mla": (
        "deepseek-ai/DeepSeek-V3",
        (KVGroup(kind=AttentionKind.MLA, num_layers=61, num_kv_heads=1, head_dim=576),),
        64,
    ),
    # Interleaved local (window 1024) and global attention, 5:1.
    "gemma-swa": (
        "google/gemma-3-27b",
        (
            _full(10, 16, 128),
            KVGroup(kind=AttentionKind.SLIDING_WINDOW, window=1024, num_layers=52, num_kv_heads=16, head_dim=128),
        ),
        16,
    ),
}


def add_model_arguments(parser: argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--model", choices=[*PRESETS, "custom"], default="llama-1b", help="KV shape preset (default llama-1b)"
    )
    parser.add_argument("--layers", type=int, help="custom: layers")
    parser.add_argument("--kv-heads", type=int, help="custom: KV heads per rank")
    parser.add_argument("--head-dim", type=int, help="custom: head size")
    parser.add_argument("--block-size", type=int, default=None, help="GPU block size in tokens (default: preset's)")
    parser.add_argument("--chunk-tokens", type=int, default=256, help="tokens per offload chunk (default 256)")
    parser.add_argument("--dtype", default="bfloat16", help="KV dtype (default bfloat16)")


def namespace_from_args(args: argparse.Namespace) -> Namespace:
    """The bench's namespace from ``--model`` (or ``custom`` with ``--layers`` …)."""
    if args.model == "custom":
        missing = [
            flag
            for flag, value in (("--layers", args.layers), ("--kv-heads", args.kv_heads), ("--head-dim", args.head_dim))
            if value is None
        ]
        if missing:
            raise SystemExit(f"--model custom needs {', '.join(missing)}")
        preset: tuple[str, tuple[KVGroup, ...], int] = (
            "custom",
            (_full(args.layers, args.kv_heads, args.head_dim),),
            16,
        )
    else:
        preset = PRESETS[args.model]
    model_id, groups, block = preset
    return Namespace(
        model_id=model_id,
        model_revision="bench",
        geometry=KVGeometry(
            dtype=args.dtype, block_size=args.block_size or block, chunk_size=args.chunk_tokens, groups=groups
        ),
    )
