"""The checks of a draft's config.json before a body is built from it: the sizing rules agree with the bodies
every variant builds (no false refusal), each contradiction and malformed field is one line naming the file,
the field and its value, and a damaged safetensors header is refused without reading its claimed length."""

from __future__ import annotations

import dataclasses
import json

import pytest

from megatron_dflash.checkpoint.hf import hf_state_dict, save_hf_checkpoint
from megatron_dflash.checkpoint.hf_config_check import check_config_fields, check_config_shapes, hf_tensor_shapes
from megatron_dflash.common.errors import CheckpointError
from megatron_dflash.draft.body import DFlashBody
from megatron_dflash.draft.config import DFlashConfig
from megatron_dflash.draft.kimi_k3 import KimiK3Body
from megatron_dflash.variants.dspark import KimiK3DSparkBody, KimiK3DSparkConfig

from kimi_k3_configs import CASES, DRAFT, our_config, target_dict
from variant_drafts import VARIANTS, common_draft_kwargs, variant_draft

pytestmark = pytest.mark.usefixtures("one_thread")


def _shapes(body) -> dict:
    return {name: list(t.shape) for name, t in hf_state_dict(body).items()}


def _bodies():
    for variant in VARIANTS:
        yield variant, variant_draft(variant)[0]
    for case in CASES:
        yield f"kimi_k3-{case}", KimiK3Body(our_config(case), attention_backend="chunked")
    dspark = KimiK3DSparkConfig.from_target_config(target_dict("lora_gated"), **DRAFT, markov_rank=8,
                                                   markov_head_type="gated", enable_confidence_head=True)
    yield "kimi_k3_dspark", KimiK3DSparkBody(dspark, attention_backend="chunked")
    yield "draft-vocab", DFlashBody(DFlashConfig(**common_draft_kwargs(draft_vocab_size=40)), attention_backend="chunked")


def test_the_sizing_rules_agree_with_every_body_a_variant_builds():
    """Each built-in body's own config passes against its own tensors; one field off by a factor is named."""
    for name, body in _bodies():
        shapes = _shapes(body)
        check_config_shapes(body.config, shapes, "config.json", "model.safetensors")  # no false refusal
        wrong = dataclasses.replace(body.config, hidden_size=2 * body.config.hidden_size)
        with pytest.raises(CheckpointError) as err:
            check_config_shapes(wrong, shapes, "config.json", "model.safetensors")
        assert str(err.value).startswith(f"config.json: hidden_size {2 * body.config.hidden_size} contradicts "
                                         "fc.weight"), name


@pytest.mark.parametrize("data, message", [
    ({"hidden_size": True}, "hidden_size is true; it must be an integer in 1..65536"),
    ({"hidden_size": 64.0}, "hidden_size is 64.0; it must be an integer"),
    ({"num_hidden_layers": 10**12}, "num_hidden_layers is 1000000000000; it must be an integer in 1..1024"),
    ({"dflash_config": {"block_size": 10**12}}, "dflash_config.block_size is 1000000000000"),
    ({"dflash_config": {"target_layer_ids": [1, "2"]}}, "dflash_config.target_layer_ids is [1, \"2\"]"),
    ({"architectures": "DFlashDraftModel"}, "architectures is \"DFlashDraftModel\"; it must be a list of strings"),
    ({"rms_norm_eps": -1}, "rms_norm_eps is -1; it must be a finite number > 0 and < 1"),
    ({"rope_theta": "1e6"}, "rope_theta is \"1e6\"; it must be a finite number > 0"),
    ({"layer_types": "x" * 10_000}, "layer_types is \"xxxxxxxx"),
    ({"dflash_config": 5}, "dflash_config is 5; it must be a JSON object"),
], ids=["bool", "float", "layers", "nested-block", "tap-string", "arch-string", "eps", "theta-string", "long-value",
        "dflash-config"])
def test_a_malformed_field_is_one_line_naming_it(data, message):
    with pytest.raises(CheckpointError) as err:
        check_config_fields(data, "d/config.json")
    text = str(err.value)
    assert text.startswith(f"d/config.json: {message}") and "\n" not in text and len(text) < 300, text


def test_a_safetensors_header_longer_than_its_file_is_refused(tmp_path):
    body, _, _ = variant_draft("dflash")
    save_hf_checkpoint(body, str(tmp_path / "hf"))
    path = tmp_path / "hf" / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes((2**62).to_bytes(8, "little") + data[8:])
    with pytest.raises(CheckpointError) as err:
        hf_tensor_shapes(str(tmp_path / "hf"))
    assert str(err.value).startswith(f"{path} is not a readable safetensors file"), err.value
    header = json.dumps({"fc.weight": {"dtype": "F32", "shape": "big", "data_offsets": [0, 0]}}).encode()
    path.write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(CheckpointError, match="tensor \"fc.weight\" has no shape"):
        hf_tensor_shapes(str(tmp_path / "hf"))
