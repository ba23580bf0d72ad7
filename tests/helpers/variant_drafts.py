"""One tiny draft of every built-in variant with non-trivial weights, shared by the HF round trip and the
serving check (each variant's extra modules made non-identity where they start as the identity)."""

from __future__ import annotations

import torch

from megatron_dflash.draft.body import DFlashBody
from megatron_dflash.draft.config import DFlashConfig
from megatron_dflash.variants.dflash2 import DFlash2Body, DFlash2Config
from megatron_dflash.variants.domino import DominoBody, DominoConfig
from megatron_dflash.variants.dspark import DSparkBody, DSparkConfig
from megatron_dflash.variants.jetspec import JetSpecConfig

from tiny_decoding import randomize_dflash2

VOCAB = 96
VARIANTS = ("dflash", "dflash2", "jetspec", "domino", "dspark")


def tiny_target():
    """A random 4-layer HF Qwen3 target of `VOCAB` tokens."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
        rope_theta=10000.0,
    )
    return Qwen3ForCausalLM(config).eval()


def common_draft_kwargs(**overrides) -> dict:
    """The draft fields every variant's tiny draft shares (2 layers tapping layers 0 and 2 of `tiny_target`)."""
    kwargs = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, block_size=4, mask_token_id=VOCAB - 1,
                  num_target_layers=4, target_layer_ids=[0, 2], max_position_embeddings=512, rope_theta=10000.0)
    kwargs.update(overrides)
    return kwargs


def variant_draft(variant: str, **overrides):
    """(body, body class, config class) of `variant`'s tiny draft; `overrides` change the shared fields."""
    torch.manual_seed(1)
    common = common_draft_kwargs(**overrides)
    if variant == "dflash":
        return DFlashBody(DFlashConfig(**common), attention_backend="chunked"), DFlashBody, DFlashConfig
    if variant == "jetspec":
        return DFlashBody(JetSpecConfig(**common), attention_backend="chunked"), DFlashBody, JetSpecConfig
    if variant == "dflash2":
        config = DFlash2Config(**common, conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)
        body = DFlash2Body(config, attention_backend="chunked")
        randomize_dflash2(body)
        return body, DFlash2Body, DFlash2Config
    if variant == "dspark":
        config = DSparkConfig(**common, markov_rank=8, markov_head_type="rnn")
        body = DSparkBody(config, attention_backend="chunked")
        with torch.no_grad():  # a Markov bias that changes the picks
            body.markov_head.markov_w2.weight.normal_(0.0, 1.0)
        return body, DSparkBody, DSparkConfig
    if variant != "domino":
        raise ValueError(f"no tiny draft for {variant!r}; known: {VARIANTS}")
    config = DominoConfig(**common, emb_dim=16, gru_hidden_dim=24, shift_label=True, pure_draft_prefix_len=1)
    body = DominoBody(config, attention_backend="chunked")
    with torch.no_grad():  # the correction starts at zero
        body.embed_proj[2].weight.normal_(0.0, 1.0)
    return body, DominoBody, DominoConfig
