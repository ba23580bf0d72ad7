"""`KimiK3DraftConfig`: the fields of a Kimi K3 MLA draft, their checks, and its HF `config.json`.

The draft is a small dense stack of Kimi K3's full-attention layers (docs/design.md §16 Kimi K3
draft family): its config is the target's K3 text config (`model_type: kimi_linear`) with the
depth shrunk and everything the draft does not build switched off, plus the DFlash fields. NeMo
AutoModel 0.7.0 writes it that way for `KimiK3DFlashDraftModel`::

    {"architectures": ["KimiK3DFlashDraftModel"], "model_type": "kimi_linear",
     "hidden_size": 7168, "num_attention_heads": 96, "q_lora_rank": 1536, "kv_lora_rank": 512,
     "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": true,
     "mla_use_output_gate": true, "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
     "num_hidden_layers": 5, "num_target_layers": 93, "block_size": 16,
     "num_experts": null, "num_shared_experts": 0, "num_nextn_predict_layers": 0,
     "attn_res_block_size": null, "linear_attn_config": {"kda_layers": [], "full_attn_layers": [1, ..., 5]},
     "dflash_config": {"block_size": 16, "mask_token_id": ..., "target_layer_ids": [...],
                       "output_multiplier": 1.0, "final_logit_softcapping": null, "input_embedding_scale": 1.0},
     ... every other field of the target's text config, verbatim}

We write the same fields (the target's other fields are carried in `extra_hf_fields`, as read)
and read any file that `KimiK3TextConfig` reads: a field that is absent takes that class's
default (a config written with `use_diff=True` omits them), which is what NeMo's loader does.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from ..config import check_draft_fields, default_target_layer_ids, read_config_json, write_config_json

KIMI_K3_DRAFT_ARCHITECTURE = "KimiK3DFlashDraftModel"
# The draft family this package is (the name a target family names, `target.families.TargetFamily.draft_family`).
KIMI_K3_DRAFT_FAMILY = "kimi_k3"
KIMI_K3_MODEL_TYPE = "kimi_linear"

# Keys of `dflash_config` that map 1:1 to fields (besides block_size).
_DFLASH_CONFIG_KEYS = (
    "mask_token_id",
    "target_layer_ids",
    "input_embedding_scale",
    "output_multiplier",
    "final_logit_softcapping",
)
# What a draft built from a K3 target switches off: it is dense, all full attention, without
# MTP heads or the attention-residual mixer. Written over the target's values (as NeMo does).
_DRAFT_OVERRIDES = {
    "num_experts": None,
    "num_shared_experts": 0,
    "num_nextn_predict_layers": 0,
    "attn_res_block_size": None,
    "tie_word_embeddings": False,
}
# Generic `PretrainedConfig` bookkeeping of a saved config.json: not a property of the draft.
_HF_BOOKKEEPING = (
    "architectures", "model_type", "transformers_version", "_name_or_path", "id2label", "label2id",
    "return_dict", "output_attentions", "output_hidden_states", "is_encoder_decoder", "problem_type",
    "chunk_size_feed_forward", "use_cache", "auto_map", "_attn_implementation", "linear_attn_config",
)
# Defaults of NeMo's `KimiK3TextConfig` for the fields the draft interprets (the released
# Kimi K3 shapes), used when a config.json omits them.
_K3_DEFAULTS = dict(
    hidden_size=7168,
    intermediate_size=33792,
    num_attention_heads=96,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    mla_use_nope=True,
    mla_use_output_gate=True,
    rms_norm_eps=1e-5,
    activation_situ_beta=4.0,
    activation_situ_linear_beta=25.0,
    hidden_act="situ",
    vocab_size=163840,
    max_position_embeddings=1048576,
    initializer_range=0.02,
    attention_dropout=0.0,
)


@dataclass
class KimiK3DraftConfig:
    """All fields of a Kimi K3 MLA draft body (names as in K3's `config.json`).

    Attention is MLA: queries through a low-rank bottleneck (`q_lora_rank`; None for a full
    `q_proj`), keys and values from a compressed latent of `kv_lora_rank` plus a
    `qk_rope_head_dim` slice shared by every head. Query/key heads have
    `qk_nope_head_dim + qk_rope_head_dim` channels, value heads `v_head_dim`; there is one
    K/V head per query head (`num_key_value_heads == num_attention_heads`). No rotary is
    applied anywhere (`mla_use_nope` must be true). The MLP is SiTU-gated:
    `down(situ(gate(x)) * bounded(up(x)))` with `activation_situ_beta` /
    `activation_situ_linear_beta` (docs/design.md §16 Kimi K3 draft family).

    DFlash fields (`block_size`, `mask_token_id`, `target_layer_ids`, `num_target_layers`,
    `input_embedding_scale`, `output_multiplier`, `final_logit_softcapping`) mean what they mean
    for `DFlashConfig`. In-block attention is bidirectional on every layer.
    """

    hidden_size: int = _K3_DEFAULTS["hidden_size"]
    intermediate_size: int = _K3_DEFAULTS["intermediate_size"]
    num_hidden_layers: int = 5
    num_attention_heads: int = _K3_DEFAULTS["num_attention_heads"]
    num_key_value_heads: Optional[int] = None
    q_lora_rank: Optional[int] = _K3_DEFAULTS["q_lora_rank"]
    kv_lora_rank: int = _K3_DEFAULTS["kv_lora_rank"]
    qk_nope_head_dim: int = _K3_DEFAULTS["qk_nope_head_dim"]
    qk_rope_head_dim: int = _K3_DEFAULTS["qk_rope_head_dim"]
    v_head_dim: int = _K3_DEFAULTS["v_head_dim"]
    mla_use_nope: bool = True
    mla_use_output_gate: bool = True
    rms_norm_eps: float = _K3_DEFAULTS["rms_norm_eps"]
    activation_situ_beta: Optional[float] = _K3_DEFAULTS["activation_situ_beta"]
    activation_situ_linear_beta: Optional[float] = _K3_DEFAULTS["activation_situ_linear_beta"]
    hidden_act: str = "situ"
    vocab_size: int = _K3_DEFAULTS["vocab_size"]
    max_position_embeddings: int = _K3_DEFAULTS["max_position_embeddings"]
    initializer_range: float = 0.02
    attention_dropout: float = 0.0
    block_size: int = 16
    mask_token_id: Optional[int] = None
    target_layer_ids: Optional[list[int]] = None
    num_target_layers: int = 93
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: Optional[float] = None
    # The target's other text-config fields (KDA, MoE, token ids, dtype, ...), kept verbatim so
    # the draft's config.json still describes its target; never interpreted here.
    extra_hf_fields: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.target_layer_ids is None:
            self.target_layer_ids = default_target_layer_ids(self.num_target_layers, self.num_hidden_layers)
        else:
            self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise `ValueError` naming the first inconsistent field and how to fix it."""
        positive = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "vocab_size",
                    "max_position_embeddings", "num_target_layers"]
        if self.q_lora_rank is not None:
            positive.append("q_lora_rank")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer.")
        if self.num_key_value_heads != self.num_attention_heads:
            raise ValueError(
                f"num_key_value_heads={self.num_key_value_heads} must equal num_attention_heads="
                f"{self.num_attention_heads}: Kimi K3's MLA expands one K/V head per query head."
            )
        if self.mla_use_nope is not True:
            raise ValueError(
                "mla_use_nope must be true: Kimi K3's MLA applies no rotary embedding (the "
                "qk_rope_head_dim slice is a plain key extension shared by all heads)."
            )
        if self.hidden_act != "situ":
            raise ValueError(f"hidden_act={self.hidden_act!r}: the Kimi K3 draft's MLP is SiTU ('situ').")
        for name in ("activation_situ_beta", "activation_situ_linear_beta"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name}={value!r} must be a finite number >= 0 or null.")
        if self.activation_situ_linear_beta == 0:
            raise ValueError("activation_situ_linear_beta=0 divides by zero; use null for an unbounded up branch.")
        if not (self.rms_norm_eps > 0):
            raise ValueError(f"rms_norm_eps={self.rms_norm_eps} must be > 0.")
        if self.attention_dropout != 0:
            raise ValueError(f"attention_dropout={self.attention_dropout}: the draft trains without dropout; set 0.")
        check_draft_fields(self)

    def validate_tensor_parallel(self, tp_size: int) -> None:
        """Check that `tp_size` splits the heads and the MLP evenly (the low-rank A projections
        and their norms are replicated, so `q_lora_rank` / `kv_lora_rank` need not divide)."""
        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"tensor_model_parallel_size={tp_size!r} must be an integer >= 1.")
        if self.num_attention_heads % tp_size:
            divisors = [d for d in range(1, self.num_attention_heads + 1) if self.num_attention_heads % d == 0]
            raise ValueError(
                f"tensor_model_parallel_size={tp_size} must divide num_attention_heads={self.num_attention_heads}: "
                f"this draft supports TP in {divisors}."
            )
        if self.intermediate_size % tp_size:
            raise ValueError(
                f"tensor_model_parallel_size={tp_size} must divide intermediate_size={self.intermediate_size}."
            )

    # ------------------------------------------------------------------ derived
    @property
    def q_head_dim(self) -> int:
        """Channels of a query / key head: the per-head part plus the head-shared slice."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def gamma(self) -> int:
        """Number of predicted slots per block (`block_size - 1`)."""
        return self.block_size - 1

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    def layer_attention(self, layer_idx: int) -> tuple[bool, Optional[int]]:
        """`(causal_in_block, sliding_window)` of a layer: bidirectional, full, on every layer."""
        if not 0 <= layer_idx < self.num_hidden_layers:
            raise IndexError(f"layer {layer_idx} of a {self.num_hidden_layers}-layer draft")
        return False, None

    # ------------------------------------------------------------------ HF format
    def to_hf_dict(self, architecture: str = KIMI_K3_DRAFT_ARCHITECTURE) -> dict[str, Any]:
        """The `config.json` NeMo AutoModel writes for `KimiK3DFlashDraftModel` (module docstring)."""
        out: dict[str, Any] = dict(self.extra_hf_fields)
        out.update(_DRAFT_OVERRIDES)
        for f in dataclasses.fields(self):
            if f.name not in ("extra_hf_fields", *_DFLASH_CONFIG_KEYS):  # those live in dflash_config
                out[f.name] = getattr(self, f.name)
        out.update(
            {
                "architectures": [architecture],
                "model_type": KIMI_K3_MODEL_TYPE,
                # K3's nominal head dim (hidden / heads), which MLA does not use; NeMo writes it.
                "head_dim": self.hidden_size // self.num_attention_heads,
                # Every draft layer is a full-attention (MLA) layer, counted from 1 as K3 does.
                "linear_attn_config": {
                    "kda_layers": [], "full_attn_layers": list(range(1, self.num_hidden_layers + 1))
                },
                "dflash_config": {
                    "block_size": self.block_size,
                    "mask_token_id": self.mask_token_id,
                    "target_layer_ids": list(self.target_layer_ids),
                    "output_multiplier": self.output_multiplier,
                    "final_logit_softcapping": self.final_logit_softcapping,
                    "input_embedding_scale": self.input_embedding_scale,
                },
            }
        )
        return out

    @classmethod
    def from_hf_dict(cls, data: Mapping[str, Any], **overrides: Any) -> "KimiK3DraftConfig":
        """Read a Kimi K3 draft `config.json` dict (ours or NeMo AutoModel's)."""
        data = dict(data)
        dflash = dict(data.pop("dflash_config", None) or {})
        if dflash.get("projector_type") is not None:
            raise ValueError(
                f"dflash_config.projector_type={dflash['projector_type']!r}: the Kimi K3 draft has no "
                "projector head (Domino is built on the Qwen3-style draft only)."
            )
        kwargs: dict[str, Any] = dict(_K3_DEFAULTS)
        names = {f.name for f in dataclasses.fields(cls)} - {"extra_hf_fields"}
        for name in names:
            if name in data:
                kwargs[name] = data.pop(name)
        for name in _DFLASH_CONFIG_KEYS:
            if name in dflash:
                kwargs[name] = dflash.pop(name)
        if "block_size" in dflash:  # the published place wins over the top level
            kwargs["block_size"] = dflash.pop("block_size")
        if "num_target_layers" not in kwargs:
            raise ValueError("config.json has no num_target_layers; the draft cannot know its target's depth.")
        for key in (*_HF_BOOKKEEPING, *_DRAFT_OVERRIDES, "head_dim"):
            data.pop(key, None)
        kwargs["extra_hf_fields"] = data  # the target's fields, verbatim
        kwargs.update(overrides)
        return cls(**kwargs)

    @classmethod
    def from_target_config(
        cls,
        target_text_config: Any,
        *,
        num_hidden_layers: int,
        block_size: int,
        mask_token_id: int,
        target_layer_ids: Optional[list[int]] = None,
        **overrides: Any,
    ) -> "KimiK3DraftConfig":
        """The draft of a Kimi K3 target: its MLA sizes, hidden size and vocabulary, a shallower
        dense stack.

        Args:
            target_text_config: the target's K3 text config (`model_type: kimi_linear`), a dict or
                a `PretrainedConfig`; a multimodal wrapper must be unwrapped to its `text_config` first.
            num_hidden_layers: draft layers.
            block_size, mask_token_id, target_layer_ids: the DFlash fields (taps default to the
                published spread over the target's depth).
            overrides: any other field.
        """
        data = target_text_config.to_dict() if hasattr(target_text_config, "to_dict") else dict(target_text_config)
        model_type = data.get("model_type")
        if model_type != KIMI_K3_MODEL_TYPE:
            raise ValueError(
                f"a Kimi K3 draft needs the target's '{KIMI_K3_MODEL_TYPE}' text config, got model_type={model_type!r}."
            )
        if "num_hidden_layers" not in data:
            raise ValueError("the target config has no num_hidden_layers.")
        data.pop("dflash_config", None)
        data.pop("block_size", None)
        data["num_target_layers"] = int(data.pop("num_hidden_layers"))
        data["num_hidden_layers"] = num_hidden_layers
        data["dflash_config"] = {"block_size": block_size, "mask_token_id": mask_token_id}
        if target_layer_ids is not None:
            data["dflash_config"]["target_layer_ids"] = list(target_layer_ids)
        return cls.from_hf_dict(data, **overrides)

    def save_pretrained(self, directory: str, architecture: str = KIMI_K3_DRAFT_ARCHITECTURE) -> None:
        write_config_json(self, directory, architecture)

    @classmethod
    def from_pretrained(cls, directory: str, **overrides: Any) -> "KimiK3DraftConfig":
        return read_config_json(cls, directory, **overrides)


def is_kimi_k3_draft_config(data: Mapping[str, Any]) -> bool:
    """Whether a `config.json` dict describes a Kimi K3 draft (by its architecture name)."""
    return (data.get("architectures") or [None])[0] == KIMI_K3_DRAFT_ARCHITECTURE
