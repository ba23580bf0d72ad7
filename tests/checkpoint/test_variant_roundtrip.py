"""Every variant survives the HF round trip unchanged, and decodes the same after it.

For each of DFlash, DFlash 2, JetSpec, Domino and DSpark (weights made non-trivial where they start as the
identity): write the body as a HF draft, load the directory back through the one generic loader
(`checkpoint.hf.load_hf_checkpoint`, which picks the variant from config.json), and check that the
reloaded body is the same variant with bit-identical weights and that `spec_generate` gives the same
tokens and the same acceptance lengths as the body that was written, both equal to the target's own
greedy generation (greedy speculative decoding is lossless).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_dflash.draft.body import DFlashBody
from megatron_dflash.checkpoint.hf import hf_state_dict, load_hf_checkpoint, save_hf_checkpoint
from megatron_dflash.draft.config import DFlashConfig
from megatron_dflash.decoding.generate import spec_generate
from megatron_dflash.variants.dflash2 import DFlash2Body, DFlash2Config
from megatron_dflash.variants.domino import DominoBody, DominoConfig
from megatron_dflash.variants.dspark import DSparkBody, DSparkConfig
from megatron_dflash.variants.jetspec import JetSpecConfig

transformers = pytest.importorskip("transformers")

VOCAB = 96
PROMPTS = [[5, 17, 3, 40, 22], [9, 1, 33, 60, 2, 71, 8]]
NEW = 14


def _target():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
        rope_theta=10000.0,
    )
    return Qwen3ForCausalLM(config).eval()


def _common():
    return dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, block_size=4, mask_token_id=VOCAB - 1,
                num_target_layers=4, target_layer_ids=[0, 2], max_position_embeddings=512, rope_theta=10000.0)


def _draft(variant: str):
    torch.manual_seed(1)
    if variant == "dflash":
        return DFlashBody(DFlashConfig(**_common()), attention_backend="chunked"), DFlashBody, DFlashConfig
    if variant == "jetspec":
        return DFlashBody(JetSpecConfig(**_common()), attention_backend="chunked"), DFlashBody, JetSpecConfig
    if variant == "dflash2":
        config = DFlash2Config(**_common(), conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)
        body = DFlash2Body(config, attention_backend="chunked")
        with torch.no_grad():  # the convolutions and the selector start as the identity
            for name, param in body.named_parameters():
                if "conv" in name or "candidate_selector" in name:
                    param.normal_(0.0, 0.2)
            for layer in body.layers:
                for conv in (layer.attention_conv, layer.mlp_conv):
                    conv.base_kernel[:, 0] += 1.0
        return body, DFlash2Body, DFlash2Config
    if variant == "dspark":
        config = DSparkConfig(**_common(), markov_rank=8, markov_head_type="rnn")
        body = DSparkBody(config, attention_backend="chunked")
        with torch.no_grad():  # a Markov bias that changes the picks
            body.markov_head.markov_w2.weight.normal_(0.0, 1.0)
        return body, DSparkBody, DSparkConfig
    config = DominoConfig(**_common(), emb_dim=16, gru_hidden_dim=24, shift_label=True, pure_draft_prefix_len=1)
    body = DominoBody(config, attention_backend="chunked")
    with torch.no_grad():  # the correction starts at zero
        body.embed_proj[2].weight.normal_(0.0, 1.0)
    return body, DominoBody, DominoConfig


@pytest.mark.parametrize("variant", ["dflash", "dflash2", "jetspec", "domino", "dspark"])
def test_hf_round_trip_keeps_weights_and_decoding(variant, tmp_path):
    target = _target()
    body, body_cls, config_cls = _draft(variant)
    body.eval()
    save_hf_checkpoint(body, str(tmp_path / "draft"))
    loaded = load_hf_checkpoint(str(tmp_path / "draft"), attention_backend="chunked").eval()
    assert type(loaded) is body_cls and type(loaded.config) is config_cls
    # the file records the weights' dtype besides the draft's fields
    assert dataclasses.replace(loaded.config, extra_hf_fields={}) == body.config
    before, after = hf_state_dict(body), hf_state_dict(loaded)
    assert list(before) == list(after)
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name

    out_before = spec_generate(target, body, PROMPTS, max_new_tokens=NEW)
    out_after = spec_generate(target, loaded, PROMPTS, max_new_tokens=NEW)
    assert out_after.tokens.tolist() == out_before.tokens.tolist()
    assert out_after.acceptance_lengths == out_before.acceptance_lengths
    for b, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            reference = target.generate(torch.tensor([prompt]), max_new_tokens=NEW, min_new_tokens=NEW,
                                        do_sample=False)[0].tolist()
        assert out_after.sequence(b) == reference, f"row {b}"
