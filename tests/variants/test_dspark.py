"""DSpark (docs/design.md §18 DSpark) against NeMo AutoModel 0.7.0's `Qwen3DSparkModel` / `KimiK3DSparkModel`
and SpecForge 0.2.0's `DSparkDraftModel`, its HF format, its registration and its recipe.

Parity: the same weights in NeMo's class and ours give the same block hidden states, the same
Markov-corrected logits (the target head's logits plus ``W2 @ features``, teacher-forced with the true
previous tokens) and the same confidence logits (fp32, 1e-5), for each Markov head form and for the Kimi K3
MLA draft, in both directions: our export loads in NeMo's class, NeMo's saved drafter (with its copies of the
embedding and LM head) loads here. Without the reference packages those tests skip.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from megatron_dflash.checkpoint.conversion import convert_hf_to_megatron, convert_megatron_to_hf
from megatron_dflash.checkpoint.hf import hf_state_dict, load_hf_checkpoint, save_hf_checkpoint
from megatron_dflash.target.head import OutputHead
from megatron_dflash.variants.dspark import (
    DSparkBody,
    DSparkConfig,
    KimiK3DSparkBody,
    KimiK3DSparkConfig,
    confident_lengths,
    dspark_prev_tokens,
    dspark_walk,
)
from megatron_dflash.checkpoint.architectures import read_hf_draft_config
from megatron_dflash.variants.registry import get_variant, variant_for_draft_family

from builders import random_body_inputs, tiny_draft_kwargs
from nemo_reference import ANCHORS, SEQ, nemo_mask, randomize
from dspark_models import k3_config, nemo_dspark, qwen3_config

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-5
FORMS = {
    "vanilla": dict(markov_head_type="vanilla", confidence_head_with_markov=False),
    "gated": dict(markov_head_type="gated", confidence_head_with_markov=True),
    "rnn": dict(markov_head_type="rnn", confidence_head_with_markov=True),
}



def our_config(form: str, **overrides) -> DSparkConfig:
    return DSparkConfig(**tiny_draft_kwargs(markov_rank=8, **FORMS[form], **overrides))


def our_body(form: str, seed: int = 2) -> DSparkBody:
    torch.manual_seed(0)
    body = DSparkBody(our_config(form)).eval()
    randomize(body, seed)
    return body


def input_ids(config, seed: int = 5) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (ANCHORS.shape[0], SEQ), generator=torch.Generator().manual_seed(seed))


def target_head(config, seed: int = 6) -> nn.Linear:
    head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=torch.Generator().manual_seed(seed)) * 0.3)
    return head


def ours(body, taps, blocks, plan, ids, head):
    """(hidden, Markov-corrected logits, confidence logits) of our body, teacher-forced."""
    hidden = body(taps, blocks, plan)
    prev = dspark_prev_tokens(ids, plan)
    return hidden, body.markov_logits(hidden, prev, OutputHead(head, body.config.vocab_size)), \
        body.confidence_logits(hidden, prev)


def nemo_outputs(ref, taps, blocks, plan, ids, head):
    """The same three of a NeMo DSpark model, through its own modules (its backbone over `[context | blocks]`
    with its dense mask, its Markov head's teacher-forced block logits, its confidence head)."""
    B, N, W, H = blocks.shape
    positions = torch.cat([torch.arange(SEQ).expand(B, SEQ), plan.position_ids.reshape(B, N * W)], dim=1)
    hidden = ref._forward_backbone(position_ids=positions, attention_mask=nemo_mask(plan, causal=False),
                                   noise_embedding=blocks.reshape(B, N * W, H), target_hidden_states=taps)
    hidden = hidden.reshape(B, N, W, H)
    prev = dspark_prev_tokens(ids, plan)
    logits = ref.markov_head.apply_block_logits(head(hidden), token_ids=prev, hidden_states=hidden)
    features = hidden
    if ref.confidence_head_with_markov:
        features = torch.cat([hidden, ref.markov_head.get_prev_embeddings(prev)], dim=-1)
    return hidden, logits, ref.confidence_head(features).float()


def assert_same(got, expected, what: str) -> None:
    for name, a, b in zip(("hidden", "corrected logits", "confidence logits"), got, expected):
        error = (a - b).abs().max().item()
        assert error <= TOL, f"{what} {name}: max |ours - reference| = {error:.3g}"
        assert b.abs().max() > 0.1, f"{what} {name}: the reference is near zero"



# ------------------------------------------------------------------------------ NeMo AutoModel parity


@pytest.mark.parametrize("form", list(FORMS))
def test_our_export_loads_in_nemo_with_the_same_outputs(tmp_path, form):
    draft = nemo_dspark("draft_qwen3")
    body = our_body(form)
    save_hf_checkpoint(body, str(tmp_path / "ours"))
    ref = draft.Qwen3DSparkModel(qwen3_config(str(tmp_path / "ours" / "config.json"))).float().eval()
    missing, unexpected = ref.load_state_dict(load_file(str(tmp_path / "ours" / "model.safetensors")), strict=False)
    assert sorted(missing) == ["embed_tokens.weight", "lm_head.weight"] and not unexpected
    assert ref.markov_head.markov_head_type == form and ref.block_size == body.config.block_size
    taps, blocks, plan = random_body_inputs(body.config, ANCHORS, SEQ, 3)
    ids, head = input_ids(body.config), target_head(body.config)
    with torch.no_grad():
        assert_same(ours(body, taps, blocks, plan, ids, head), nemo_outputs(ref, taps, blocks, plan, ids, head), form)


@pytest.mark.parametrize("form", list(FORMS))
def test_nemo_drafter_loads_here_with_the_same_outputs(tmp_path, form):
    """NeMo's saved drafter (with its copies of the target's embedding and LM head) loads as a DSpark body."""
    draft = nemo_dspark("draft_qwen3")
    config = our_config(form)
    config.save_pretrained(str(tmp_path / "cfg"))
    torch.manual_seed(0)
    ref = draft.Qwen3DSparkModel(qwen3_config(str(tmp_path / "cfg" / "config.json"))).float().eval()
    randomize(ref, 3)
    ref.save_pretrained(str(tmp_path / "nemo"), safe_serialization=True)
    assert "embed_tokens.weight" in load_file(str(tmp_path / "nemo" / "model.safetensors"))

    body = load_hf_checkpoint(str(tmp_path / "nemo")).eval()
    assert isinstance(body, DSparkBody)
    assert dataclasses.replace(body.config, extra_hf_fields={}) == config
    taps, blocks, plan = random_body_inputs(config, ANCHORS, SEQ, 4)
    ids, head = input_ids(config, 7), ref.lm_head
    with torch.no_grad():
        assert_same(ours(body, taps, blocks, plan, ids, head), nemo_outputs(ref, taps, blocks, plan, ids, head), form)



def test_kimi_k3_dspark_matches_nemo_both_ways(tmp_path):
    draft = nemo_dspark("draft_kimi_k3")
    from nemo_automodel.components.models.kimi_k3.config import KimiK3TextConfig

    config = k3_config()
    torch.manual_seed(0)
    body = KimiK3DSparkBody(config).eval()
    randomize(body, 2)
    save_hf_checkpoint(body, str(tmp_path / "ours"))
    with open(tmp_path / "ours" / "config.json") as f:
        ref = draft.KimiK3DSparkModel(KimiK3TextConfig(**json.load(f))).float().eval()
    missing, unexpected = ref.load_state_dict(load_file(str(tmp_path / "ours" / "model.safetensors")), strict=False)
    assert sorted(missing) == ["embed_tokens.weight", "lm_head.weight"] and not unexpected
    taps, blocks, plan = random_body_inputs(config, ANCHORS, SEQ, 3)
    ids, head = input_ids(config), target_head(config)
    with torch.no_grad():
        assert_same(ours(body, taps, blocks, plan, ids, head), nemo_outputs(ref, taps, blocks, plan, ids, head), "K3")
    # NeMo's module, saved with its copies of the embedding and LM head, loads back here.
    randomize(ref, 5)
    os.makedirs(tmp_path / "nemo")
    with open(tmp_path / "nemo" / "config.json", "w") as f:
        f.write(ref.config.to_json_string(use_diff=False))
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(tmp_path / "nemo" / "model.safetensors"))
    loaded = load_hf_checkpoint(str(tmp_path / "nemo")).eval()
    assert isinstance(loaded, KimiK3DSparkBody)
    assert dataclasses.replace(loaded.config, extra_hf_fields={}) == dataclasses.replace(config, extra_hf_fields={})
    with torch.no_grad():
        assert_same(ours(loaded, taps, blocks, plan, ids, ref.lm_head),
                    nemo_outputs(ref, taps, blocks, plan, ids, ref.lm_head), "K3 from NeMo")


# ------------------------------------------------------------------------------ SpecForge


def test_specforge_drafter_loads_here_and_ours_there(tmp_path):
    if importlib.util.find_spec("specforge") is None:
        pytest.skip("SpecForge (`specforge==0.2.0`) is not installed")
    from specforge.modeling.draft.dspark import DSparkDraftModel

    body = our_body("gated", seed=8)
    save_hf_checkpoint(body, str(tmp_path / "ours"))
    ref = DSparkDraftModel.from_pretrained(str(tmp_path / "ours"), dtype=torch.float32).eval()
    assert ref.markov_head.markov_head_type == "gated" and ref.confidence_head_with_markov
    theirs = ref.state_dict()
    for name, tensor in hf_state_dict(body).items():
        assert torch.equal(theirs[name], tensor), name
    # SpecForge's own layout: DSparkDraftModel, the DSpark fields in dflash_config only.
    ref.save_pretrained(str(tmp_path / "specforge"), safe_serialization=True)
    with open(tmp_path / "specforge" / "config.json") as f:
        data = json.load(f)
    assert data["architectures"] == ["DSparkDraftModel"]
    for name in ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov"):
        data.pop(name, None)
    data["dflash_config"]["projector_type"] = "dspark"
    with open(tmp_path / "specforge" / "config.json", "w") as f:
        json.dump(data, f)
    loaded = load_hf_checkpoint(str(tmp_path / "specforge"))
    assert type(loaded) is DSparkBody and loaded.config.markov_head_type == "gated"
    assert loaded.config.confidence_head_with_markov and loaded.config.markov_rank == 8
    got = hf_state_dict(loaded)
    for name, tensor in hf_state_dict(body).items():
        assert torch.equal(got[name], tensor), name


# ------------------------------------------------------------------------------ format, always


def test_export_layout_is_the_served_one(tmp_path):
    body = our_body("rnn")
    save_hf_checkpoint(body, str(tmp_path / "d"))
    with open(tmp_path / "d" / "config.json") as f:
        data = json.load(f)
    assert data["architectures"] == ["Qwen3DSparkModel"]
    expected = dict(block_size=4, mask_token_id=3, target_layer_ids=[1, 3, 5], num_target_layers=8, markov_rank=8,
                    markov_head_type="rnn", enable_confidence_head=True, confidence_head_with_markov=True)
    assert {k: data[k] for k in expected} == expected
    names = set(load_file(str(tmp_path / "d" / "model.safetensors")))
    heads = {n for n in names if n.startswith(("markov_head.", "confidence_head."))}
    assert heads == {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "markov_head.joint_proj.weight",
                     "markov_head.joint_proj.bias", "confidence_head.proj.weight", "confidence_head.proj.bias"}
    assert not any(n.startswith("model.") or "embed_tokens" in n or n.startswith("lm_head") for n in names)
    variant, config = read_hf_draft_config(str(tmp_path / "d"))
    assert variant.name == "dspark" and dataclasses.replace(config, extra_hf_fields={}) == body.config


def test_modelopt_layout_is_refused_with_its_name(tmp_path):
    body = our_body("vanilla")
    save_hf_checkpoint(body, str(tmp_path / "d"))
    path = str(tmp_path / "d" / "model.safetensors")
    tensors = load_file(path)
    tensors["markov_w1.weight"] = tensors.pop("markov_head.markov_w1.weight")
    tensors["markov_w2.weight"] = tensors.pop("markov_head.markov_w2.weight")
    save_file(tensors, path)
    for load in (lambda: load_hf_checkpoint(str(tmp_path / "d")),
                 lambda: convert_hf_to_megatron(str(tmp_path / "d"), str(tmp_path / "m"))):
        with pytest.raises(ValueError, match="ModelOpt's DSpark layout"):
            load()


def test_converter_round_trip_keeps_every_tensor(tmp_path):
    body = our_body("gated")
    save_hf_checkpoint(body, str(tmp_path / "hf"))
    convert_hf_to_megatron(str(tmp_path / "hf"), str(tmp_path / "meg"), validate=True)
    convert_megatron_to_hf(str(tmp_path / "meg"), str(tmp_path / "back"), validate=True)
    back = load_hf_checkpoint(str(tmp_path / "back"))
    assert type(back) is DSparkBody and dataclasses.replace(back.config, extra_hf_fields={}) == body.config
    got = hf_state_dict(back)
    for name, tensor in hf_state_dict(body).items():
        assert torch.equal(got[name], tensor), name


@pytest.mark.parametrize("field,value,message", [
    ("markov_head_type", "lstm", "markov_head_type='lstm'"),
    ("markov_rank", -1, "markov_rank=-1"),
])
def test_bad_fields_are_refused(field, value, message):
    with pytest.raises(ValueError, match=message):
        DSparkConfig(**tiny_draft_kwargs(**{field: value}))
    with pytest.raises(ValueError, match="needs a Markov head"):
        DSparkConfig(**tiny_draft_kwargs(markov_rank=0, confidence_head_with_markov=True))


def test_without_heads_the_body_is_its_backbone():
    config = DSparkConfig(**tiny_draft_kwargs(markov_rank=0, enable_confidence_head=False))
    body = DSparkBody(config)
    assert body.markov_head is None and body.confidence_head is None
    assert not any(n.startswith(("markov_head", "confidence_head")) for n in body.state_dict())


def test_a_head_of_another_vocabulary_split_is_refused():
    body = our_body("vanilla")
    with pytest.raises(ValueError, match="not this rank's markov_w2 rows"):
        body.markov_w2_rows(OutputHead(nn.Linear(64, 90, bias=False), 90))


@pytest.mark.parametrize("form", ["gated", "rnn"])
def test_the_decode_walk_fed_the_true_tokens_gives_the_training_logits(form):
    """The walk over every slot ``0..W-1`` from the anchor (decoding proposes W tokens per block), fed the true
    tokens, computes the teacher-forced corrected logits and confidence logits of training, row by row and block
    by block (the rnn state carried the same way); the proposer returns the walk's picks."""
    body = our_body(form)
    taps, blocks, plan = random_body_inputs(body.config, ANCHORS, SEQ, 3)
    ids, head = input_ids(body.config), OutputHead(target_head(body.config), body.config.vocab_size)
    with torch.no_grad():
        hidden = body(taps, blocks, plan)
        prev = dspark_prev_tokens(ids, plan)
        expected = body.markov_logits(hidden, prev, head)
        expected_confidence = body.confidence_logits(hidden, prev)
        B, N, W, H = hidden.shape
        flat, anchors = hidden.reshape(B * N, W, H), prev[:, :, 0].reshape(-1)
        # slot k's true token is slot k + 1's previous token; the last slot's is never fed back
        forced = torch.cat([prev[:, :, 1:], prev[:, :, -1:]], dim=2).reshape(B * N, W)
        walk = dspark_walk(body, flat, anchors, head, forced_tokens=forced)
        tokens, probs, lengths = body.propose_block(flat, anchors, head, None)
    assert walk.probs is None and torch.equal(walk.tokens, walk.logits.argmax(-1))
    for name, got, want in (("logits", walk.logits.view(B, N, W, -1), expected),
                            ("confidence", walk.confidence.view(B, N, W), expected_confidence)):
        error = (got - want).abs().max().item()
        assert error <= TOL, f"{name}: {error}"
    assert walk.logits.shape[1] == W == tokens.shape[1] and probs is None and lengths is None
    free = dspark_walk(body, flat, anchors, head)
    assert torch.equal(tokens, free.tokens)
    assert not torch.allclose(free.logits[:, 1:], walk.logits[:, 1:])  # its own picks, not the true tokens, when free


def test_the_confidence_threshold_counts_the_slots_before_survival_drops():
    """Per row, the slots before the first whose cumulative product of sigmoid(confidence) is below the
    threshold; a threshold at the survival itself keeps that slot."""
    confidence = torch.tensor([[2.0, 0.0, -1.0, 3.0], [-3.0, 5.0, 5.0, 5.0], [9.0, 9.0, 9.0, 9.0]])
    survival = torch.sigmoid(confidence).cumprod(dim=1)
    assert confident_lengths(confidence, 0.3).tolist() == [2, 0, 4]  # 0.88, 0.44, 0.118 ...; 0.047; ~1
    assert confident_lengths(confidence, float(survival[0, 2])).tolist() == [3, 0, 4]
    assert confident_lengths(confidence, 0.0).tolist() == [4, 4, 4]


# ------------------------------------------------------------------------------ registry and recipe


def test_registry_forms_and_flags():
    dspark = get_variant("dspark")
    assert dspark.needs_final_hidden and dspark.architecture == "Qwen3DSparkModel"
    assert variant_for_draft_family(dspark, "kimi_k3").name == "kimi_k3_dspark"
    assert variant_for_draft_family(dspark, "qwen3") is dspark
    # every slot proposes: the published block-7 drafter is served with 7 speculative tokens
    assert dspark.proposals_per_block(7) == get_variant("kimi_k3_dspark").proposals_per_block(7) == 7
    assert get_variant("dflash").proposals_per_block(7) == get_variant("domino").proposals_per_block(7) == 6
    assert dspark.config_overrides(dspark.options.options_cls(markov_head_type="rnn", confidence_head=False)) == {
        "markov_rank": 256, "markov_head_type": "rnn", "enable_confidence_head": False,
        "confidence_head_with_markov": True}
