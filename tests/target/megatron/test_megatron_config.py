"""HF config -> megatron-core config of the frozen target: the sizes of a tiny Qwen3 and the refusals of what the
converter cannot reproduce (model type, sliding windows, YaRN on a GQA target, biases, TP not dividing the heads,
with the sizes that would).
"""

from __future__ import annotations

import os

import pytest

from megatron_dflash.target.megatron.config import check_parallel_sizes, hf_target_spec, megatron_target_config
from tiny_targets import LAYERS, tiny_models


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    return tiny_models(str(tmp_path_factory.mktemp("targets")))


def test_megatron_config_matches_and_refuses(tiny):
    _, path = tiny["qwen3"]
    cfg = megatron_target_config(path, tensor_model_parallel_size=2)
    assert (cfg.num_layers, cfg.hidden_size, cfg.kv_channels, cfg.num_query_groups) == (LAYERS, 32, 16, 2)
    assert cfg.qk_layernorm and cfg.gated_linear_unit and cfg.normalization == "RMSNorm"
    assert cfg.hidden_dropout == 0.0 and cfg.attention_dropout == 0.0
    base = _config_dict(path)
    with pytest.raises(ValueError, match="must divide num_key_value_heads=2"):
        megatron_target_config(base, tensor_model_parallel_size=4)
    with pytest.raises(ValueError, match="model_type='mistral'"):
        hf_target_spec({**base, "model_type": "mistral"})
    with pytest.raises(ValueError, match="sliding-window"):
        hf_target_spec({**base, "use_sliding_window": True})
    with pytest.raises(ValueError, match="'yarn' is not supported"):
        hf_target_spec({**base, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}})
    with pytest.raises(ValueError, match="attention_bias"):
        hf_target_spec({**base, "attention_bias": True})


def test_a_tp_size_that_does_not_split_the_target_is_refused_with_the_sizes_that_would(tiny):
    # SmolLM2-135M's shape: 9 heads, 3 KV heads, intermediate 1536 (the sizes common to all three: 1 and 3).
    smollm2 = {**_config_dict(tiny["llama_linear"][1]), "hidden_size": 576, "num_attention_heads": 9,
               "num_key_value_heads": 3, "intermediate_size": 1536}
    with pytest.raises(ValueError) as info:
        megatron_target_config(smollm2, tensor_model_parallel_size=2)
    assert str(info.value) == (
        "megatron target: tensor_model_parallel_size=2 must divide num_key_value_heads=3 (this converter splits "
        "whole query groups, experts and MLP columns across ranks); use tensor_model_parallel_size 1 or 3.")
    for tp in (1, 3):
        check_parallel_sizes(hf_target_spec(smollm2), tp)
    # The first check that fails names its field; the sizes offered divide every field split over TP.
    spec = hf_target_spec({**smollm2, "num_attention_heads": 12, "num_key_value_heads": 4, "intermediate_size": 40})
    with pytest.raises(ValueError, match=r"=3 must divide num_key_value_heads=4 .*; use tensor_model_parallel_size "
                                         r"1, 2 or 4\.$"):
        check_parallel_sizes(spec, 3)
    with pytest.raises(ValueError, match=r"=8 must divide intermediate_size=36 .*; use tensor_model_parallel_size "
                                         r"1, 2 or 4\.$"):
        check_parallel_sizes(hf_target_spec({**smollm2, "num_attention_heads": 16, "num_key_value_heads": 8,
                                             "intermediate_size": 36}), 8)
    with pytest.raises(ValueError, match=r"; use tensor_model_parallel_size 1\.$"):
        check_parallel_sizes(hf_target_spec({**smollm2, "num_attention_heads": 9, "num_key_value_heads": 3,
                                             "intermediate_size": 1024}), 3)
    # Expert TP follows TP unless set: the TP sizes offered split the experts' MLP columns too; EP: the experts.
    moe = hf_target_spec({**smollm2, "model_type": "qwen3_moe", "num_attention_heads": 8, "num_key_value_heads": 4,
                          "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 6})
    with pytest.raises(ValueError, match=r"=3 must divide num_key_value_heads=4 .*; use tensor_model_parallel_size "
                                         r"1 or 2\.$"):
        check_parallel_sizes(moe, 3)
    with pytest.raises(ValueError, match=r"=4 must divide num_experts=6 .*; use expert_model_parallel_size "
                                         r"1, 2, 3 or 6\.$"):
        check_parallel_sizes(moe, 1, ep=4)


def _config_dict(path: str) -> dict:
    import json

    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)
