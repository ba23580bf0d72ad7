"""HF config -> megatron-core config of the frozen target: the sizes of a tiny Qwen3 and the refusals of what the
converter cannot reproduce (model type, sliding windows, YaRN on a GQA target, biases, TP not dividing the heads).
"""

from __future__ import annotations

import os

import pytest

from megatron_dflash.target.megatron.config import hf_target_spec, megatron_target_config
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


def _config_dict(path: str) -> dict:
    import json

    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)
