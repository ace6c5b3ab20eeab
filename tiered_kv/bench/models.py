"""Model shape presets for the bench (``--model``), and custom dimensions.

Each preset is the KV geometry of a public model family, as one tensor-parallel rank
holds it: layer counts, KV heads and head sizes from the models' published configs.
Every section that builds a KV cache takes its shape from here; a section names the
preset it uses when ``--model`` is not given. The chunk size is the section's: the
workload's traces fix it, the tiers section sweeps chunk sizes in MiB.
"""

from __future__ import annotations

import argparse
from typing import NamedTuple

import msgspec

from tiered_kv.cli_errors import UsageError, positive_int
from tiered_kv.errors import ConfigError
from tiered_kv.layout import DTYPE_BYTES, AttentionKind, KVGeometry, KVGroup
from tiered_kv.namespace import Namespace


class BenchModel(NamedTuple):
    """A model's KV shape, without the chunk size."""

    model_id: str
    groups: tuple[KVGroup, ...]
    block_size: int
    dtype: str = "bfloat16"

    def geometry(self, chunk_tokens: int) -> KVGeometry:
        """The geometry with ``chunk_tokens``-token chunks; a shape that cannot hold them is
        a :class:`UsageError` naming the numbers."""
        try:
            return KVGeometry(dtype=self.dtype, block_size=self.block_size, chunk_size=chunk_tokens, groups=self.groups)
        except ConfigError as exc:
            raise UsageError(f"{self.model_id}: {exc}") from exc

    def namespace(self, chunk_tokens: int) -> Namespace:
        return Namespace(model_id=self.model_id, model_revision="bench", geometry=self.geometry(chunk_tokens))

    def largest_group(self) -> BenchModel:
        """The model cut to its KV group with the most bytes per token, a sliding window
        taken as full attention: for sections that move or plan one group's chunks, where a
        window would only change which blocks a load fills."""
        group = max(self.groups, key=lambda g: g.tensors_per_layer * g.num_layers * g.num_kv_heads * g.head_dim)
        if group.kind is AttentionKind.SLIDING_WINDOW:
            group = msgspec.structs.replace(group, kind=AttentionKind.FULL, window=None)
        return self._replace(groups=(group,))

    def describe(self) -> str:
        """``meta-llama/Llama-3.1-8B (32 layers x 8 KV heads x 128, bfloat16, 16-token blocks)``."""
        groups = "; ".join(_describe_group(group) for group in self.groups)
        return f"{self.model_id} ({groups}, {self.dtype}, {self.block_size}-token blocks)"


def _describe_group(group: KVGroup) -> str:
    shape = f"{group.num_layers} layers x {group.num_kv_heads} KV heads x {group.head_dim}"
    if group.kind is AttentionKind.SLIDING_WINDOW:
        return f"{shape}, window {group.window}"
    return f"{shape}, MLA" if group.kind is AttentionKind.MLA else shape


def _full(layers: int, heads: int, head_dim: int) -> KVGroup:
    return KVGroup(num_layers=layers, num_kv_heads=heads, head_dim=head_dim)


PRESETS: dict[str, BenchModel] = {
    "llama-1b": BenchModel("meta-llama/Llama-3.2-1B", (_full(16, 8, 64),), 16),
    "llama-8b": BenchModel("meta-llama/Llama-3.1-8B", (_full(32, 8, 128),), 16),
    # 80 layers x 8 KV heads; one rank of TP=8 holds one head.
    "llama-70b": BenchModel("meta-llama/Llama-3.1-70B", (_full(80, 1, 128),), 16),
    # One 576-wide latent (512 + 64 rope) per token and layer, identical on every rank.
    "deepseek-mla": BenchModel(
        "deepseek-ai/DeepSeek-V3",
        (KVGroup(kind=AttentionKind.MLA, num_layers=61, num_kv_heads=1, head_dim=576),),
        64,
    ),
    # Interleaved local (window 1024) and global attention, 5:1.
    "gemma-swa": BenchModel(
        "google/gemma-3-27b",
        (
            _full(10, 16, 128),
            KVGroup(kind=AttentionKind.SLIDING_WINDOW, window=1024, num_layers=52, num_kv_heads=16, head_dim=128),
        ),
        16,
    ),
}

_CUSTOM = {"layers": "--layers", "kv_heads": "--kv-heads", "head_dim": "--head-dim"}
_WINDOW = {"window": "--window", "window_layers": "--window-layers"}


def add_model_arguments(parser: argparse._ArgumentGroup, defaults: dict[str, str]) -> None:
    """The model-shape options; ``defaults`` maps each section that reads them to its preset."""
    each = ", ".join(f"{section} {preset}" for section, preset in defaults.items())
    parser.add_argument(
        "--model", choices=[*PRESETS, "custom"], default=None, help=f"KV shape preset (default: {each})"
    )
    parser.add_argument("--layers", type=positive_int, help="custom: layers of full attention")
    parser.add_argument("--kv-heads", type=positive_int, help="custom: KV heads per rank")
    parser.add_argument("--head-dim", type=positive_int, help="custom: head size")
    parser.add_argument(
        "--window", type=positive_int, help="custom: add a sliding-window group with this window (tokens)"
    )
    parser.add_argument("--window-layers", type=positive_int, help="custom: layers of the sliding-window group")
    parser.add_argument(
        "--block-size", type=positive_int, default=None, help="GPU block size in tokens (default: preset's)"
    )
    parser.add_argument("--dtype", choices=list(DTYPE_BYTES), default=None, help="KV dtype (default: bfloat16)")


def model_from_args(args: argparse.Namespace, default: str) -> BenchModel:
    """The model ``--model`` names (``default`` when it names none), with ``--block-size``
    and ``--dtype`` applied; options that do not fit the choice are a :class:`UsageError`."""
    name = args.model or default
    given = {dest: flag for dest, flag in {**_CUSTOM, **_WINDOW}.items() if getattr(args, dest) is not None}
    if name != "custom":
        if given:
            raise UsageError(f"{', '.join(given.values())} describe --model custom; {name} has its own shape")
        model = PRESETS[name]
    else:
        model = _custom(args, given)
    return model._replace(block_size=args.block_size or model.block_size, dtype=args.dtype or model.dtype)


def _custom(args: argparse.Namespace, given: dict[str, str]) -> BenchModel:
    missing = [flag for dest, flag in _CUSTOM.items() if dest not in given]
    if missing:
        raise UsageError(f"--model custom needs {', '.join(missing)}")
    window = [flag for dest, flag in _WINDOW.items() if dest in given]
    if len(window) == 1:
        raise UsageError("--window and --window-layers go together")
    try:
        groups = [_full(args.layers, args.kv_heads, args.head_dim)]
        if window:
            groups.append(
                KVGroup(
                    kind=AttentionKind.SLIDING_WINDOW,
                    window=args.window,
                    num_layers=args.window_layers,
                    num_kv_heads=args.kv_heads,
                    head_dim=args.head_dim,
                )
            )
    except ConfigError as exc:
        raise UsageError(f"--model custom: {exc}") from exc
    return BenchModel("custom", tuple(groups), 16)
