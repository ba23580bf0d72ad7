"""Tiny Kimi K3 targets and the draft config built from them, for the Kimi K3 draft tests (NeMo parity,
tensor parallelism, decoding): `target_dict(case)` is a K3 text config (`model_type: kimi_linear`) of one
of `CASES`, `our_config(case)` our draft config for it with the draft fields `DRAFT`.
"""

from __future__ import annotations

from megatron_dflash.draft.kimi_k3 import KimiK3DraftConfig

# Tiny K3 shapes. Query/key heads have 8 + 4 = 12 channels and value heads 10 (the kernel pads
# values to 12), or, in the "wide values" case, 4 + 4 = 8 and 16 (queries and keys are padded).
# The SiTU bounds are small so that both tanh branches are far from linear on these activations.
TARGET_FIELDS = dict(
    vocab_size=100,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=8,
    num_attention_heads=4,
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=10,
    rms_norm_eps=1e-5,
    activation_situ_beta=0.5,
    activation_situ_linear_beta=0.7,
    num_experts=None,
    num_shared_experts=0,
    attn_res_block_size=None,
)
CASES = {
    "lora_gated": {},
    "wide_values_no_gate_full_q": dict(q_lora_rank=None, qk_nope_head_dim=4, v_head_dim=16, mla_use_output_gate=False),
    "unbounded_up": dict(activation_situ_beta=None, activation_situ_linear_beta=None),
}
DRAFT = dict(num_hidden_layers=2, block_size=4, mask_token_id=3, target_layer_ids=[1, 3, 5])


def target_dict(case: str) -> dict:
    """A Kimi K3 target's text config (`model_type: kimi_linear`) as a dict."""
    data = {**TARGET_FIELDS, **CASES[case], "model_type": "kimi_linear"}
    return data


def our_config(case: str) -> KimiK3DraftConfig:
    return KimiK3DraftConfig.from_target_config(target_dict(case), **DRAFT)
