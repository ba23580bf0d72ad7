"""Target families: every supported target architecture resolves to its draft family through `pretrain_dflash.py`'s
job resolution, multimodal wrappers are read through their text config, runs a family cannot do are refused before
training, and the targets load and are tapped in one process (Qwen3.5 / Qwen3-VL wrappers, Kimi K3 on NeMo
AutoModel's model code, checked against that code's own outputs)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from megatron_dflash.draft.config import default_target_layer_ids
from megatron_dflash.target.families import (
    TARGET_FAMILIES,
    resolve_target_family,
    resolve_text_config,
    supported_architectures,
)
from megatron_dflash.target.taps import HFTarget
from megatron_dflash.training.arguments import ArgumentError, parse_args
from megatron_dflash.training.job import prepare_job
from megatron_dflash.embedded_job.tiny_target import SHIPPED_TARGET_DIR

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 320  # the shipped tiny tokenizer's
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=VOCAB, max_position_embeddings=512)


def _tiny_text(model_type: str, **extra):
    """A real transformers config of `model_type` at toy sizes (the field layout its checkpoints carry)."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    text = resolve_text_config(config)
    for key, value in {**TEXT, **extra}.items():
        setattr(text, key, value)
    if getattr(text, "layer_types", None) is not None:
        text.layer_types = (["linear_attention", "full_attention"] * 4)[: TEXT["num_hidden_layers"]] \
            if "linear_attention" in text.layer_types else ["full_attention"] * TEXT["num_hidden_layers"]
    for key in ("linear_num_value_heads", "linear_num_key_heads"):
        if hasattr(text, key):
            setattr(text, key, 2)
    for key in ("linear_key_head_dim", "linear_value_head_dim"):
        if hasattr(text, key):
            setattr(text, key, 16)
    vision = getattr(config, "vision_config", None)
    if vision is not None:
        for key, value in dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                               out_hidden_size=TEXT["hidden_size"]).items():
            if hasattr(vision, key):
                setattr(vision, key, value)
        if hasattr(vision, "deepstack_visual_indexes"):
            vision.deepstack_visual_indexes = [0]
    return config


def _kimi_k3_config(wrapper: bool) -> dict:
    nemo = pytest.importorskip("nemo_automodel.components.models.kimi_k3.config")
    text = nemo.KimiK3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=8,
                                 num_attention_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                                 qk_rope_head_dim=8, v_head_dim=16, num_experts=4, num_experts_per_token=2,
                                 moe_intermediate_size=32, routed_expert_hidden_size=32)
    if not wrapper:
        return text.to_dict()
    return nemo.KimiK3Config(text_config=text.to_dict()).to_dict()


# architecture -> config.json as its checkpoints write it
CONFIGS = {
    "Qwen3ForCausalLM": lambda: _tiny_text("qwen3").to_dict(),
    "Qwen3MoeForCausalLM": lambda: _tiny_text("qwen3_moe", num_experts=4, num_experts_per_tok=2,
                                              moe_intermediate_size=32).to_dict(),
    "Qwen3_5ForCausalLM": lambda: _tiny_text("qwen3_5_text").to_dict(),
    "Qwen3_5ForConditionalGeneration": lambda: _tiny_text("qwen3_5").to_dict(),
    "Qwen3VLForConditionalGeneration": lambda: _tiny_text("qwen3_vl").to_dict(),
    "LlamaForCausalLM": lambda: _tiny_text("llama").to_dict(),
    "DeepseekV3ForCausalLM": lambda: _tiny_text("deepseek_v3", q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                                                qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4,
                                                num_experts_per_tok=2, moe_intermediate_size=32).to_dict(),
    "KimiK3ForCausalLM": lambda: _kimi_k3_config(wrapper=False),
    "KimiK3ForConditionalGeneration": lambda: _kimi_k3_config(wrapper=True),
}


def _target_dir(tmp_path, architecture: str, config: dict, name: str = "") -> str:
    directory = tmp_path / (name or architecture)
    directory.mkdir()
    config = dict(config, architectures=[architecture])
    (directory / "config.json").write_text(json.dumps(config))
    for name in TOKENIZER_FILES:
        shutil.copyfile(os.path.join(SHIPPED_TARGET_DIR, name), directory / name)
    return str(directory)


def _job(tmp_path, target: str, *argv: str):
    args = parse_args(["--target", target, "--data-format", "synthetic", "--dflash-num-layers", "2",
                       "--dflash-block-size", "4", "--seq-length", "64", "--dflash-eval-prompts", "0",
                       "--run-dir", str(tmp_path / "run"), *argv])
    return prepare_job(args, world_size=1, env={}, cuda=False, log=lambda *a: None)


def test_every_family_architecture_has_a_test():
    assert set(CONFIGS) <= set(supported_architectures())
    tested_qwen3 = {a for a in CONFIGS if resolve_target_family({"architectures": [a]}).name == "qwen3"}
    assert tested_qwen3 and {"KimiK3ForCausalLM", "KimiK3ForConditionalGeneration"} == set(
        TARGET_FAMILIES["kimi_k3"].architectures)


@pytest.mark.parametrize("architecture", [a for a in CONFIGS if not a.startswith("Kimi")])
def test_qwen3_family_targets_resolve_to_a_draft_of_their_text_config(tmp_path, architecture):
    config = CONFIGS[architecture]()
    job = _job(tmp_path, _target_dir(tmp_path, architecture, config))
    text = resolve_text_config(config)
    wrapper = "text_config" in config
    assert wrapper == architecture.endswith("ForConditionalGeneration")
    assert job.target_family.name == "qwen3"
    draft = job.draft_config
    # Shapes, vocabulary and depth come from the text config, wherever the checkpoint keeps it.
    heads = text["num_attention_heads"]
    assert (draft.hidden_size, draft.intermediate_size, draft.num_attention_heads, draft.vocab_size) == (
        text["hidden_size"], text["intermediate_size"], heads, VOCAB)
    assert draft.num_key_value_heads == (text.get("num_key_value_heads") or heads)
    assert draft.num_target_layers == TEXT["num_hidden_layers"] and draft.num_hidden_layers == 2
    assert draft.target_layer_ids == default_target_layer_ids(TEXT["num_hidden_layers"], 2)
    assert job.target_text_config["hidden_size"] == TEXT["hidden_size"]


@pytest.mark.parametrize("architecture", ["KimiK3ForCausalLM", "KimiK3ForConditionalGeneration"])
def test_kimi_k3_targets_resolve_to_the_k3_draft_family(tmp_path, architecture):
    from megatron_dflash.draft.kimi_k3 import KimiK3Body, KimiK3DraftConfig

    config = CONFIGS[architecture]()
    job = _job(tmp_path, _target_dir(tmp_path, architecture, config))
    # The target family names its draft family; the registry's K3 form of the requested DFlash objective trains it.
    assert job.target_family.name == "kimi_k3" and job.target_family.draft_family == "kimi_k3"
    assert job.variant.draft_family == "kimi_k3" and job.variant.trains_as == "dflash"
    draft = job.draft_config
    assert isinstance(draft, KimiK3DraftConfig)
    # The MLA shapes of the target's text config (NoPE: no RoPE fields), its depth and vocabulary.
    assert {k: getattr(draft, k) for k in ("hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
                                           "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "vocab_size",
                                           "num_target_layers", "num_hidden_layers")} == dict(
        hidden_size=64, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, vocab_size=VOCAB, num_target_layers=8, num_hidden_layers=2)
    assert draft.target_layer_ids == default_target_layer_ids(8, 2)
    # The job's variant builds the family's draft body.
    assert isinstance(job.variant.build_body(draft, attention_backend="chunked"), KimiK3Body)
    # A flag of the Qwen3-style draft only is refused before anything is built.
    with pytest.raises(ArgumentError, match="the kimi_k3 draft does not take that setting.*head_dim"):
        _job(tmp_path, _target_dir(tmp_path, architecture, config, name="again"), "--dflash-head-dim", "32")


@pytest.mark.parametrize("argv, message", [
    (["--dflash-variant", "dflash2"], r"the kimi_k3 draft family has no dflash2 draft; it supports \['dflash', 'dspark'\]"),
    (["--dflash-variant", "domino"], r"the kimi_k3 draft family has no domino draft; it supports \['dflash', 'dspark'\]"),
    (["--target-backend", "megatron"], r"kimi_k3 targets run with \['hf'\] only"),
    (["--pack-sequences"], "drop --pack-sequences"),
])
def test_runs_the_k3_family_cannot_do_are_refused_before_training(tmp_path, argv, message):
    pytest.importorskip("nemo_automodel.components.models.kimi_k3.config")
    target = _target_dir(tmp_path, "KimiK3ForConditionalGeneration", CONFIGS["KimiK3ForConditionalGeneration"]())
    with pytest.raises(ArgumentError, match=message):
        _job(tmp_path, target, *argv)


def test_packing_a_target_with_linear_attention_layers_is_refused(tmp_path):
    # Qwen3.5's gated-delta-net layers keep a recurrent state that a per-document mask does not reset.
    target = _target_dir(tmp_path, "Qwen3_5ForConditionalGeneration", CONFIGS["Qwen3_5ForConditionalGeneration"]())
    with pytest.raises(ArgumentError, match="linear-attention layers .layer_types.*drop --pack-sequences"):
        _job(tmp_path, target, "--pack-sequences")
    assert _job(tmp_path, _target_dir(tmp_path, "Qwen3ForCausalLM", CONFIGS["Qwen3ForCausalLM"]()),
                "--pack-sequences").args.pack_sequences


def test_unknown_architectures_are_refused_with_the_supported_ones(tmp_path):
    target = _target_dir(tmp_path, "GPT2LMHeadModel", dict(TEXT, model_type="gpt2"))
    with pytest.raises(ArgumentError) as err:
        _job(tmp_path, target)
    message = str(err.value)
    assert "'GPT2LMHeadModel' has no draft family" in message
    for name in ("Qwen3ForCausalLM", "Qwen3_5ForConditionalGeneration", "LlamaForCausalLM", "KimiK3ForCausalLM"):
        assert name in message
    # Without `architectures`, the model_type decides; an unknown one is refused the same way.
    (tmp_path / "GPT2LMHeadModel" / "config.json").write_text(json.dumps(dict(TEXT, model_type="gpt2")))
    with pytest.raises(ArgumentError, match="model_type 'gpt2'.*supported architectures"):
        _job(tmp_path, target)


# ------------------------------------------------------------------------------------------ loading and taps


def _load(directory: str):
    from megatron_dflash.training.frozen_target import load_hf_model

    class _Job:  # what the loader reads of a Job
        target_dir = directory
        target_family = None
        with open(os.path.join(directory, "config.json")) as f:
            target_config = json.load(f)

    return load_hf_model(_Job, torch.float32)


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_vl"])
def test_multimodal_wrappers_load_and_tap_their_text_decoder(tmp_path, model_type):
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    wrapper = AutoModelForImageTextToText.from_config(_tiny_text(model_type)).eval()
    directory = str(tmp_path / model_type)
    wrapper.save_pretrained(directory)
    model = _load(directory)
    ids = torch.randint(0, VOCAB, (2, 12))
    layers = [1, 4, 6]
    target = HFTarget(model, layers)
    assert target.num_layers == TEXT["num_hidden_layers"]
    out = target(ids, return_logits=True)
    # The oracle: the multimodal model's own hidden states and logits for the same text.
    with torch.no_grad():
        ref = wrapper(input_ids=ids, output_hidden_states=True)
    expected = torch.cat([ref.hidden_states[i + 1] for i in layers], dim=-1)
    torch.testing.assert_close(out.taps, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(out.logits, ref.logits.float(), rtol=0, atol=1e-5)


def test_the_family_says_whether_decoding_keeps_a_target_kv_cache():
    """`spec_generate` asks `target_keeps_kv_cache` (dicts and config objects, wrappers and text configs): K3's
    model code keeps none and Qwen3.5's linear-attention layers cannot roll back (decoding recomputes both);
    full-attention Qwen3-style targets and unregistered transformers LMs keep theirs."""
    from transformers import Qwen3Config

    from megatron_dflash.target.families import target_keeps_kv_cache

    assert target_keeps_kv_cache({"architectures": ["KimiK3ForConditionalGeneration"], "text_config": {}}) is False
    assert target_keeps_kv_cache({"model_type": "kimi_linear"}) is False  # a K3 text config without architectures
    assert target_keeps_kv_cache(Qwen3Config()) is True
    assert target_keeps_kv_cache(Qwen3Config(num_hidden_layers=2, layer_types=["full_attention"] * 2)) is True
    qwen3_5 = {"architectures": ["Qwen3_5ForConditionalGeneration"],
               "text_config": {"layer_types": ["linear_attention", "full_attention"]}}
    assert target_keeps_kv_cache(qwen3_5) is False  # a recurrent state cannot drop rejected tokens
    assert target_keeps_kv_cache(_tiny_text("qwen3_5")) is False  # the config object, its text config inside
    assert target_keeps_kv_cache({"architectures": ["GPT2LMHeadModel"]}) is True  # unregistered: its HF cache


def test_speculative_decoding_on_a_qwen3_5_target_recomputes_it_losslessly():
    """Qwen3.5's linear-attention layers keep a recurrent state that cannot drop rejected tokens, so `spec_generate`
    recomputes the target every cycle (as for K3): greedy output equals the target's own greedy decoding (one full
    forward per token), rows of different lengths accepting different amounts."""
    from collections import Counter

    from transformers import AutoModelForCausalLM

    from megatron_dflash.draft.body import DFlashBody
    from megatron_dflash.draft.config import DFlashConfig
    from megatron_dflash.decoding.generate import spec_generate
    from tiny_decoding import check_statistics, shape_target

    torch.manual_seed(1)
    target = AutoModelForCausalLM.from_config(_tiny_text("qwen3_5_text")).eval()
    assert "linear_attention" in target.config.layer_types
    shape_target(target, "mixed")
    torch.manual_seed(1)
    draft = DFlashBody(DFlashConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=VOCAB, block_size=4, mask_token_id=VOCAB - 1, num_target_layers=8,
        target_layer_ids=[1, 4], max_position_embeddings=512, rope_theta=10000.0), attention_backend="chunked").eval()
    prompts, new = [[5, 17, 3, 40, 22], [9, 1, 33, 60, 2, 71, 8, 50, 11], [44, 3, 19]], 16
    out = spec_generate(target, draft, prompts, max_new_tokens=new)
    for b, prompt in enumerate(prompts):
        reference = list(prompt)
        with torch.no_grad():
            for _ in range(new):
                reference.append(int(target(torch.tensor([reference])).logits[0, -1].argmax()))
        assert out.sequence(b) == reference, f"row {b}"
    check_statistics(out, 4, new)
    seen = Counter(a for row in out.acceptance_lengths for a in row)
    assert seen[1] > 0 and max(seen) > 1


@pytest.fixture(scope="module")
def tiny_kimi_k3(tmp_path_factory):
    pytest.importorskip("nemo_automodel.components.models.kimi_k3.model")
    from megatron_dflash.target.kimi_k3 import build_tiny_kimi_k3_target

    return build_tiny_kimi_k3_target(str(tmp_path_factory.mktemp("k3") / "target"), tokenizer_dir=SHIPPED_TARGET_DIR,
                                     vocab_size=VOCAB)


def test_tiny_kimi_k3_target_is_tapped_as_the_reference_model_computes_it(tiny_kimi_k3):
    import copy

    with open(os.path.join(tiny_kimi_k3, "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == ["KimiK3ForConditionalGeneration"] and "text_config" in config
    model = _load(tiny_kimi_k3)
    assert type(model).__name__ == "KimiK3ForCausalLM" and type(model.model.layers).__name__ == "ModuleDict"
    assert model.config.attn_res_block_size == 2 and model.config.num_experts == 4  # residual mixer and MoE run
    layers = [1, 3]
    target = HFTarget(model, layers)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    out = target(ids, return_logits=True)
    with torch.no_grad():
        logits = model(ids).logits
        expected = []
        for layer in layers:
            # The reference's own pipeline-stage path: a stage holding layers 0..layer and no final norm returns
            # that layer's output stream (and the attention-residual blocks).
            stage = copy.deepcopy(model.model)
            for name in [k for k in stage.layers if int(k) > layer]:
                del stage.layers[name]
            stage.norm = None
            expected.append(stage(ids)[0])
    torch.testing.assert_close(out.taps, torch.cat(expected, dim=-1), rtol=0, atol=0)
    torch.testing.assert_close(out.logits, logits.float(), rtol=0, atol=1e-6)


def test_a_kimi_k3_draft_trains_on_the_tiny_k3_target_converts_reloads_and_decodes_losslessly(tiny_kimi_k3, tmp_path):
    """The public entry points end to end on a K3 target: pretrain_dflash.py's main trains a few iterations (its
    acceptance evaluation decodes on the K3 target), the converter writes the HF draft from the megatron checkpoint,
    the variant registry's HF reader reloads it (NeMo AutoModel's `KimiK3DFlashDraftModel` reads the same files and
    computes the same block hidden states), and speculative decoding on the K3 target is lossless."""
    from safetensors.torch import load_file

    from megatron_dflash.checkpoint.hf import load_hf_checkpoint
    from megatron_dflash.checkpoint.convert import main as convert
    from megatron_dflash.decoding.generate import spec_generate
    from megatron_dflash.draft.kimi_k3 import KimiK3Body
    from megatron_dflash.plan.batch_plan import DFlashBatchPlan
    from megatron_dflash.training.loop import main
    from nemo_reference import ANCHORS, SEQ, nemo, training_forward

    draft_module = nemo("draft_kimi_k3")
    code = main(["--target", tiny_kimi_k3, "--data-format", "synthetic", "--dflash-num-layers", "2",
                 "--dflash-block-size", "4", "--seq-length", "48", "--dflash-anchors-per-sample", "4",
                 "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "4", "--lr", "2e-3",
                 "--synthetic-train-samples", "16", "--synthetic-valid-samples", "4", "--eval-iters", "1",
                 "--dflash-eval-prompts", "2", "--no-progress-bar", "--run-dir", str(tmp_path / "run"),
                 "--save", str(tmp_path / "ckpt")])
    assert code == 0
    with open(tmp_path / "run" / "summary.json") as f:
        summary = json.load(f)
    assert summary["final_acceptance"]["acceptance_length"] >= 1.0  # decoded on the K3 target while training

    export = tmp_path / "hf"
    assert convert(["to-hf", "--load", str(tmp_path / "ckpt"), "--output", str(export), "--validate"]) == 0
    with open(export / "config.json") as f:
        exported = json.load(f)
    assert exported["architectures"] == ["KimiK3DFlashDraftModel"] and exported["num_target_layers"] == 6

    body = load_hf_checkpoint(str(export), attention_backend="chunked").eval()
    assert isinstance(body, KimiK3Body)
    from nemo_automodel.components.models.kimi_k3.config import KimiK3TextConfig

    ref = draft_module.KimiK3DFlashDraftModel(KimiK3TextConfig(**exported)).float().eval()
    missing, unexpected = ref.load_state_dict(load_file(str(export / "model.safetensors")), strict=True)
    assert not missing and not unexpected

    model = _load(tiny_kimi_k3)
    target = HFTarget(model, body.config.target_layer_ids)
    ids = torch.randint(0, VOCAB, (ANCHORS.shape[0], SEQ), generator=torch.Generator().manual_seed(5))
    taps = target(ids).taps
    target.remove_hooks()
    plan = DFlashBatchPlan.from_anchors(ANCHORS, block_size=4, seq_length=SEQ)
    blocks = target.embedding(torch.where(torch.arange(4) == 0, ids.gather(1, ANCHORS)[..., None],
                                            body.config.mask_token_id))  # [anchor, MASK, ...] per block
    with torch.no_grad():
        ours = body(taps, blocks, plan)
        expected = training_forward(ref, taps, blocks, plan, causal=False)
    assert expected.abs().max() > 0.1
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5)

    prompts, new = [[3, 10, 20, 7, 41], [5, 9, 11]], 10
    out = spec_generate(model, body, prompts, max_new_tokens=new)
    for b, prompt in enumerate(prompts):  # the target's own greedy continuation, recomputed per token
        reference = list(prompt)
        with torch.no_grad():
            for _ in range(new):
                reference.append(int(model(torch.tensor([reference])).logits[0, -1].argmax()))
        assert out.sequence(b) == reference, f"row {b}"
    assert all(1 + sum(a) == new for a in out.acceptance_lengths)
