"""A tiny Llama with seeded weights, written as a local Hugging Face checkpoint (config.json +
safetensors) so that a real vLLM engine can load it with no hub access.

The e2e tests need a model whose generated tokens depend on every byte of the KV cache, that
loads in seconds on a CPU, and that is the same on every machine: 2 layers, hidden 256, 4 query
heads sharing 2 KV heads (grouped-query attention, so the KV geometry is not the trivial one),
head_dim 64, vocabulary 1024. Weights are drawn from a seeded generator; no tokenizer is written
(the engine runs with skip_tokenizer_init and token-id prompts).

Runs in the engine's interpreter (it needs torch and safetensors):
    python tests/vllm_tiny_llama.py DIR [--seed N]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

VOCAB = 1024
HIDDEN = 256
INTERMEDIATE = 512
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
MAX_POSITIONS = 4096
# Large enough that attention is far from uniform, so outputs depend on the cached keys and values.
INIT_STD = 0.08


def config() -> dict[str, object]:
    """The Hugging Face config of the tiny model."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def weights(seed: int) -> dict[str, torch.Tensor]:
    """Seeded weights under the Hugging Face Llama parameter names."""
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * INIT_STD

    tensors = {
        "model.embed_tokens.weight": normal(VOCAB, HIDDEN),
        "model.norm.weight": torch.ones(HIDDEN),
        "lm_head.weight": normal(VOCAB, HIDDEN),
    }
    for i in range(LAYERS):
        prefix = f"model.layers.{i}"
        tensors |= {
            f"{prefix}.self_attn.q_proj.weight": normal(HEADS * HEAD_DIM, HIDDEN),
            f"{prefix}.self_attn.k_proj.weight": normal(KV_HEADS * HEAD_DIM, HIDDEN),
            f"{prefix}.self_attn.v_proj.weight": normal(KV_HEADS * HEAD_DIM, HIDDEN),
            f"{prefix}.self_attn.o_proj.weight": normal(HIDDEN, HEADS * HEAD_DIM),
            f"{prefix}.mlp.gate_proj.weight": normal(INTERMEDIATE, HIDDEN),
            f"{prefix}.mlp.up_proj.weight": normal(INTERMEDIATE, HIDDEN),
            f"{prefix}.mlp.down_proj.weight": normal(HIDDEN, INTERMEDIATE),
            f"{prefix}.input_layernorm.weight": torch.ones(HIDDEN),
            f"{prefix}.post_attention_layernorm.weight": torch.ones(HIDDEN),
        }
    return tensors


def write_tiny_llama(directory: Path, seed: int = 0) -> Path:
    """Write the checkpoint into `directory` (created if needed) and return it."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config(), indent=2))
    save_file(weights(seed), str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    write_tiny_llama(args.directory, args.seed)


if __name__ == "__main__":
    main()
