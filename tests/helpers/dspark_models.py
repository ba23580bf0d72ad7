"""DSpark drafts for the parity tests: NeMo AutoModel's DSpark modules (or a skip), a transformers config of an
exported draft, a tiny Kimi K3 DSpark config."""

import importlib
import json

import pytest

from megatron_dflash.variants.dspark import KimiK3DSparkConfig

from kimi_k3_configs import DRAFT as K3_DRAFT, target_dict as k3_target_dict


def nemo_dspark(module: str):
    """`nemo_automodel.components.speculative.dspark.<module>`, or skip."""
    if importlib.util.find_spec("nemo_automodel") is None:
        pytest.skip("NeMo AutoModel (`nemo-automodel==0.7.0`) is not installed")
    return importlib.import_module(f"nemo_automodel.components.speculative.dspark.{module}")


def qwen3_config(path: str):
    from transformers import Qwen3Config

    with open(path) as f:
        config = Qwen3Config.from_dict(json.load(f))
    config._attn_implementation = "eager"
    return config


def k3_config() -> KimiK3DSparkConfig:
    data = {**k3_target_dict("lora_gated"), "model_type": "kimi_linear", "architectures": ["KimiK3DSparkModel"]}
    data["num_target_layers"] = data.pop("num_hidden_layers")
    data.update(num_hidden_layers=K3_DRAFT["num_hidden_layers"], block_size=K3_DRAFT["block_size"],
                mask_token_id=K3_DRAFT["mask_token_id"], target_layer_ids=K3_DRAFT["target_layer_ids"],
                markov_rank=8, markov_head_type="rnn", enable_confidence_head=True, confidence_head_with_markov=True)
    return KimiK3DSparkConfig.from_hf_dict(data)
