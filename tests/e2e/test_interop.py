"""Drafters of every published writer load here, and ours load in every published reader.

Writers and readers: NeMo AutoModel 0.7.0 (`nemo_automodel`), the z-lab reference (`dflash`) and
SpecForge 0.2.0 (`specforge`). Each disagrees with the others on where `block_size`, the in-block
direction and the architecture name live (`draft/config.py` lists them). With a package installed, a
drafter is built and saved by it and compared with ours on the same inputs (fp32, 1e-5); without
it, `fixtures/interop/*.json` (config.json files in that writer's layout) check the layout alone. Our
plain DFlash export is read by each reader at the tiny shape and at the smollm2-135m recipe's draft shape
(`builders.smollm2_draft_kwargs`: 9 heads / 3 KV heads of 64, hidden 576, block 4).
"""

from __future__ import annotations

import importlib
import json
import os

import pytest
import torch
from safetensors.torch import save_file

from megatron_dflash.draft.body import DFlashBody
from megatron_dflash.checkpoint.hf import load_hf_checkpoint, save_hf_checkpoint
from megatron_dflash.draft.config import DFlashConfig, resolve_causal
from megatron_dflash.variants.dflash2 import DFlash2Body, DFlash2Config
from megatron_dflash.variants.domino import DominoConfig
from megatron_dflash.variants.jetspec import JetSpecConfig
from megatron_dflash.variants.registry import variant_for_hf_config

from builders import random_body_inputs, smollm2_draft_kwargs, tiny_draft_kwargs
from nemo_reference import ANCHORS, SEQ, nemo, randomize, training_forward
from repo_paths import TESTS_DIR

TOL = 1e-5
FIXTURES = os.path.join(TESTS_DIR, "fixtures", "interop")


# ------------------------------------------------------------------------------ helpers


def inputs(config: DFlashConfig, seed: int = 3):
    return random_body_inputs(config, ANCHORS, SEQ, seed)


def decode_forward(ref, taps, blocks) -> torch.Tensor:
    """A z-lab / SpecForge drafter called as their decoders call it: one block at a time after the
    context before its anchor, no mask (the reader builds what its config says). `[B, N, W, H]`."""
    out = torch.empty_like(blocks)
    W = blocks.shape[2]
    for row in range(ANCHORS.shape[0]):
        for blk in range(ANCHORS.shape[1]):
            anchor = int(ANCHORS[row, blk])
            out[row, blk] = ref(
                position_ids=torch.arange(anchor + W)[None],
                noise_embedding=blocks[row, blk][None],
                target_hidden=taps[row, :anchor][None],
            )[0]
    return out


def qwen3_config(data: dict):
    from transformers import Qwen3Config

    config = Qwen3Config.from_dict(data)
    config._attn_implementation = "eager"
    return config


def nemo_recipe_config(dflash_config: dict, architecture: str, **model) -> dict:
    """The config.json NeMo AutoModel's DFlash recipes write (`_build_qwen3_draft_config`): the
    target's Qwen3 fields, `is_causal: false` always, `block_size` at both places."""
    kwargs = tiny_draft_kwargs()
    data = {
        "architectures": [architecture], "model_type": "qwen3", "hidden_size": kwargs["hidden_size"],
        "intermediate_size": kwargs["intermediate_size"], "num_hidden_layers": kwargs["num_hidden_layers"],
        "num_attention_heads": kwargs["num_attention_heads"], "num_key_value_heads": kwargs["num_key_value_heads"],
        "head_dim": kwargs["head_dim"], "vocab_size": kwargs["vocab_size"], "rope_theta": kwargs["rope_theta"],
        "rms_norm_eps": kwargs["rms_norm_eps"], "max_position_embeddings": 128, "attention_bias": False,
        "layer_types": ["full_attention"] * kwargs["num_hidden_layers"], "sliding_window": None,
        "use_sliding_window": False, "max_window_layers": kwargs["num_hidden_layers"], "is_causal": False,
        "num_target_layers": kwargs["num_target_layers"], "block_size": kwargs["block_size"],
        "dflash_config": {
            "block_size": kwargs["block_size"], "mask_token_id": kwargs["mask_token_id"],
            "target_layer_ids": kwargs["target_layer_ids"], "output_multiplier": 1.0,
            "final_logit_softcapping": None, "input_embedding_scale": 1.0, **dflash_config,
        },
    }
    data.update(model)
    return data


NEMO_DFLASH2_FIELDS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 5}


def save_reference(ref, directory) -> str:
    ref.save_pretrained(str(directory), safe_serialization=True)
    return str(directory)


# ------------------------------------------------------------------------------ NeMo AutoModel writes


def test_nemo_dflash2_drafter_loads_and_converts_to_the_published_layout(tmp_path):
    """`Qwen3DFlash2DraftModel` written by NeMo: same hidden states and selector scores as NeMo's
    trainer forward, and our export of it is what the z-lab reference computes too."""
    draft2 = nemo("draft_qwen3_dflash2")
    torch.manual_seed(0)
    data = nemo_recipe_config(NEMO_DFLASH2_FIELDS, "Qwen3DFlash2DraftModel")
    ref = draft2.Qwen3DFlash2DraftModel(qwen3_config(data)).eval()
    randomize(ref, 1)
    directory = save_reference(ref, tmp_path / "nemo")

    body = load_hf_checkpoint(directory).eval()
    assert isinstance(body, DFlash2Body) and body.config.causal is False
    taps, blocks, plan = inputs(body.config)
    with torch.no_grad():
        ours = body(taps, blocks, plan)
        expected = training_forward(ref, taps, blocks, plan, causal=False, conv_block_size=plan.block_size)
        assert (ours - expected).abs().max().item() <= TOL

        # The selector on the same hidden states, candidates and predecessors.
        gen = torch.Generator().manual_seed(5)
        hidden = ours.reshape(-1, body.config.hidden_size)
        unary = torch.randn(hidden.shape[0], 5, generator=gen)
        ids = torch.randint(0, body.config.vocab_size, (hidden.shape[0], 5), generator=gen)
        predecessor = torch.randint(0, body.config.vocab_size, (hidden.shape[0],), generator=gen)
        got = body.candidate_selector.score(hidden, unary, ids, predecessor)
        want = ref.candidate_selector.pair_scores(hidden, unary, ids, predecessor)
        assert (got - want).abs().max().item() <= TOL

    # Exported in our layout, the z-lab reference reads it as DFlash 2 with the same outputs.
    dflash_model = pytest.importorskip("dflash.model")
    save_hf_checkpoint(body, str(tmp_path / "ours"))
    written = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert written["architectures"] == ["DFlash2DraftModel"]
    zlab = dflash_model.DFlash2DraftModel.from_pretrained(str(tmp_path / "ours"), dtype=torch.float32).eval()
    with torch.no_grad():
        assert (decode_forward(zlab, taps, blocks) - ours).abs().max().item() <= TOL


def test_nemo_jetspec_drafter_is_causal_and_converts_to_the_published_layout(tmp_path):
    """NeMo's JetSpec recipe writes `is_causal: false` and `dflash_config.causal: true`; it trained
    causal, so that is how it loads (as JetSpec, too), with the outputs of NeMo's causal forward."""
    draft = nemo("draft_qwen3")
    data = nemo_recipe_config({"causal": True}, "Qwen3DFlashDraftModel")
    ref = draft.Qwen3DFlashDraftModel(qwen3_config(data)).eval()
    randomize(ref, 2)
    directory = save_reference(ref, tmp_path / "nemo")

    assert JetSpecConfig.from_pretrained(directory).causal is True
    body = load_hf_checkpoint(directory).eval()
    assert body.config.causal is True
    taps, blocks, plan = inputs(body.config)
    with torch.no_grad():
        ours = body(taps, blocks, plan)
        expected = training_forward(ref, taps, blocks, plan, causal=True)
        bidirectional = training_forward(ref, taps, blocks, plan, causal=False)
    assert (ours - expected).abs().max().item() <= TOL
    assert (ours - bidirectional).abs().max().item() > 1e-3  # the direction matters on these inputs

    dflash_model = pytest.importorskip("dflash.model")
    save_hf_checkpoint(body, str(tmp_path / "ours"))
    written = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert written["is_causal"] is True and written["dflash_config"]["causal"] is True
    zlab = dflash_model.DFlashDraftModel.from_pretrained(str(tmp_path / "ours"), dtype=torch.float32).eval()
    with torch.no_grad():
        assert (decode_forward(zlab, taps, blocks) - ours).abs().max().item() <= TOL


def test_nemo_domino_drafter_loads(tmp_path):
    """NeMo writes Domino as `Qwen3DFlashDraftModel` with `dflash_config.projector_type: domino`."""
    draft = nemo("draft_qwen3")
    fields = {"projector_type": "domino", "emb_dim": 8, "gru_hidden_dim": 12, "pure_draft_prefix_len": 1,
              "shift_label": True}
    ref = draft.Qwen3DFlashDraftModel(qwen3_config(nemo_recipe_config(fields, "Qwen3DFlashDraftModel"))).eval()
    randomize(ref, 3)
    body = load_hf_checkpoint(save_reference(ref, tmp_path / "nemo")).eval()
    assert isinstance(body.config, DominoConfig)
    assert (body.config.shift_label, body.config.pure_draft_prefix_len) == (True, 1)
    reference = dict(ref.state_dict())
    for name, tensor in body.domino_head.state_dict().items():
        assert torch.equal(tensor, reference[name]), name
    taps, blocks, plan = inputs(body.config)
    with torch.no_grad():
        ours = body(taps, blocks, plan)
        expected = training_forward(ref, taps, blocks, plan, causal=False)
    assert (ours - expected).abs().max().item() <= TOL


# ------------------------------------------------------------------------------ our export, their readers


# The plain DFlash shapes our export is read at: the tiny one and the smollm2-135m recipe's draft.
SHAPES = {"tiny": tiny_draft_kwargs, "smollm2-135m": smollm2_draft_kwargs}


def our_dflash_body(kwargs: dict) -> DFlashBody:
    torch.manual_seed(0)
    body = DFlashBody(DFlashConfig(**kwargs)).eval()
    randomize(body, 4)
    return body


def assert_every_tensor_loaded(info: dict) -> None:
    assert not info["missing_keys"] and not info["unexpected_keys"], info


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_our_export_loads_in_nemo(tmp_path, shape):
    """NeMo AutoModel's `Qwen3DFlashDraftModel` loads our plain DFlash export by class, every tensor, and
    computes what ours does as its trainer calls it (`[context | blocks]`, bidirectional in-block mask)."""
    draft = nemo("draft_qwen3")
    body = our_dflash_body(SHAPES[shape]())
    save_hf_checkpoint(body, str(tmp_path / "ours"))
    ref, info = draft.Qwen3DFlashDraftModel.from_pretrained(str(tmp_path / "ours"), dtype=torch.float32,
                                                            output_loading_info=True)
    assert_every_tensor_loaded(info)
    ref = ref.eval()
    ref.config._attn_implementation = "eager"
    c = body.config
    assert (ref.block_size, ref.mask_token_id, ref.target_layer_ids) == (c.block_size, c.mask_token_id,
                                                                         c.target_layer_ids)
    attention = ref.layers[0].self_attn
    assert (attention.head_dim, attention.num_key_value_groups) == (c.head_dim,
                                                                    c.num_attention_heads // c.num_key_value_heads)
    taps, blocks, plan = inputs(c)
    with torch.no_grad():
        expected = training_forward(ref, taps, blocks, plan, causal=False)
        assert (body(taps, blocks, plan) - expected).abs().max().item() <= TOL


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_our_export_loads_in_specforge(tmp_path, shape):
    """SpecForge reads `block_size` only at the top level; we write it there too."""
    if importlib.util.find_spec("specforge") is None:
        pytest.skip("SpecForge (`specforge==0.2.0`) is not installed")
    from specforge.modeling.draft.dflash import DFlashDraftModel

    body = our_dflash_body(SHAPES[shape]())
    save_hf_checkpoint(body, str(tmp_path / "ours"))
    ref, info = DFlashDraftModel.from_pretrained(str(tmp_path / "ours"), dtype=torch.float32,
                                                 output_loading_info=True)
    assert_every_tensor_loaded(info)
    ref = ref.eval()
    assert ref.block_size == body.config.block_size
    taps, blocks, plan = inputs(body.config)
    with torch.no_grad():
        assert (decode_forward(ref, taps, blocks) - body(taps, blocks, plan)).abs().max().item() <= TOL


def test_our_domino_export_loads_in_specforge(tmp_path):
    """Every tensor of our Domino export lands in SpecForge's DominoDraftModel, and its backbone
    computes what ours does."""
    if importlib.util.find_spec("specforge") is None:
        pytest.skip("SpecForge (`specforge==0.2.0`) is not installed")
    from specforge.modeling.draft.domino import DominoDraftModel

    from megatron_dflash.variants.domino import DominoBody

    torch.manual_seed(0)
    config = DominoConfig(**tiny_draft_kwargs(emb_dim=8, gru_hidden_dim=12, shift_label=True, pure_draft_prefix_len=1))
    body = DominoBody(config).eval()
    randomize(body, 9)
    save_hf_checkpoint(body, str(tmp_path / "ours"))
    ref, info = DominoDraftModel.from_pretrained(str(tmp_path / "ours"), dtype=torch.float32, output_loading_info=True)
    assert_every_tensor_loaded(info)
    assert (ref.shift_label, ref.pure_draft_prefix_len, ref.block_size) == (True, 1, config.block_size)
    reference = ref.state_dict()
    for name, tensor in body.state_dict().items():
        if not name.endswith("_extra_state"):
            assert torch.equal(tensor, reference[name]), name
    taps, blocks, plan = inputs(config)
    with torch.no_grad():
        assert (decode_forward(ref.eval(), taps, blocks) - body(taps, blocks, plan)).abs().max().item() <= TOL


def test_our_dflash2_export_loads_in_nemo(tmp_path):
    draft2 = nemo("draft_qwen3_dflash2")
    torch.manual_seed(0)
    config = DFlash2Config(**tiny_draft_kwargs(conv_group_size=16, selector_rank=8, selector_top_k=5))
    body = DFlash2Body(config).eval()
    randomize(body, 6)
    save_hf_checkpoint(body, str(tmp_path / "ours"))
    ref = draft2.Qwen3DFlash2DraftModel.from_pretrained(str(tmp_path / "ours"), dtype=torch.float32).eval()
    ref.config._attn_implementation = "eager"
    taps, blocks, plan = inputs(config)
    with torch.no_grad():
        expected = training_forward(ref, taps, blocks, plan, causal=False, conv_block_size=plan.block_size)
        assert (body(taps, blocks, plan) - expected).abs().max().item() <= TOL


# ------------------------------------------------------------------------------ fixture layouts


def fixture(name: str) -> dict:
    with open(os.path.join(FIXTURES, name)) as f:
        return json.load(f)


@pytest.mark.parametrize(
    "name, variant, causal",
    [
        ("nemo_dflash.json", "dflash", False),
        ("nemo_dflash2.json", "dflash2", False),
        ("nemo_jetspec.json", "jetspec", True),
        ("nemo_domino.json", "domino", False),
        ("specforge_dflash.json", "dflash", None),
        ("specforge_domino.json", "domino", None),
        ("zlab_dflash2.json", "dflash2", False),
    ],
)
def test_published_layouts_load_with_their_weights(tmp_path, name, variant, causal):
    """Each writer's config.json picks the right variant and direction, and a directory in that
    layout (weights under the published names) loads."""
    data = fixture(name)
    entry = variant_for_hf_config(data, name)
    assert entry.name == variant
    config = entry.config_cls.from_hf_dict(data)
    assert config.causal is causal and config.block_size == 4
    expected_variant = {"dflash": DFlashConfig, "dflash2": DFlash2Config, "jetspec": JetSpecConfig,
                        "domino": DominoConfig}[variant]
    assert type(config) is expected_variant
    # Plain DFlashConfig reads the direction the same way (JetSpec used to come out bidirectional).
    assert DFlashConfig.from_hf_dict(data).causal is causal

    torch.manual_seed(0)
    source = entry.body_cls(config).eval()
    randomize(source, 7)
    tensors = {k: v.contiguous() for k, v in source.state_dict().items() if not k.endswith("_extra_state")}
    (tmp_path / "d").mkdir()
    save_file(tensors, str(tmp_path / "d" / "model.safetensors"))
    (tmp_path / "d" / "config.json").write_text(json.dumps(data))
    loaded = load_hf_checkpoint(str(tmp_path / "d")).eval()
    assert type(loaded.config) is expected_variant
    taps, blocks, plan = inputs(config)
    with torch.no_grad():
        assert torch.equal(loaded(taps, blocks, plan), source(taps, blocks, plan))


@pytest.mark.parametrize("variant", ["dflash", "dflash2", "jetspec", "domino"])
def test_our_layout_satisfies_every_reader(variant):
    """What each reader looks up is where it looks (fixture-free: the readers' rules, see config.py)."""
    kwargs = tiny_draft_kwargs()
    config = {
        "dflash": lambda: DFlashConfig(**kwargs),
        "dflash2": lambda: DFlash2Config(**tiny_draft_kwargs(conv_group_size=16)),
        "jetspec": lambda: JetSpecConfig(**kwargs),
        "domino": lambda: DominoConfig(**kwargs),
    }[variant]()
    data = json.loads(json.dumps(config.to_hf_dict()))
    dflash = data["dflash_config"]
    # SpecForge: top-level block_size; everyone: dflash_config mask / taps.
    assert data["block_size"] == dflash["block_size"] == config.block_size
    assert dflash["mask_token_id"] == config.mask_token_id and dflash["target_layer_ids"] == config.target_layer_ids
    # The z-lab reference reads the top-level is_causal, vLLM and NeMo dflash_config.causal.
    if config.causal is not None:
        assert data["is_causal"] is config.causal and dflash["causal"] is config.causal
    assert resolve_causal(data) is config.causal
    assert data["architectures"] == [
        {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel", "jetspec": "DFlashDraftModel",
         "domino": "DominoDraftModel"}[variant]
    ]
    assert type(config).from_hf_dict(data) == config


# ------------------------------------------------------------------------------ schedules


def test_domino_curriculum_equals_the_reference():
    get_lambda_base = nemo("domino_core").get_lambda_base
    from megatron_dflash.variants.domino import domino_lambda

    for total in (1, 7, 10, 1000):
        for ratio in (0.0, 0.05, 0.35, 0.5, 1.0):
            for start in (0.0, 0.3, 1.0, 1.5):
                for step in sorted({0, 1, 2, 3, total // 3, total // 2, total - 1, total, total + 5}):
                    ours = domino_lambda(step, total, lambda_start=start, decay_ratio=ratio)
                    assert ours == get_lambda_base(step, total, start, ratio), (step, total, ratio, start)


def test_converter_takes_a_nemo_jetspec_drafter_to_the_published_layout(tmp_path):
    """to-megatron reads NeMo's layout; to-hf writes ours (block_size at both places, both direction
    flags) and says that SpecForge would run the causal drafter bidirectionally."""
    import contextlib
    import io

    from megatron_dflash.checkpoint import convert

    data = fixture("nemo_jetspec.json")
    config = JetSpecConfig.from_hf_dict(data)
    torch.manual_seed(0)
    source = DFlashBody(config).eval()
    randomize(source, 8)
    (tmp_path / "nemo").mkdir()
    save_file({k: v.contiguous() for k, v in source.state_dict().items() if not k.endswith("_extra_state")},
              str(tmp_path / "nemo" / "model.safetensors"))
    (tmp_path / "nemo" / "config.json").write_text(json.dumps(data))
    assert convert.main(["to-megatron", "--load", str(tmp_path / "nemo"), "--output", str(tmp_path / "meg")]) == 0
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert convert.main(["to-hf", "--load", str(tmp_path / "meg"), "--output", str(tmp_path / "hf")]) == 0
    assert "SpecForge" in out.getvalue()
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["architectures"] == ["DFlashDraftModel"] and written["block_size"] == 4
    assert written["is_causal"] is True and written["dflash_config"]["causal"] is True
    loaded = load_hf_checkpoint(str(tmp_path / "hf")).eval()
    taps, blocks, plan = inputs(config)
    with torch.no_grad():
        assert torch.equal(loaded(taps, blocks, plan), source(taps, blocks, plan))
