"""Tiny random HF targets (Qwen3 and two Llamas) for the target tests, their inputs and their HF reference.

* Qwen3 (tied embeddings, q/k norms, head_dim != hidden / heads), Llama (untied, llama3 RoPE scaling) and
  Llama (tied, linear RoPE scaling), with non-trivial norm weights so a misplaced norm shows;
* `hf_reference`: transformers' own fp32 forward (logits and every hidden state), the oracle of the taps
  (``hidden_states[i + 1]`` is the tap of layer ``i``, docs/design.md §2 Conventions) and of the megatron target.
"""

from __future__ import annotations

import os

import torch

VOCAB, LAYERS, SEQ, BATCH = 300, 4, 12, 2
ATOL = 1e-4
TAPS = [0, 2]


def tiny_models(root: str) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
    )
    configs = {
        # head_dim 16 * 4 heads != hidden 32: megatron's kv_channels must follow head_dim.
        "qwen3": (Qwen3ForCausalLM, Qwen3Config(**common, head_dim=16, tie_word_embeddings=True, rope_theta=10000.0)),
        "llama": (
            LlamaForCausalLM,
            LlamaConfig(
                **common, tie_word_embeddings=False,
                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
            ),
        ),
        # Tied Llama with linear RoPE scaling (megatron's seq_len_interpolation_factor).
        "llama_linear": (
            LlamaForCausalLM,
            LlamaConfig(**common, tie_word_embeddings=True, rope_theta=500.0, rope_scaling={"rope_type": "linear", "factor": 4.0}),
        ),
    }
    models = {}
    for seed, (name, (cls, config)) in enumerate(configs.items()):
        torch.manual_seed(seed)
        model = cls(config).eval()
        with torch.no_grad():  # non-trivial norm weights, so a misplaced norm shows
            for pname, p in model.named_parameters():
                if "norm" in pname:
                    p.add_(0.3 * torch.randn_like(p))
        path = os.path.join(root, name)
        model.save_pretrained(path)
        models[name] = (model, path)
    return models


def tiny_inputs():
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    positions = torch.arange(SEQ)[None].repeat(BATCH, 1) + torch.tensor([[3], [90]])  # llama3 scaling matters
    keep = torch.ones(BATCH, SEQ, dtype=torch.long)
    keep[1, -4:] = 0  # right padding on row 1
    return ids, positions, keep


@torch.no_grad()
def hf_reference(model, **kwargs) -> dict:
    out = model(**kwargs, output_hidden_states=True, use_cache=False)
    return {"logits": out.logits.float(), "hidden": [h.float() for h in out.hidden_states]}


def count_calls(modules) -> tuple[list, list]:
    """Forward pre-hooks that count the calls of ``modules``; returns (counts, handles)."""
    counts = [0] * len(modules)

    def hook(index):
        def count(module, args):
            counts[index] += 1
        return count

    return counts, [m.register_forward_pre_hook(hook(i)) for i, m in enumerate(modules)]
