"""Tiny in-process models for the decoding tests: HF targets, DFlash / DFlash 2 drafts that read their taps,
prompts, greedy references and the statistics every decode must add up to.

* `qwen3_target` / `llama_target`: random HF targets (hidden `HIDDEN`, `TARGET_LAYERS` layers), optionally
  shaped (`shape_target`) so that a random draft's proposals are accepted fully ("absorbing"), partly
  ("alternating") or differently per row ("mixed");
* `draft_config` / `make_draft`: drafts tapping layers `TAPS` of those targets;
* `hf_greedy`: transformers' own greedy continuation, the oracle of lossless greedy decoding;
* `check_statistics`: the counters of a `spec_generate` output that must agree whatever the tokens are;
* `write_models`: a target, a draft and a prompt file on disk, for the acceptance CLI.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from megatron_dflash.draft.body import DFlashBody
from megatron_dflash.draft.config import DFlashConfig
from megatron_dflash.variants.dflash2 import DFlash2Body, DFlash2Config

HIDDEN = 64
TARGET_LAYERS = 4
TAPS = [0, 2]


def shape_target(model, mode: str, favourite: int = 7) -> None:
    """Make the target's greedy continuation predictable for a random draft.

    Every embedding gets a large constant first coordinate and the LM head reads that
    coordinate almost only for `favourite`: whatever the draft's hidden state, its argmax is
    `favourite`, and the target's mostly is too. "absorbing": after `favourite` the target
    keeps emitting it (whole blocks accepted). "alternating": the head row of `favourite`
    points away from its own embedding, so the target alternates `favourite, x, favourite,
    ...` (one draft token accepted per block). "mixed": stronger attention/MLP outputs make
    the target's choice depend on the context, so rows of a batch accept different lengths
    (none, partial, whole blocks).
    """
    with torch.no_grad():
        embedding = model.get_input_embeddings().weight
        embedding.normal_(0.0, 1.0)
        embedding[:, 0] = 3.0
        head = model.get_output_embeddings().weight
        head.normal_(0.0, 1.0)
        head[:, 0] = 0.0
        if mode == "alternating":
            head[favourite] -= 0.5 * embedding[favourite]
        head[favourite, 0] = 10.0
        if mode == "mixed":
            for name, param in model.model.layers.named_parameters():
                if name.endswith(("o_proj.weight", "down_proj.weight", "v_proj.weight")):
                    param.normal_(0.0, 0.5)
            head[favourite, 0] = 11.0


def qwen3_target(vocab: int = 96, seed: int = 0, mode: str = "random", head_std: float | None = None):
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=TARGET_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        rope_theta=10000.0,
    )
    model = Qwen3ForCausalLM(config).eval()
    if mode != "random":
        shape_target(model, mode)
    if head_std is not None:
        with torch.no_grad():
            model.lm_head.weight.normal_(0.0, head_std)
    return model


def llama_target(vocab: int = 96, seed: int = 0, mode: str = "random"):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=TARGET_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    if mode != "random":
        shape_target(model, mode)
    return model


def draft_config(vocab: int, *, dflash2: bool = False, block_size: int = 4, **overrides):
    kwargs = dict(
        hidden_size=HIDDEN,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=vocab,
        block_size=block_size,
        mask_token_id=vocab - 1,
        num_target_layers=TARGET_LAYERS,
        target_layer_ids=TAPS,
        max_position_embeddings=512,
        rope_theta=10000.0,
    )
    kwargs.update(overrides)
    if dflash2:
        kwargs.update(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=min(4, vocab))
        return DFlash2Config(**kwargs)
    return DFlashConfig(**kwargs)


def make_draft(vocab: int, *, dflash2: bool = False, block_size: int = 4, seed: int = 1, backend="dense", **overrides):
    torch.manual_seed(seed)
    config = draft_config(vocab, dflash2=dflash2, block_size=block_size, **overrides)
    body = (DFlash2Body if dflash2 else DFlashBody)(config, attention_backend=backend).eval()
    if dflash2:
        randomize_dflash2(body)
    return body


def randomize_dflash2(body) -> None:
    """Random in-block convolutions and selector for a DFlash 2 body (they start as the identity, which would
    hide their part in any comparison); the kernels stay near the identity so the draft stays useful."""
    with torch.no_grad():
        for name, param in body.named_parameters():
            if "conv" in name or "candidate_selector" in name:
                param.normal_(0.0, 0.2)
        for layer in body.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel[:, 0] += 1.0


def hf_greedy(target, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = target.generate(
            torch.tensor([prompt]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False
        )
    return out[0].tolist()


PROMPTS = [[5, 17, 3, 40, 22], [9, 1, 33, 60, 2, 71, 8, 50, 11], [44, 3, 19]]
PROMPTS_SMALL = [[1, 2, 3], [4, 5, 6, 7, 1], [2]]  # for vocabulary 8


def check_statistics(out, block_size: int, max_new_tokens: int) -> None:
    """Statistics that must add up whatever the tokens are."""
    B = out.batch_size
    assert out.num_prefill_forwards == 1
    assert out.num_draft_forwards == out.num_target_forwards == max(out.num_cycles)
    for b in range(B):
        generated = int(out.num_generated[b])
        assert generated == len(out.generated(b)) <= max_new_tokens
        cycles = out.acceptance_lengths[b]
        assert all(1 <= a <= block_size for a in cycles)
        # The first token comes from the prefill, every other from a verify cycle.
        assert generated == 1 + sum(cycles)
        if not bool(out.stopped[b]):
            assert generated == max_new_tokens
        assert out.tokens[b, int(out.lengths[b]) :].eq(out.pad_token_id).all()
    flat = [a for row in out.acceptance_lengths for a in row]
    if flat:
        assert out.mean_acceptance_length == pytest.approx(sum(flat) / len(flat))


def write_models(tmp_path, dflash2: bool):
    from megatron_dflash.checkpoint.hf import save_hf_checkpoint

    vocab = 96
    target = qwen3_target(vocab=vocab, mode="absorbing")
    target_dir = tmp_path / "target"
    target.save_pretrained(target_dir)
    draft = make_draft(vocab, dflash2=dflash2, backend="chunked")
    draft_dir = tmp_path / ("draft2" if dflash2 else "draft")
    save_hf_checkpoint(draft, str(draft_dir))
    prompts = tmp_path / "prompts.jsonl"
    with open(prompts, "w") as f:
        for p in PROMPTS:
            f.write(json.dumps({"input_ids": p}) + "\n")
        f.write("\n")  # blank lines are skipped
        f.write(json.dumps({"input_ids": [3, 1, 4, 1, 5]}) + "\n")
    return target, draft, target_dir, draft_dir, prompts
