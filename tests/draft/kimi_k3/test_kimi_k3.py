"""The Kimi K3 MLA draft against NeMo AutoModel's `KimiK3DFlashDraftModel`, its HF format and checks.

With NeMo AutoModel 0.7.0 installed (the `interop` extra), the reference drafter is built by
NeMo's own recipe helper (`build_kimi_k3_dflash_draft_config` from a tiny K3 target config),
and both directions of weight loading are checked: NeMo's directory loads here, ours loads in
NeMo's class, and the two give the same block hidden states (fp32, 1e-5) for the same weights,
taps and anchors. Without NeMo those tests skip; the format and validation tests run always.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_dflash.checkpoint.hf import load_hf_checkpoint, save_hf_checkpoint
from megatron_dflash.checkpoint.conversion import convert_hf_to_megatron, convert_megatron_to_hf
from megatron_dflash.draft.kimi_k3 import (
    KimiK3Body,
    KimiK3DraftConfig,
)

from builders import random_body_inputs
from kimi_k3_configs import CASES, DRAFT, our_config, target_dict
from nemo_reference import ANCHORS, SEQ, nemo, randomize, training_forward

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-5


def nemo_k3():
    """`(draft module, KimiK3TextConfig)` of NeMo AutoModel, or skip."""
    draft = nemo("draft_kimi_k3")
    from nemo_automodel.components.models.kimi_k3.config import KimiK3TextConfig

    return draft, KimiK3TextConfig


def nemo_target(case: str):
    """The same target as NeMo's `KimiK3TextConfig` (every other field at K3's defaults)."""
    _, KimiK3TextConfig = nemo_k3()
    return KimiK3TextConfig(**{k: v for k, v in target_dict(case).items() if k != "model_type"})


def nemo_draft_config(case: str):
    """The draft config NeMo's recipe builds for the same target."""
    draft, _ = nemo_k3()
    target = nemo_target(case)
    dflash_config = {
        "block_size": DRAFT["block_size"], "mask_token_id": DRAFT["mask_token_id"],
        "target_layer_ids": DRAFT["target_layer_ids"], "output_multiplier": 1.0,
        "final_logit_softcapping": None, "input_embedding_scale": 1.0,
    }
    return draft.build_kimi_k3_dflash_draft_config(
        target, num_draft_layers=DRAFT["num_hidden_layers"], num_target_layers=target.num_hidden_layers,
        block_size=DRAFT["block_size"], dflash_config=dflash_config, attention_backend="sdpa",
    )


def nemo_directory(ref, directory) -> str:
    """Write a NeMo drafter as NeMo's consolidated checkpoint does: the full config (`use_diff=False`)
    and the module's state dict."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        f.write(ref.config.to_json_string(use_diff=False))
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, os.path.join(directory, "model.safetensors"))
    return str(directory)


def inputs(config, seed: int = 3):
    return random_body_inputs(config, ANCHORS, SEQ, seed)


# ------------------------------------------------------------------------------ NeMo AutoModel parity


@pytest.mark.parametrize("case", list(CASES))
def test_nemo_drafter_loads_here_with_the_same_hidden_states(tmp_path, case):
    draft, _ = nemo_k3()
    torch.manual_seed(0)
    ref = draft.KimiK3DFlashDraftModel(nemo_draft_config(case)).float().eval()
    randomize(ref, 1)
    directory = nemo_directory(ref, tmp_path / "nemo")

    body = load_hf_checkpoint(directory).eval()
    assert isinstance(body, KimiK3Body)
    # The same draft fields as our own derivation from the same target (NeMo's file carries
    # more of the target's fields, which are kept verbatim).
    assert dataclasses.replace(body.config, extra_hf_fields={}) == our_config(case)
    taps, blocks, plan = inputs(body.config)
    with torch.no_grad():
        expected = training_forward(ref, taps, blocks, plan, causal=False)
        for backend in ("chunked", "dense"):
            body.attention_backend = backend
            ours = body(taps, blocks, plan)
            error = (ours - expected).abs().max().item()
            assert error <= TOL, f"{backend}: max |ours - NeMo| = {error:.3g}"
    assert expected.abs().max() > 0.1  # the comparison is not between two near-zero tensors


@pytest.mark.parametrize("case", list(CASES))
def test_our_export_loads_in_nemo_with_the_same_hidden_states(tmp_path, case):
    draft, KimiK3TextConfig = nemo_k3()
    torch.manual_seed(0)
    body = KimiK3Body(our_config(case)).eval()
    randomize(body, 2)
    save_hf_checkpoint(body, str(tmp_path / "ours"))

    with open(tmp_path / "ours" / "config.json") as f:
        config = KimiK3TextConfig(**json.load(f))
    ref = draft.KimiK3DFlashDraftModel(config).float().eval()
    missing, unexpected = ref.load_state_dict(load_file(str(tmp_path / "ours" / "model.safetensors")), strict=True)
    assert not missing and not unexpected
    assert ref.target_layer_ids == DRAFT["target_layer_ids"]
    taps, blocks, plan = inputs(body.config, seed=4)
    with torch.no_grad():
        error = (body(taps, blocks, plan) - training_forward(ref, taps, blocks, plan, causal=False)).abs().max().item()
    assert error <= TOL, f"max |ours - NeMo| = {error:.3g}"


def test_our_config_json_is_the_one_nemo_writes():
    """Every field NeMo's recipe writes for the draft (besides transformers' bookkeeping) is written,
    with the same value, and NeMo's class reads ours back to the same draft fields."""
    _, KimiK3TextConfig = nemo_k3()
    nemo_dict = json.loads(nemo_draft_config("lora_gated").to_json_string(use_diff=False))
    # Built from the target's full config, as the target-family registry passes it.
    config = KimiK3DraftConfig.from_target_config(nemo_target("lora_gated"), **DRAFT)
    ours = config.to_hf_dict()
    bookkeeping = {"_name_or_path", "transformers_version", "id2label", "label2id", "return_dict",
                   "output_attentions", "output_hidden_states", "is_encoder_decoder", "problem_type",
                   "chunk_size_feed_forward", "use_cache", "dtype", "rope_parameters"}
    differences = {
        key: (ours.get(key, "<absent>"), value)
        for key, value in nemo_dict.items()
        if key not in bookkeeping and ours.get(key, "<absent>") != value
    }
    assert not differences, f"ours vs NeMo: {differences}"
    reread = json.loads(KimiK3TextConfig(**ours).to_json_string(use_diff=False))
    assert KimiK3DraftConfig.from_hf_dict(reread) == config


# ------------------------------------------------------------------------------ format, always


def test_save_load_round_trip_and_conversion_through_torch_dist(tmp_path):
    """HF -> torch_dist -> HF keeps every tensor and field (validated by the converter itself), and
    the body built from each gives the same hidden states."""
    torch.manual_seed(0)
    body = KimiK3Body(our_config("lora_gated")).eval()
    randomize(body, 3)
    hf = str(tmp_path / "hf")
    save_hf_checkpoint(body, hf)
    with open(os.path.join(hf, "config.json")) as f:
        written = json.load(f)
    assert written["architectures"] == ["KimiK3DFlashDraftModel"] and written["model_type"] == "kimi_linear"
    assert written["dflash_config"]["target_layer_ids"] == DRAFT["target_layer_ids"]
    assert written["linear_attn_config"] == {"kda_layers": [], "full_attn_layers": [1, 2]}
    assert written["num_target_layers"] == 8 and written["num_experts"] is None

    megatron = str(tmp_path / "megatron")
    result = convert_hf_to_megatron(hf, megatron, validate=True, target_tensor_parallel_size=4)
    assert result.architecture == "KimiK3DFlashDraftModel" and result.validated
    back = str(tmp_path / "back")
    convert_megatron_to_hf(megatron, back, validate=True)
    assert load_file(os.path.join(back, "model.safetensors")).keys() == load_file(
        os.path.join(hf, "model.safetensors")
    ).keys()

    reloaded = load_hf_checkpoint(back).eval()
    assert isinstance(reloaded, KimiK3Body)
    assert dataclasses.replace(reloaded.config, extra_hf_fields={}) == body.config  # + the saved dtype
    taps, blocks, plan = inputs(body.config)
    with torch.no_grad():
        assert torch.equal(reloaded(taps, blocks, plan), body(taps, blocks, plan))


def test_tensor_parallel_sizes_the_config_refuses():
    config = our_config("lora_gated")  # 4 heads, intermediate 96
    config.validate_tensor_parallel(4)
    with pytest.raises(ValueError, match=r"must divide num_attention_heads=4: this draft supports TP in \[1, 2, 4\]"):
        config.validate_tensor_parallel(3)
    with pytest.raises(ValueError, match="intermediate_size"):
        KimiK3DraftConfig.from_target_config(
            {**target_dict("lora_gated"), "intermediate_size": 98}, **DRAFT
        ).validate_tensor_parallel(4)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("num_key_value_heads", 2, "one K/V head per query head"),
        ("mla_use_nope", False, "mla_use_nope must be true"),
        ("hidden_act", "silu", "SiTU"),
        ("kv_lora_rank", None, "kv_lora_rank=None must be a positive integer"),
    ],
)
def test_configs_the_draft_cannot_build_are_refused(field, value, message):
    with pytest.raises(ValueError, match=message):
        KimiK3DraftConfig.from_target_config({**target_dict("lora_gated"), field: value}, **DRAFT)


def test_other_families_and_projectors_are_refused():
    with pytest.raises(ValueError, match="kimi_linear"):
        KimiK3DraftConfig.from_target_config({**target_dict("lora_gated"), "model_type": "qwen3"}, **DRAFT)
    data = our_config("lora_gated").to_hf_dict()
    data["dflash_config"]["projector_type"] = "domino"
    with pytest.raises(ValueError, match="no projector head"):
        KimiK3DraftConfig.from_hf_dict(data)


def test_position_ids_are_ignored_and_bad_inputs_rejected():
    torch.manual_seed(0)
    body = KimiK3Body(our_config("lora_gated"), attention_backend="dense").eval()
    taps, blocks, plan = inputs(body.config)
    with torch.no_grad():
        plain = body(taps, blocks, plan)
        assert torch.equal(body(taps, blocks, plan, position_ids=torch.randint(0, 99, (2, 16))), plain)
    with pytest.raises(ValueError, match="3 taps x 64"):
        body(taps[..., :-64], blocks, plan)


# ------------------------------------------------------------------------------ decoding


def decode_draft(seed: int = 1) -> KimiK3Body:
    """A Kimi K3 draft for the tiny Qwen3 targets of `tiny_decoding.py` (hidden 64, 4 layers, vocab 96):
    decoding only needs the draft to read the target's taps, embedding and head."""
    from tiny_decoding import HIDDEN, TAPS, TARGET_LAYERS

    fields = {**target_dict("lora_gated"), "hidden_size": HIDDEN, "vocab_size": 96, "num_hidden_layers": TARGET_LAYERS}
    config = KimiK3DraftConfig.from_target_config(
        fields, num_hidden_layers=2, block_size=4, mask_token_id=95, target_layer_ids=TAPS
    )
    torch.manual_seed(seed)
    body = KimiK3Body(config, attention_backend="chunked").eval()
    randomize(body, seed)
    return body


def test_cached_block_hidden_matches_body_forward():
    """Forwards with the decoder's KV cache, the context written in pieces with per-row starts and junk
    at and past each anchor, give what one training forward over the whole context gives."""
    from megatron_dflash.draft.kv_cache import DraftKVCache
    from megatron_dflash.plan.batch_plan import DFlashBatchPlan

    body = decode_draft()
    B, W, S = 3, 4, 16
    gen = torch.Generator().manual_seed(3)
    taps = torch.randn(B, S, body.config.num_taps * 64, generator=gen)
    blocks = torch.randn(B, W, 64, generator=gen)
    anchors = torch.tensor([5, 9, 12])
    cache = DraftKVCache(body, B, capacity=4)  # too small: the forwards grow it

    def forward(context, starts, block_anchors):
        positions = starts[:, None] + torch.arange(context.shape[1])
        plan = DFlashBatchPlan.for_decoding(block_anchors, positions, block_size=W)
        with torch.no_grad():
            return body(context, blocks[:, None], plan, kv_cache=cache, attention_backend="chunked")[:, 0]

    zeros = torch.zeros(B, dtype=torch.int64)
    forward(taps[:, :6], zeros, zeros + 6)
    starts = torch.tensor([4, 5, 6])
    forward(torch.stack([taps[b, int(s) : int(s) + 8] for b, s in enumerate(starts)]), starts, starts + 8)
    ours = forward(torch.randn(B, W, taps.shape[-1], generator=gen) * 10, anchors, anchors)
    plan = DFlashBatchPlan.from_anchors(anchors[:, None], block_size=W, seq_length=S)
    with torch.no_grad():
        reference = body(taps, blocks[:, None], plan)[:, 0]
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)


def test_greedy_speculative_decoding_with_a_kimi_k3_draft_is_lossless():
    """`spec_generate` with a K3 draft emits exactly the target's own greedy tokens, rows of different
    lengths accepting different amounts."""
    from collections import Counter

    from megatron_dflash.decoding.generate import spec_generate
    from tiny_decoding import PROMPTS, check_statistics, hf_greedy, qwen3_target

    target = qwen3_target(vocab=96, mode="mixed")
    draft = decode_draft()
    new = 23
    out = spec_generate(target, draft, PROMPTS, max_new_tokens=new)
    for b, prompt in enumerate(PROMPTS):
        assert out.sequence(b) == hf_greedy(target, prompt, new), f"row {b}"
    check_statistics(out, 4, new)
    seen = Counter(a for row in out.acceptance_lengths for a in row)
    assert seen[1] > 0 and max(seen) > 1  # rejections and accepted draft tokens both occur
