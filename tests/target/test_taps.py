"""The HF target's taps: hooks on decoder layer ``i`` equal transformers' ``output_hidden_states[i + 1]``
(docs/design.md §2 Conventions), a taps-only forward stops after the last tapped layer, the target is frozen,
and `concat_taps` names missing layers.

Reference: transformers' own forward of tiny random Qwen3 / Llama models in fp32 (`tiny_targets`).
"""

from __future__ import annotations

import pytest
import torch

from megatron_dflash.draft.config import DFlashConfig
from megatron_dflash.target.taps import HFTarget, concat_taps, taps_from_hidden_states
from tiny_targets import BATCH, LAYERS, SEQ, TAPS, VOCAB, count_calls, hf_reference, tiny_inputs, tiny_models


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    return tiny_models(str(tmp_path_factory.mktemp("targets")))


def test_hf_target_taps_are_hidden_states_i_plus_1(tiny):
    ids, positions, keep = tiny_inputs()
    for name, (model, _) in tiny.items():
        ref = hf_reference(model, input_ids=ids)
        target = HFTarget(model, TAPS)
        out = target(ids, return_logits=True)
        assert out.taps.shape == (BATCH, SEQ, len(TAPS) * 32)
        torch.testing.assert_close(out.taps, torch.cat([ref["hidden"][i + 1] for i in TAPS], -1), rtol=0, atol=0)
        torch.testing.assert_close(out.taps, taps_from_hidden_states(ref["hidden"], TAPS), rtol=0, atol=0)
        torch.testing.assert_close(out.final_hidden, ref["hidden"][-1], rtol=0, atol=0)
        torch.testing.assert_close(out.logits, ref["logits"], rtol=0, atol=1e-6)
        assert target(ids).logits is None
        # Order follows target_layer_ids; masks and positions reach the model.
        rev = HFTarget(model, TAPS[::-1])(ids, attention_mask=keep, position_ids=positions)
        ref2 = hf_reference(model, input_ids=ids, attention_mask=keep, position_ids=positions)
        torch.testing.assert_close(rev.taps, torch.cat([ref2["hidden"][i + 1] for i in TAPS[::-1]], -1), rtol=0, atol=0)



def test_hf_target_without_final_hidden_stops_after_the_last_tap(tiny):
    """Training without a distillation loss reads only the taps: the layers after the last tapped one and the
    final norm never run, and the taps are those of the full forward, bit for bit."""
    ids, positions, keep = tiny_inputs()
    for name, (model, _) in tiny.items():
        target = HFTarget(model, TAPS)
        full = target(ids, attention_mask=keep, position_ids=positions)
        layers = list(model.model.layers)
        counts, handles = count_calls(layers + [model.model.norm])
        try:
            short = target(ids, attention_mask=keep, position_ids=positions, need_final_hidden=False)
        finally:
            for handle in handles:
                handle.remove()
        assert counts == [1] * (max(TAPS) + 1) + [0] * (LAYERS - max(TAPS) - 1) + [0], (name, counts)
        assert short.final_hidden is None and short.logits is None
        torch.testing.assert_close(short.taps, full.taps, rtol=0, atol=0)
        # The hooks are disarmed afterwards: a full forward runs every layer again.
        torch.testing.assert_close(target(ids).final_hidden, hf_reference(model, input_ids=ids)["hidden"][-1],
                                   rtol=0, atol=0)
        with pytest.raises(ValueError, match="need_final_hidden=True"):
            target(ids, return_logits=True, need_final_hidden=False)


def test_hf_target_is_frozen_and_exposes_embedding_and_head(tiny):
    model, _ = tiny["qwen3"]
    target = HFTarget(model, TAPS, output_multiplier=0.5, final_logit_softcapping=3.0)
    target.train()
    assert not target.training and not model.training
    assert not any(p.requires_grad for p in target.parameters())
    assert target.embedding is model.get_input_embeddings()
    assert target.output_head.layer is model.get_output_embeddings()
    ids, _, _ = tiny_inputs()
    out = target(ids, return_logits=True)
    assert not out.taps.requires_grad
    raw = hf_reference(model, input_ids=ids)["logits"]
    torch.testing.assert_close(out.logits, torch.tanh(raw * 0.5 / 3.0) * 3.0, rtol=0, atol=1e-6)
    # The taps feed an autograd graph (no inference-mode tensors).
    fc = torch.nn.Linear(out.taps.shape[-1], 4)
    fc(out.taps).sum().backward()
    model.train()  # leave the shared fixture in eval mode regardless
    model.eval()


def test_hf_target_refuses_bad_layers_and_mismatched_config(tiny):
    model, _ = tiny["llama"]
    with pytest.raises(ValueError, match="last layer 3"):
        HFTarget(model, [0, LAYERS - 1])
    with pytest.raises(ValueError, match="duplicates"):
        HFTarget(model, [1, 1])
    with pytest.raises(ValueError, match="outside"):
        HFTarget(model, [7])
    cfg = DFlashConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
                       num_hidden_layers=2, vocab_size=VOCAB, mask_token_id=5, num_target_layers=LAYERS, target_layer_ids=[0, 1])
    assert HFTarget.from_config(model, cfg).target_layer_ids == [0, 1]
    bad = DFlashConfig(**{**cfg.__dict__, "num_target_layers": 6, "target_layer_ids": [0, 1], "extra_hf_fields": {}})
    with pytest.raises(ValueError, match="num_target_layers=6"):
        HFTarget.from_config(model, bad)


def test_concat_taps_names_missing_layers():
    taps = {2: torch.zeros(1, 3, 4), 0: torch.ones(1, 3, 4)}
    assert concat_taps(taps, [0, 2])[..., 0].eq(1).all()
    with pytest.raises(ValueError, match=r"\[5\] are missing"):
        concat_taps(taps, [0, 5])
