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

from megatron_dflash.checkpoint.hf import hf_state_dict, load_hf_checkpoint, save_hf_checkpoint
from megatron_dflash.decoding.generate import spec_generate
from variant_drafts import VARIANTS, tiny_target, variant_draft

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 17, 3, 40, 22], [9, 1, 33, 60, 2, 71, 8]]
NEW = 14


@pytest.mark.parametrize("variant", VARIANTS)
def test_hf_round_trip_keeps_weights_and_decoding(variant, tmp_path):
    target = tiny_target()
    body, body_cls, config_cls = variant_draft(variant)
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
