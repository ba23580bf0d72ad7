"""Shared sizes of the drafts the tests build: tiny ones (each test overrides what it exercises) and the
smollm2-135m recipe's, at its full shape."""

from __future__ import annotations


def tiny_draft_kwargs(**overrides) -> dict:
    """`DFlashConfig` keyword arguments of a 2-layer GQA draft with 3 taps of an 8-layer target.

    `rope_theta` is deliberately not a default value, so a code path that drops it shows up as a
    mismatch against the reference.
    """
    kwargs = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        block_size=4,
        mask_token_id=3,
        vocab_size=100,
        num_target_layers=8,
        target_layer_ids=[1, 3, 5],
        rope_theta=5000.0,
        rms_norm_eps=1e-5,
    )
    kwargs.update(overrides)
    return kwargs


def smollm2_draft_kwargs(**overrides) -> dict:
    """`DFlashConfig` keyword arguments of the draft the smollm2-135m recipe's short budget trains: 1 layer at
    SmolLM2-135M-Instruct's attention and MLP shape (hidden 576, 9 heads / 3 KV heads of 64, intermediate 1536),
    block 4, 3 taps of its 30 layers, the MASK token `<empty_output>` (id 16).

    tests/recipes/test_smollm2.py checks these against the draft the recipe derives from the real target, so an
    interop test at this shape is one at the recipe's. The vocabulary is the target's whole one: the body holds
    no vocabulary-sized tensor (the embedding and the head are the target's).
    """
    kwargs = dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=1,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        block_size=4,
        mask_token_id=16,
        vocab_size=49152,
        num_target_layers=30,
        target_layer_ids=[1, 14, 27],
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
    )
    kwargs.update(overrides)
    return kwargs


def random_body_inputs(config, anchors, seq_length: int, seed: int):
    """`(taps, blocks, plan)` for a draft body: random target taps `[B, S, taps * H]`, random block
    embeddings `[B, N, block_size, H]` and the plan of the given anchors `[B, N]`."""
    import torch

    from megatron_dflash.plan.batch_plan import DFlashBatchPlan

    gen = torch.Generator().manual_seed(seed)
    B, N = anchors.shape
    taps = torch.randn(B, seq_length, config.num_taps * config.hidden_size, generator=gen)
    blocks = torch.randn(B, N, config.block_size, config.hidden_size, generator=gen)
    plan = DFlashBatchPlan.from_anchors(anchors, block_size=config.block_size, seq_length=seq_length)
    return taps, blocks, plan
