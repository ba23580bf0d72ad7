"""The frozen target: tap capture from a HF model or a megatron-core `GPTModel` (any TP, any PP).

The tap of target layer ``i`` (0-based) is the **output of decoder layer i**, i.e. HF
``hidden_states[i + 1]`` (docs/design.md §2 Conventions). It is captured here, in exactly one way: a forward
hook on decoder layer ``i`` that keeps that layer's output. Nothing else in the package adds or
subtracts the offset; `hf_hidden_state_index` states it for code that reads HF
``output_hidden_states`` (decoding).

Two targets share one contract:

* `HFTarget` wraps a causal LM in a single process (transformers' Qwen3, Qwen3-MoE, Qwen3.5, Qwen3-VL, Llama;
  NeMo AutoModel's Kimi K3, see `kimi_k3_target`; `families` says how each is loaded):
  ``forward(input_ids [B, S]) -> TargetOutput(taps [B, S, taps * H], final_hidden [B, S, H], logits)``,
  taps concatenated in ``target_layer_ids`` order.
* `MegatronTarget` wraps a megatron-core `GPTModel` (one pipeline stage of it; tensor, expert and sequence
  parallel). Its forward captures the taps of the layers this stage owns, keyed by **global** layer id, as
  ``[B, S, H]`` tensors (megatron works in ``[S, B, H]`` inside, ``[S / TP, B, H]`` under sequence
  parallelism: taps are gathered back to the full sequence), so a pipeline schedule can route them to the
  stage that holds the draft. `concat_taps` turns a complete set into the ``[B, S, taps * H]`` context input
  of the body. Context parallelism is refused (`context_parallel_refusal` says why).

Both are frozen: parameters never require gradients, the module stays in eval mode whatever its parent
does, and forwards run under ``torch.no_grad()`` (not inference mode: the taps feed the draft's autograd
graph). Both expose ``embedding`` (the target's input embedding module, vocab-parallel under megatron) and
``output_head`` (an `target.head.OutputHead` over the target's output layer, with the draft's output
multiplier and soft cap).

The megatron target is built from a HF checkpoint directory by `build_megatron_target`, with our own
converter (`target_weights`: one weight plan per rank, streamed shard by shard into the model; Qwen3, Llama
and Qwen3-MoE families: GQA, RMSNorm, SwiGLU, Qwen3's q/k norms, tied or untied embeddings, ``rope_theta``,
linear and llama3 RoPE scaling; Qwen3-MoE's softmax top-k routing with or without renormalisation, dense
``mlp_only_layers`` / ``decoder_sparse_step``; DeepSeek-V3's multi-latent attention, sigmoid group-limited
routing with the score-correction bias, routed scaling, shared experts and dense first layers; experts split
over ``expert_model_parallel_size`` ranks). Other families and features (attention/MLP biases, sliding
windows, YaRN outside DeepSeek-V3's MLA, per-document positions with MLA) are refused with an error that names
them. DeepSeek-V3's YaRN ``rope_scaling`` maps onto megatron's MLA YaRN, softmax-scale correction included.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..common.parallel import ProcessGroups, current_process_groups, megatron_ready
from ..draft.config import DFlashConfig, check_target_layer_ids, read_rope_parameters
from .families import resolve_text_config
from .head import OutputHead
from .masks import causal_mask
from .weights import convert_with_plan, fused_qkv_weight, megatron_weight_plan, safetensors_files, stream_with_plan

__all__ = [
    "TargetOutput",
    "HFTarget",
    "hf_hidden_state_index",
    "taps_from_hidden_states",
    "concat_taps",
    "SUPPORTED_MODEL_TYPES",
    "HFTargetSpec",
    "hf_target_spec",
    "padded_vocab_size",
    "megatron_target_config",
    "megatron_target_layer_spec",
    "megatron_target_block_spec",
    "load_plan_into",
    "fused_qkv_weight",
    "convert_hf_to_megatron_state_dict",
    "load_hf_state_dict",
    "build_megatron_target",
    "MegatronTargetOutput",
    "MegatronTarget",
    "context_parallel_refusal",
]

SUPPORTED_MODEL_TYPES = ("qwen3", "llama", "qwen3_moe", "deepseek_v3")


# --------------------------------------------------------------------------------------------------
# Tap conventions
# --------------------------------------------------------------------------------------------------


def hf_hidden_state_index(layer_id: int) -> int:
    """Index into HF ``output_hidden_states`` of the tap of decoder layer ``layer_id``: ``layer_id + 1``.

    ``hidden_states[0]`` is the embedding output and ``hidden_states[-1]`` the final-norm output, so the
    output of layer ``i < N - 1`` is ``hidden_states[i + 1]``. (The last layer is never tapped.)
    """
    return int(layer_id) + 1


def taps_from_hidden_states(hidden_states: Sequence[torch.Tensor], target_layer_ids: Sequence[int]) -> torch.Tensor:
    """``[B, S, taps * H]`` from HF ``output_hidden_states`` (the reference the hooks must equal)."""
    return torch.cat([hidden_states[hf_hidden_state_index(i)] for i in target_layer_ids], dim=-1)


def concat_taps(taps: Mapping[int, torch.Tensor], target_layer_ids: Sequence[int]) -> torch.Tensor:
    """``[B, S, taps * H]``: the per-layer taps of `MegatronTarget` concatenated in ``target_layer_ids`` order.

    Raises:
        ValueError: if a tapped layer is missing (under pipeline parallelism, route the taps of the other
            stages here first).
    """
    missing = [i for i in target_layer_ids if i not in taps]
    if missing:
        raise ValueError(
            f"concat_taps: taps of target layers {missing} are missing (have {sorted(taps)}); under pipeline "
            "parallelism they live on the stage that owns the layer and must be sent to the draft's stage."
        )
    return torch.cat([taps[i] for i in target_layer_ids], dim=-1)


def _layer_output(output: Any) -> torch.Tensor:
    """The hidden states a decoder layer returned (HF: tensor or tuple; megatron: ``(hidden, context)``)."""
    return output[0] if isinstance(output, (tuple, list)) else output


def _decoder_layers(decoder: Any) -> Optional[list]:
    """The decoder layers in order: a ``ModuleList``, or a ``ModuleDict`` keyed ``"0".."N-1"`` (Kimi K3)."""
    layers = getattr(decoder, "layers", None)
    if isinstance(layers, nn.ModuleList):
        return list(layers)
    if isinstance(layers, nn.ModuleDict) and set(layers.keys()) == {str(i) for i in range(len(layers))}:
        return [layers[str(i)] for i in range(len(layers))]
    return None


def _is_transformers_model(module: Any) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    return isinstance(module, PreTrainedModel)


@dataclass
class TargetOutput:
    """What a single-process target gives the draft.

    Attributes:
        taps: ``[B, S, taps * H]``, the outputs of the tapped layers concatenated in ``target_layer_ids``
            order (layer ``i`` = HF ``hidden_states[i + 1]``).
        final_hidden: ``[B, S, H]``, after the final norm: what the LM head reads (for distillation).
        logits: ``[B, S, V]`` fp32 from `output_head` (multiplier and soft cap applied), only when asked.
    """

    taps: torch.Tensor
    final_hidden: Optional[torch.Tensor] = None
    logits: Optional[torch.Tensor] = None


class _TapsCaptured(Exception):
    """Raised by the hook of the last tapped layer to end a forward whose later layers nobody reads."""


class _FrozenTarget(nn.Module):
    """Shared freezing: no parameter requires grad, eval mode always, hooks store only while capturing.

    Subclasses run their model through `_capture`. A forward that needs only the taps
    (``need_final_hidden=False``) stops after the last tapped layer: that layer's hook raises `_TapsCaptured`
    once the tap is stored, so the layers after it and the final norm never run. The tapped layer is never
    the last one (`check_target_layer_ids`), so this always saves at least one decoder layer.
    """

    _captured: Optional[dict] = None
    _stop_after: Optional[int] = None

    def _freeze(self, model: nn.Module) -> None:
        model.requires_grad_(False)
        model.eval()

    def train(self, mode: bool = True):  # noqa: D102 - the target never trains (no dropout, ever)
        super().train(False)
        return self

    def _full_sequence(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[S, B, H]`` from this rank's sequence shard under sequence parallelism (identity otherwise)."""
        return hidden

    def _hook(self, layer_id: int, transpose: bool):
        def hook(module, args, output):
            if self._captured is None:
                return
            hidden = self._full_sequence(_layer_output(output).detach())
            if transpose:  # megatron [S, B, H] -> [B, S, H]
                hidden = hidden.transpose(0, 1)
            # Always a (contiguous) copy, also where the transpose is a no-op (B = 1): nothing the model
            # does after this layer (megatron adds residuals in place in eval mode) may change the tap.
            self._captured[layer_id] = hidden.clone(memory_format=torch.contiguous_format)
            if layer_id == self._stop_after:
                raise _TapsCaptured

        return hook

    def _capture(self, run, stop_after: Optional[int]) -> tuple[dict, Any]:
        """Run ``run()`` with the tap hooks armed; returns (layer id -> tap, its output). With ``stop_after``
        a layer id, the forward ends at that layer's hook and the output is None."""
        captured = self._captured = {}
        self._stop_after = stop_after
        try:
            return captured, run()
        except _TapsCaptured:
            return captured, None
        finally:
            self._captured = None
            self._stop_after = None


# --------------------------------------------------------------------------------------------------
# HF target (single process)
# --------------------------------------------------------------------------------------------------


class HFTarget(_FrozenTarget):
    """A frozen causal LM (Qwen3, Llama, multimodal wrappers' text decoder, Kimi K3) that returns DFlash taps.

    Args:
        model: a causal LM whose decoder (``model.get_decoder()``, else ``model.model``) has ``.layers`` (a
            ``ModuleList``, or a ``ModuleDict`` keyed by layer index) and returns the final-norm hidden states
            (``.last_hidden_state`` or a tensor); sizes are read from its text config (`resolve_text_config`).
        target_layer_ids: 0-based decoder layers to tap; the last layer and duplicates are refused.
        output_multiplier, final_logit_softcapping: the output transform of `output_head` (the draft's
            ``dflash_config``); see `from_config`.
    """

    def __init__(
        self,
        model: nn.Module,
        target_layer_ids: Sequence[int],
        *,
        output_multiplier: float = 1.0,
        final_logit_softcapping: Optional[float] = None,
    ):
        super().__init__()
        self._freeze(model)
        self.model = model
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
        layers = _decoder_layers(decoder)
        if layers is None:
            raise ValueError(
                f"HFTarget: {type(model).__name__} has no decoder layer list (expected model.get_decoder().layers or "
                "model.model.layers, as in Qwen3/Llama/Kimi K3 causal LMs)."
            )
        self._decoder = decoder
        # transformers decoders take (and must be told) use_cache / return_dict; other decoders (NeMo AutoModel's
        # Kimi K3) take neither and return the final hidden states as a tensor.
        self._decoder_kwargs = {"use_cache": False, "return_dict": True} if _is_transformers_model(decoder) else {}
        self.num_layers = len(layers)
        ids = list(target_layer_ids)
        check_target_layer_ids(ids, self.num_layers)
        self.target_layer_ids = ids
        self._handles = [layers[i].register_forward_hook(self._hook(i, transpose=False)) for i in self.target_layer_ids]
        lm_head = model.get_output_embeddings()
        self.output_head = OutputHead(
            layer=lm_head,
            vocab_size=lm_head.out_features,
            output_multiplier=output_multiplier,
            final_logit_softcapping=final_logit_softcapping,
        )

    @classmethod
    def from_config(cls, model: nn.Module, config: DFlashConfig) -> "HFTarget":
        """The target of the draft ``config``: its tapped layers and output transform; sizes must agree."""
        hf = resolve_text_config(model.config)  # the text decoder's config of a multimodal wrapper
        mismatches = []
        num_layers = getattr(hf, "num_hidden_layers", None)
        if num_layers != config.num_target_layers:
            mismatches.append(f"num_target_layers={config.num_target_layers} but the target has {num_layers} layers")
        if getattr(hf, "hidden_size", None) != config.hidden_size:
            mismatches.append(f"hidden_size={config.hidden_size} but the target's is {getattr(hf, 'hidden_size', None)}")
        if getattr(hf, "vocab_size", None) != config.vocab_size:
            mismatches.append(f"vocab_size={config.vocab_size} but the target's is {getattr(hf, 'vocab_size', None)}")
        if mismatches:
            raise ValueError("HFTarget.from_config: the draft config does not match the target: " + "; ".join(mismatches) + ".")
        return cls(
            model,
            config.target_layer_ids,
            output_multiplier=config.output_multiplier,
            final_logit_softcapping=config.final_logit_softcapping,
        )

    @property
    def embedding(self) -> nn.Module:
        """The target's input embedding module (``model.get_input_embeddings()``)."""
        return self.model.get_input_embeddings()

    def remove_hooks(self) -> None:
        """Take the tap hooks off the model's layers (for a caller that borrowed the model); this
        `HFTarget` is not to be called afterwards."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        *,
        return_logits: bool = False,
        need_final_hidden: bool = True,
    ) -> TargetOutput:
        """Run the target on ``input_ids [B, S]``; ``attention_mask``/``position_ids`` go to HF unchanged.

        ``need_final_hidden=False``: the forward stops after the last tapped layer (``final_hidden`` is None),
        what training needs when no loss reads the target's own prediction.
        """
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise ValueError(f"HFTarget: input_ids must be a [batch, seq_length] tensor, got {shape}.")
        if return_logits and not need_final_hidden:
            raise ValueError("HFTarget: return_logits=True needs the final hidden states (need_final_hidden=True).")
        captured, out = self._capture(
            lambda: self._decoder(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **self._decoder_kwargs
            ),
            stop_after=None if need_final_hidden else max(self.target_layer_ids),
        )
        taps = torch.cat([captured[i] for i in self.target_layer_ids], dim=-1)
        if out is None:
            return TargetOutput(taps=taps)
        final_hidden = out if isinstance(out, torch.Tensor) else out.last_hidden_state
        logits = self.output_head.local_logits(final_hidden) if return_logits else None
        return TargetOutput(taps=taps, final_hidden=final_hidden, logits=logits)


# --------------------------------------------------------------------------------------------------
# HF config -> megatron TransformerConfig
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HFTargetSpec:
    """The architecture facts of a supported HF target, read once from its config."""

    model_type: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    qk_layernorm: bool
    tie_word_embeddings: bool
    rope_theta: float
    rope_scaling: Optional[dict]
    max_position_embeddings: int
    dtype: Optional[torch.dtype] = None
    # Mixture of experts (Qwen3-MoE); num_experts == 0 for dense targets.
    num_experts: int = 0
    moe_intermediate_size: int = 0
    num_experts_per_tok: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple = ()  # per layer: True where the MLP is a sparse MoE block
    router_score: str = "softmax"  # "softmax" (Qwen3-MoE) or "sigmoid" (DeepSeek-V3)
    expert_bias: bool = False  # DeepSeek-V3's e_score_correction_bias (selection only)
    router_groups: Optional[int] = None  # group-limited routing: groups, and groups kept per token
    router_group_topk: Optional[int] = None
    routed_scaling_factor: Optional[float] = None
    shared_expert_intermediate_size: int = 0
    # Multi-latent attention (DeepSeek-V3); kv_lora_rank == 0 for GQA targets.
    q_lora_rank: Optional[int] = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    @property
    def mla(self) -> bool:
        """Whether attention is multi-latent attention (MLASelfAttention)."""
        return self.kv_lora_rank > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` (0-based) has a sparse MoE block instead of a dense MLP."""
        return bool(self.moe_layers) and bool(self.moe_layers[layer])


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _hf_config_dict(hf_config: Any) -> dict:
    """A plain dict from a dict, a transformers config, or a directory / ``config.json`` path."""
    if isinstance(hf_config, (str, os.PathLike)):
        path = os.fspath(hf_config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path) as f:
            return json.load(f)
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    if hasattr(hf_config, "to_dict"):
        return hf_config.to_dict()
    raise TypeError(f"hf_config must be a dict, a transformers config or a path, got {type(hf_config).__name__}.")


def hf_target_spec(hf_config: Any) -> HFTargetSpec:
    """Read and check a Qwen3/Llama/Qwen3-MoE/DeepSeek-V3 config; what the converter cannot reproduce is refused."""
    outer = _hf_config_dict(hf_config)
    cfg = resolve_text_config(outer)  # a multimodal wrapper's text decoder
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        wrapper = f" (the text config of a {outer.get('model_type')!r} checkpoint)" if cfg is not outer else ""
        raise ValueError(
            f"megatron target: model_type={model_type!r}{wrapper} is not supported; supported families: "
            f"{list(SUPPORTED_MODEL_TYPES)} (use HFTarget for other models)."
        )
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"megatron target: hidden_act={act!r} is not supported (only SwiGLU with 'silu').")
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise ValueError(f"megatron target: {key}=True is not supported by this converter (no linear biases).")
    layer_types = cfg.get("layer_types") or []
    if cfg.get("use_sliding_window") or any(t != "full_attention" for t in layer_types):
        raise ValueError(
            "megatron target: sliding-window attention layers are not supported by the megatron target "
            "(use_sliding_window / layer_types); use HFTarget."
        )
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    head_dim = cfg.get("head_dim") or hidden // heads
    theta, scaling = read_rope_parameters(dict(cfg))
    if model_type == "deepseek_v3" and scaling is not None:
        scaling = _deepseek_yarn(cfg, scaling)
    elif scaling is not None:
        rope_type = scaling.get("rope_type")
        if rope_type not in ("linear", "llama3"):
            raise ValueError(
                f"megatron target: rope_scaling type {rope_type!r} is not supported (supported: default, "
                "'linear', 'llama3'; 'yarn' for DeepSeek-V3's multi-latent attention only); use HFTarget."
            )
        if not float(scaling.get("factor", 0)) > 0:
            raise ValueError(f"megatron target: rope_scaling={scaling} needs a positive 'factor'.")
    dtype_name = cfg.get("torch_dtype") or cfg.get("dtype")
    num_layers = int(cfg["num_hidden_layers"])
    moe = _moe_fields(cfg, num_layers) if model_type == "qwen3_moe" else {}
    if model_type == "deepseek_v3":
        moe = {**_deepseek_moe_fields(cfg, num_layers), **_mla_fields(cfg)}
        head_dim = moe["qk_nope_head_dim"] + moe["qk_rope_head_dim"]
    return HFTargetSpec(
        model_type=model_type,
        num_layers=num_layers,
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_attention_heads=heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        vocab_size=int(cfg["vocab_size"]),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        qk_layernorm=model_type in ("qwen3", "qwen3_moe"),
        # transformers' PretrainedConfig default is True.
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        rope_theta=float(theta),
        rope_scaling=scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        dtype=_DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None,
        **moe,
    )


def _deepseek_yarn(cfg: Mapping, scaling: dict) -> dict:
    """DeepSeek-V3's YaRN ``rope_scaling`` resolved to the values megatron's MLA YaRN takes, or refused.

    transformers' DeepSeek-V3 applies YaRN twice: the rotary cos/sin are multiplied by an attention factor
    (``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when both are set, else ``mscale(factor, 1)``),
    and the softmax scale ``1/sqrt(qk_head_dim)`` by ``mscale(factor, mscale_all_dim)**2`` when
    ``mscale_all_dim`` is set. megatron-core's ``MLASelfAttention`` computes the same two factors from its
    ``mscale`` / ``mscale_all_dim`` fields, with 0 for "no softmax correction"; the returned dict holds those
    values under the HF key names (``mscale_all_dim`` 0.0 when absent). ``original_max_position_embeddings``
    follows transformers: a top-level config value first, then ``rope_scaling``'s, then ``max_position_embeddings``.
    """
    rope_type = scaling.get("rope_type")
    if rope_type != "yarn":
        raise ValueError(f"megatron target: DeepSeek-V3 rope_scaling type {rope_type!r} is not supported "
                         "(supported: default, 'yarn'); use HFTarget.")
    factor = float(scaling.get("factor") or 0)
    if not factor > 0:
        raise ValueError(f"megatron target: rope_scaling={scaling} needs a positive 'factor'.")
    if scaling.get("attention_factor") is not None:
        raise ValueError(
            f"megatron target: YaRN rope_scaling with an explicit attention_factor={scaling['attention_factor']} "
            "is not supported (megatron-core derives it from mscale and mscale_all_dim); use HFTarget."
        )
    if not scaling.get("truncate", True):
        raise ValueError("megatron target: YaRN rope_scaling with truncate=False is not supported (megatron-core "
                         "rounds the correction range to whole dimensions); use HFTarget.")
    if float(scaling.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"megatron target: YaRN rope_scaling with partial_rotary_factor="
                         f"{scaling['partial_rotary_factor']} is not supported (RoPE covers all of qk_rope_head_dim).")
    mscale = float(scaling.get("mscale") or 0)
    mscale_all_dim = float(scaling.get("mscale_all_dim") or 0)
    if mscale_all_dim and not mscale:
        # transformers then scales cos/sin by mscale(factor, 1) but still corrects the softmax with
        # mscale_all_dim; megatron-core divides its cos/sin factor by mscale(factor, mscale_all_dim) whenever it
        # corrects the softmax, and no choice of its two fields gives both.
        raise ValueError(f"megatron target: YaRN rope_scaling with mscale_all_dim={mscale_all_dim} but no mscale is "
                         "not supported (megatron-core cannot reproduce transformers' factors); use HFTarget.")
    original = cfg.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
    return dict(
        rope_type="yarn",
        factor=factor,
        original_max_position_embeddings=int(original or cfg.get("max_position_embeddings", 4096)),
        beta_fast=float(scaling.get("beta_fast") or 32),
        beta_slow=float(scaling.get("beta_slow") or 1),
        # Without mscale_all_dim, transformers' cos/sin factor is mscale(factor, 1) whatever mscale says, while
        # megatron's would be mscale(factor, mscale): pass 1.
        mscale=mscale if mscale_all_dim else 1.0,
        mscale_all_dim=mscale_all_dim,
    )


def _mla_fields(cfg: Mapping) -> dict:
    """DeepSeek-V3's multi-latent attention sizes (``q_lora_rank`` None: a plain ``q_proj``)."""
    if not cfg.get("rope_interleave", True):
        raise ValueError("megatron target: rope_interleave=False is not supported (megatron's MLA de-interleaves "
                         "the rotary half of q and k, as DeepSeek-V3 checkpoints need).")
    q_lora = cfg.get("q_lora_rank")
    return dict(
        q_lora_rank=int(q_lora) if q_lora else None,
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
        qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
        v_head_dim=int(cfg["v_head_dim"]),
    )


def _deepseek_moe_fields(cfg: Mapping, num_layers: int) -> dict:
    """DeepSeek-V3's MoE as ``DeepseekV3MoE``/``DeepseekV3TopkRouter`` compute it.

    Layers ``>= first_k_dense_replace`` are sparse. Router: sigmoid scores; experts chosen by score +
    ``e_score_correction_bias`` among the ``topk_group`` of ``n_group`` groups with the highest sum of their
    top-2 scores; weights are the chosen (unbiased) scores, renormalised, times ``routed_scaling_factor``;
    plus ``n_shared_experts`` always-on experts (one MLP of ``n_shared_experts * moe_intermediate_size``).
    megatron-core's router does the same when every group contributes top-``topk // group_topk`` = top-2 and
    it always renormalises sigmoid scores, so other settings are refused.
    """
    experts = int(cfg.get("n_routed_experts") or 0)
    top_k = int(cfg.get("num_experts_per_tok") or 0)
    if experts <= 0 or not 0 < top_k <= experts:
        raise ValueError(f"megatron target: n_routed_experts={experts}, num_experts_per_tok={top_k}: need "
                         "1 <= num_experts_per_tok <= n_routed_experts.")
    if top_k > 1 and not cfg.get("norm_topk_prob", True):
        raise ValueError("megatron target: norm_topk_prob=False with sigmoid routing is not supported (megatron-core "
                         "renormalises the chosen sigmoid scores).")
    groups = int(cfg.get("n_group") or 1)
    group_topk = int(cfg.get("topk_group") or 1)
    if groups > 1 and top_k // group_topk != 2:
        raise ValueError(
            f"megatron target: group-limited routing with num_experts_per_tok={top_k}, topk_group={group_topk}: "
            "DeepSeek-V3 ranks groups by their top-2 scores, megatron-core by their top-(topk / topk_group); they "
            "agree only when num_experts_per_tok / topk_group == 2."
        )
    first_dense = int(cfg.get("first_k_dense_replace") or 0)
    shared = int(cfg.get("n_shared_experts") or 0)
    return dict(
        num_experts=experts,
        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        moe_layers=tuple(i >= first_dense for i in range(num_layers)),
        router_score="sigmoid",
        expert_bias=True,
        router_groups=groups if groups > 1 else None,
        router_group_topk=group_topk if groups > 1 else None,
        routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
        shared_expert_intermediate_size=shared * int(cfg["moe_intermediate_size"]),
    )


def _moe_fields(cfg: Mapping, num_layers: int) -> dict:
    """The MoE facts of a Qwen3-MoE config, as ``Qwen3MoeDecoderLayer``/``Qwen3MoeSparseMoeBlock`` use them.

    Layer ``i`` is sparse unless it is in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``;
    routing is a softmax over all experts, the top ``num_experts_per_tok``, renormalised to sum 1 when
    ``norm_topk_prob``.
    """
    # transformers 5 writes num_local_experts; checkpoints of earlier versions say num_experts.
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    top_k = int(cfg.get("num_experts_per_tok") or 0)
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(int(i) for i in (cfg.get("mlp_only_layers") or []))
    if experts <= 0 or not 0 < top_k <= experts:
        raise ValueError(
            f"megatron target: num_experts={experts}, num_experts_per_tok={top_k}: a Qwen3-MoE target needs "
            "1 <= num_experts_per_tok <= num_experts."
        )
    layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    return dict(
        num_experts=experts,
        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        num_experts_per_tok=top_k,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        moe_layers=layers,
    )


def padded_vocab_size(vocab_size: int, tp_size: int, make_vocab_size_divisible_by: int = 128) -> int:
    """Megatron's padding: the vocabulary rounded up to a multiple of ``make_vocab_size_divisible_by * TP``."""
    multiple = int(make_vocab_size_divisible_by) * int(tp_size)
    return int(math.ceil(vocab_size / multiple) * multiple)


def _parallel_sizes() -> dict:
    """TP, PP, EP and expert-TP sizes of `common.parallel.current_process_groups()` (1 each without megatron)."""
    if megatron_ready():
        groups = current_process_groups()
        return dict(
            tensor_model_parallel_size=groups.tp_size,
            pipeline_model_parallel_size=groups.pp_size,
            expert_model_parallel_size=groups.ep_size,
            expert_tensor_parallel_size=groups.etp_size,
        )
    # Expert TP None: megatron's TransformerConfig sets it to the tensor-parallel size.
    return dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, expert_model_parallel_size=1,
                expert_tensor_parallel_size=None)


def _check_tp(spec: HFTargetSpec, tp: int, ep: int = 1, etp: Optional[int] = None) -> None:
    etp = tp if etp is None else etp
    checks = [("tensor_model_parallel_size", tp, "num_key_value_heads", spec.num_key_value_heads),
              ("tensor_model_parallel_size", tp, "num_attention_heads", spec.num_attention_heads)]
    if spec.mla:
        # The local spec's down projections are column-parallel (their outputs gathered again).
        checks.append(("tensor_model_parallel_size", tp, "kv_lora_rank + qk_rope_head_dim",
                       spec.kv_lora_rank + spec.qk_rope_head_dim))
        if spec.q_lora_rank:
            checks.append(("tensor_model_parallel_size", tp, "q_lora_rank", spec.q_lora_rank))
    if spec.shared_expert_intermediate_size:
        checks.append(("tensor_model_parallel_size", tp, "n_shared_experts * moe_intermediate_size",
                       spec.shared_expert_intermediate_size))
    if not all(spec.is_moe_layer(i) for i in range(spec.num_layers)):
        checks.append(("tensor_model_parallel_size", tp, "intermediate_size", spec.intermediate_size))
    if spec.num_experts:
        checks += [("expert_model_parallel_size", ep, "num_experts", spec.num_experts),
                   ("expert_tensor_parallel_size", etp, "moe_intermediate_size", spec.moe_intermediate_size)]
    elif ep != 1:
        raise ValueError(
            f"megatron target: expert_model_parallel_size={ep} but the {spec.model_type} target has no experts; use 1."
        )
    for size_name, size, name, value in checks:
        if value % size:
            raise ValueError(
                f"megatron target: {size_name}={size} must divide {name}={value} "
                f"(this converter splits whole query groups, experts and MLP columns across ranks)."
            )


def _moe_config(spec: HFTargetSpec) -> dict:
    """megatron-core MoE settings that reproduce HF's ``Qwen3MoeSparseMoeBlock`` exactly at inference.

    HF: ``softmax`` over all experts (fp32), top-k, renormalised when ``norm_topk_prob``. megatron's router
    with ``moe_router_pre_softmax=False`` takes the top-k logits and softmaxes over them, which is the
    renormalised top-k of the full softmax; with ``pre_softmax=True`` it softmaxes first and keeps the raw
    top-k probabilities (``norm_topk_prob=False``). No capacity limit (no dropped tokens), no auxiliary
    losses (the target is frozen), fp32 routing.
    """
    if not spec.num_experts:
        return {}
    return dict(
        num_moe_experts=spec.num_experts,
        moe_ffn_hidden_size=spec.moe_intermediate_size,
        moe_router_topk=spec.num_experts_per_tok,
        moe_router_score_function=spec.router_score,
        moe_router_pre_softmax=spec.router_score == "softmax" and not spec.norm_topk_prob,
        moe_router_enable_expert_bias=spec.expert_bias,
        moe_router_bias_update_rate=0.0,  # frozen: the correction bias is loaded, never updated
        moe_router_num_groups=spec.router_groups,
        moe_router_group_topk=spec.router_group_topk,
        moe_router_topk_scaling_factor=spec.routed_scaling_factor,
        moe_shared_expert_intermediate_size=spec.shared_expert_intermediate_size or None,
        moe_shared_expert_overlap=False,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_z_loss_coeff=None,
        moe_router_dtype="fp32",
        moe_layer_freq=[1 if m else 0 for m in spec.moe_layers],
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        moe_expert_capacity_factor=None,
    )


def megatron_target_config(hf_config: Any, **overrides: Any):
    """A megatron-core ``TransformerConfig`` reproducing a HF Qwen3/Llama config exactly.

    TP/PP sizes default to megatron's ``parallel_state`` (1 when uninitialised); ``params_dtype`` to the
    checkpoint's dtype (fp32 if unknown). Dropout is off and no fused kernel is required. Keyword
    ``overrides`` are passed to ``TransformerConfig`` last (e.g. ``params_dtype=torch.bfloat16``).
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    spec = hf_target_spec(hf_config)
    sizes = _parallel_sizes()
    sizes.update({k: overrides[k] for k in sizes if overrides.get(k) is not None})
    tp = sizes["tensor_model_parallel_size"]
    _check_tp(spec, tp, sizes["expert_model_parallel_size"], sizes["expert_tensor_parallel_size"])
    if overrides.get("sequence_parallel") and tp == 1:
        # At TP = 1 there is no group to shard the sequence over: refuse rather than silently ignore.
        raise ValueError("megatron target: sequence_parallel=True needs tensor_model_parallel_size > 1.")
    dtype = overrides.get("params_dtype", spec.dtype or torch.float32)
    kwargs = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.intermediate_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_key_value_heads,
        kv_channels=spec.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        qk_layernorm=spec.qk_layernorm,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        apply_rope_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
        **sizes,
        **_moe_config(spec),
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        perform_initialization=False,  # every weight is loaded from the checkpoint
        use_cpu_initialization=not torch.cuda.is_available(),
    )
    config_cls = TransformerConfig
    if spec.mla:
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        # MLASelfAttention: q/kv down projections with RMSNorms on the compressed q and kv (qk_layernorm
        # makes them real norms), RoPE on the qk_rope_head_dim part only, positions 0..S-1.
        config_cls = MLATransformerConfig
        kwargs.update(
            multi_latent_attention=True, qk_layernorm=True, q_lora_rank=spec.q_lora_rank,
            kv_lora_rank=spec.kv_lora_rank, qk_head_dim=spec.qk_nope_head_dim,
            qk_pos_emb_head_dim=spec.qk_rope_head_dim, v_head_dim=spec.v_head_dim, rope_type="rope",
            rotary_base=spec.rope_theta, rotary_percent=1.0, kv_channels=None,
            # Even with plain RoPE, MLASelfAttention scales its softmax by YaRN's mscale(rotary_scaling_factor,
            # mscale_all_dim): mscale_all_dim=0 keeps that factor 1.
            mscale=1.0, mscale_all_dim=0.0,
        )
        if spec.rope_scaling is not None:  # YaRN, resolved by _deepseek_yarn
            yarn = spec.rope_scaling
            kwargs.update(
                rope_type="yarn", rotary_scaling_factor=yarn["factor"],
                original_max_position_embeddings=yarn["original_max_position_embeddings"],
                beta_fast=yarn["beta_fast"], beta_slow=yarn["beta_slow"], mscale=yarn["mscale"],
                mscale_all_dim=yarn["mscale_all_dim"],
            )
    kwargs.update(overrides)
    return config_cls(**kwargs)


def _have_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


def megatron_target_layer_spec(qk_layernorm: bool, use_te: bool = False):
    """The GPT layer spec: megatron's local (non-TE) modules, or Transformer Engine's when asked and importable."""
    from megatron.core.models.gpt import gpt_layer_specs

    if use_te:
        if not _have_transformer_engine():
            raise ValueError("use_te=True but transformer_engine cannot be imported; use the local spec (use_te=False).")
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
    return gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=qk_layernorm, normalization="RMSNorm")


def megatron_target_block_spec(config, use_te: bool = False, vp_stage: Optional[int] = None):
    """The decoder spec of this pipeline stage for ``config`` (dense or MoE, any parallelism).

    Transformer Engine, dense: megatron's TE GPT layer spec (norms fused into the following linears).
    Otherwise megatron's ``get_gpt_decoder_block_spec``: per layer a MoE layer where ``moe_layer_freq`` says
    so and a dense layer elsewhere (Qwen3-MoE's ``mlp_only_layers`` / ``decoder_sparse_step``), for the
    layers of this stage only; on the local spec every norm is `TargetRMSNorm` (see there), MLA's latent norms
    `MLALatentRMSNorm`.
    """
    from megatron.core.models.gpt import gpt_layer_specs

    if use_te and not _have_transformer_engine():
        raise ValueError("use_te=True but transformer_engine cannot be imported; use the local spec (use_te=False).")
    if use_te and config.multi_latent_attention:
        # TE fuses MLA's latent norms into the up projections, with layernorm_epsilon (see MLALatentRMSNorm).
        raise ValueError("use_te=True with multi-latent attention (DeepSeek-V3) is not supported: Transformer Engine "
                         "fuses the latent norms with the wrong epsilon; use the local spec (use_te=False).")
    if use_te and not config.num_moe_experts:
        return megatron_target_layer_spec(config.qk_layernorm, use_te=True)
    block = gpt_layer_specs.get_gpt_decoder_block_spec(
        config, use_transformer_engine=use_te, normalization="RMSNorm", vp_stage=vp_stage
    )
    if use_te:
        return block
    swaps = {"WrappedTorchNorm": TargetRMSNorm}
    if config.multi_latent_attention:
        swaps["DotProductAttention"] = _mla_core_attention()
    # The final norm too: megatron picks apex's FusedLayerNorm (LayerNorm only) for it when apex is installed.
    block = dataclasses.replace(_swap_modules(block, swaps), layer_norm=TargetRMSNorm)
    return _with_latent_norms(block) if config.multi_latent_attention else block


# transformers' DeepSeek-V3 attention (the only multi-latent-attention family the converter takes: DeepSeek-V3,
# Kimi K2 and their fine-tunes) builds its latent norms ``q_a_layernorm`` / ``kv_a_layernorm`` with the RMSNorm
# default epsilon, ignoring ``rms_norm_eps``; megatron-core's MLASelfAttention builds them (``q_layernorm`` /
# ``kv_layernorm``) with ``layernorm_epsilon``, which is ``rms_norm_eps`` for every other norm of the target.
# Built with rms_norm_eps = 1e-5, a tiny DeepSeek-V3's taps were 2e-4 relative off from layer 0 on.
MLA_LATENT_NORM_EPS = 1e-6


class MLALatentRMSNorm:
    """`TargetRMSNorm` with DeepSeek-V3's latent-norm epsilon (`MLA_LATENT_NORM_EPS`) whatever megatron passes."""

    def __new__(cls, config, hidden_size: int, eps: float = MLA_LATENT_NORM_EPS, **unused: Any):
        return TargetRMSNorm(config, hidden_size, eps=MLA_LATENT_NORM_EPS)


def _with_latent_norms(spec: Any) -> Any:
    """``spec`` with the q / kv latent norms of every ``MLASelfAttention`` built as `MLALatentRMSNorm`."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttentionSubmodules

    if isinstance(spec, MLASelfAttentionSubmodules):
        return dataclasses.replace(spec, q_layernorm=MLALatentRMSNorm, kv_layernorm=MLALatentRMSNorm)
    if isinstance(spec, list):
        return [_with_latent_norms(s) for s in spec]
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        fields = {f.name: _with_latent_norms(getattr(spec, f.name)) for f in dataclasses.fields(spec) if f.init}
        return dataclasses.replace(spec, **fields)
    return spec


def _mla_core_attention():
    """megatron's local ``DotProductAttention`` for ``MLASelfAttention``, whose value heads are narrower.

    megatron-core 0.16's MLA passes ``k_channels``/``v_channels`` to its core attention, which only Transformer
    Engine's attention accepts; the local attention's math (``q k^T``, softmax, ``p v``) is already correct for
    a value head dim that differs from the query/key one, except the width it reshapes the context to
    (``heads * v_channels / TP``). This subclass takes the two arguments and sets that width.
    """
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLACoreAttention(DotProductAttention):
        def __init__(self, *args, k_channels: Optional[int] = None, v_channels: Optional[int] = None, **kwargs):
            super().__init__(*args, **kwargs)
            if v_channels is not None:
                self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    return MLACoreAttention


class TargetRMSNorm:
    """megatron's norm signature -> ``torch.nn.RMSNorm``, also under sequence parallelism.

    megatron's ``WrappedTorchNorm`` (its local RMSNorm) builds the same module but refuses
    ``sequence_parallel``: trained under SP, a norm's weight gradient would need an all-reduce over the TP
    group that plain torch norms do not do. The target is frozen (no gradients), so the refusal does not
    apply to it; the forward is per token and identical.
    """

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **unused: Any):
        if config.normalization != "RMSNorm":
            raise ValueError(f"TargetRMSNorm: normalization={config.normalization!r}; the target uses RMSNorm.")
        return nn.RMSNorm(hidden_size, eps=eps)


def _swap_modules(spec: Any, swaps: Mapping[str, type]) -> Any:
    """``spec`` (a megatron spec tree) with every megatron module class named in ``swaps`` replaced."""
    if isinstance(spec, type) and spec.__module__.startswith("megatron.core") and spec.__name__ in swaps:
        return swaps[spec.__name__]
    if isinstance(spec, list):
        return [_swap_modules(s, swaps) for s in spec]
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        fields = {f.name: _swap_modules(getattr(spec, f.name), swaps) for f in dataclasses.fields(spec) if f.init}
        return dataclasses.replace(spec, **fields)
    return spec


# --------------------------------------------------------------------------------------------------
# HF weights -> megatron weights
# --------------------------------------------------------------------------------------------------


def convert_hf_to_megatron_state_dict(
    hf_state_dict: Mapping[str, torch.Tensor],
    hf_config: Any,
    tp_rank: int = 0,
    tp_size: int = 1,
    *,
    layer_offset: int = 0,
    num_layers: Optional[int] = None,
    pre_process: bool = True,
    post_process: bool = True,
    padded_vocab: Optional[int] = None,
    make_vocab_size_divisible_by: int = 128,
    dtype: Optional[torch.dtype] = None,
    transformer_engine_names: bool = False,
    ep_rank: int = 0,
    ep_size: int = 1,
    etp_rank: Optional[int] = None,
    etp_size: Optional[int] = None,
) -> dict[str, torch.Tensor]:
    """The state dict of one (TP, EP rank, PP stage) shard of a megatron ``GPTModel`` from HF weights.

    Args:
        hf_state_dict: HF names (``model.layers.N.self_attn.q_proj.weight``, ...) to tensors; a lazy mapping
            is fine, only the tensors of this stage are read.
        tp_rank, tp_size: this rank's tensor-parallel coordinates.
        layer_offset, num_layers: the global layers ``layer_offset .. layer_offset + num_layers - 1`` this
            stage owns (megatron names them ``decoder.layers.0 ..``); all layers by default.
        pre_process, post_process: whether this stage holds the embedding / the final norm and output layer.
        padded_vocab: the model's (padded) vocabulary; `padded_vocab_size` by default. Padded rows are zero
            (never looked up; their logits are masked by `OutputHead`).
        dtype: cast every tensor to this dtype (default: keep).
        transformer_engine_names: name the norms as the TE spec does (fused into the following linear).
        ep_rank, ep_size: this rank's expert-parallel coordinates (MoE targets: only its experts are read).
        etp_rank, etp_size: expert tensor parallelism (default: ``tp_rank``/``tp_size``, megatron's default).

    Layouts: see `target_weights`. With tied embeddings the output layer is absent on a stage that also
    holds the embedding (megatron reuses the embedding weight) and is the embedding's copy otherwise.
    """
    spec = hf_target_spec(hf_config)
    plan = _weight_plan(spec, tp_rank, tp_size, layer_offset=layer_offset, num_layers=num_layers,
                        pre_process=pre_process, post_process=post_process, padded_vocab=padded_vocab,
                        make_vocab_size_divisible_by=make_vocab_size_divisible_by, dtype=dtype,
                        transformer_engine_names=transformer_engine_names, ep_rank=ep_rank, ep_size=ep_size,
                        etp_rank=etp_rank, etp_size=etp_size)
    return convert_with_plan(plan, hf_state_dict, spec.model_type)


def _weight_plan(
    spec: HFTargetSpec,
    tp_rank: int,
    tp_size: int,
    *,
    layer_offset: int,
    num_layers: Optional[int],
    padded_vocab: Optional[int],
    make_vocab_size_divisible_by: int,
    ep_rank: int,
    ep_size: int,
    etp_rank: Optional[int],
    etp_size: Optional[int],
    **kwargs: Any,
) -> list:
    """`target.weights.megatron_weight_plan` after checking this rank's coordinates against ``spec``."""
    _check_tp(spec, tp_size, ep_size, etp_size)
    for name, rank, size in (("tp_rank", tp_rank, tp_size), ("ep_rank", ep_rank, ep_size),
                             ("etp_rank", etp_rank, etp_size)):
        if rank is not None and not 0 <= rank < (size or tp_size):
            raise ValueError(f"{name}={rank} must be in [0, {size or tp_size}).")
    if num_layers is None:
        num_layers = spec.num_layers - layer_offset
    if layer_offset < 0 or num_layers < 0 or layer_offset + num_layers > spec.num_layers:
        raise ValueError(
            f"layers {layer_offset}..{layer_offset + num_layers - 1} are outside the target's {spec.num_layers} layers."
        )
    vocab = padded_vocab or padded_vocab_size(spec.vocab_size, tp_size, make_vocab_size_divisible_by)
    if vocab < spec.vocab_size or vocab % tp_size:
        raise ValueError(f"padded_vocab={vocab} must be >= vocab_size={spec.vocab_size} and divisible by TP={tp_size}.")
    return megatron_weight_plan(spec, tp_rank=tp_rank, tp_size=tp_size, layer_offset=layer_offset,
                                num_layers=num_layers, padded_vocab=vocab, ep_rank=ep_rank, ep_size=ep_size,
                                etp_rank=etp_rank, etp_size=etp_size, **kwargs)


class _SafetensorsDirectory(Mapping):
    """Lazy ``name -> tensor`` view of the safetensors files of a HF directory (one or many shards)."""

    def __init__(self, directory: str):
        from safetensors import safe_open

        files = safetensors_files(directory)
        self._handles = {path: safe_open(path, framework="pt") for path in files}
        self._where = {key: path for path, handle in self._handles.items() for key in handle.keys()}

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._handles[self._where[key]].get_tensor(key)

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key: object) -> bool:
        return key in self._where


def load_hf_state_dict(hf_dir: str) -> Mapping[str, torch.Tensor]:
    """A lazy mapping over the safetensors weights of ``hf_dir``: tensors are read when indexed."""
    return _SafetensorsDirectory(hf_dir)


def load_plan_into(model: nn.Module, plan: Sequence, files: Sequence[str], model_type: str) -> None:
    """Copy the planned weights into ``model``'s parameters as they stream in, one shard file at a time.

    The plan must name every tensor of ``model.state_dict()`` (Transformer Engine's ``_extra_state`` aside)
    and nothing else; this is checked before any file is read. Each converted tensor is copied into its
    parameter (on the model's device) and dropped, so host memory never holds this rank's whole slice.
    """
    state = model.state_dict(keep_vars=True)
    expected = {k for k in state if not k.endswith("_extra_state")}
    planned = [w.name for w in plan]
    missing = sorted(expected - set(planned))
    unexpected = sorted(set(planned) - expected)
    if missing or unexpected:
        raise RuntimeError(
            f"build_megatron_target: the converted weights do not match the model: missing {missing}, "
            f"unexpected {unexpected}."
        )
    with torch.no_grad():
        for name, tensor in stream_with_plan(plan, files, model_type):
            param = state[name]
            if tuple(param.shape) != tuple(tensor.shape):
                raise RuntimeError(
                    f"build_megatron_target: {name} is {tuple(tensor.shape)} in the converted checkpoint but "
                    f"{tuple(param.shape)} in the model."
                )
            param.copy_(tensor)


def build_megatron_target(
    hf_dir: str,
    *,
    pre_process: Optional[bool] = None,
    post_process: Optional[bool] = None,
    use_te: bool = False,
    make_vocab_size_divisible_by: int = 128,
    vp_stage: Optional[int] = None,
    groups: Optional[ProcessGroups] = None,
    **config_overrides: Any,
):
    """A megatron-core ``GPTModel`` stage with the weights of the HF Qwen3/Llama checkpoint in ``hf_dir``.

    Needs megatron's ``parallel_state`` initialised (megatron's layers read it). TP/PP/EP sizes and this rank's
    coordinates come from ``groups`` (default `common.parallel.current_process_groups()`).
    ``pre_process``/``post_process`` default to "first/last pipeline stage". The vocabulary is padded to a
    multiple of ``make_vocab_size_divisible_by * TP``. Returns the model in eval mode; wrap it in
    `MegatronTarget` (or use `MegatronTarget.from_pretrained`) to freeze it and capture taps.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    if not megatron_ready():
        raise ValueError("build_megatron_target needs megatron's parallel_state initialised (initialize_model_parallel).")
    groups = current_process_groups() if groups is None else groups
    spec = hf_target_spec(hf_dir)
    config = megatron_target_config(hf_dir, **config_overrides)
    if pre_process is None:
        pre_process = groups.pp_rank == 0
    if post_process is None:
        post_process = groups.pp_rank == groups.pp_size - 1
    tp_size, tp_rank = groups.tp_size, groups.tp_rank
    vocab = padded_vocab_size(spec.vocab_size, tp_size, make_vocab_size_divisible_by)
    linear_scaling = None
    if spec.rope_scaling is not None and spec.rope_scaling["rope_type"] == "linear":
        linear_scaling = float(spec.rope_scaling["factor"])
    model = GPTModel(
        config=config,
        transformer_layer_spec=megatron_target_block_spec(config, use_te=use_te, vp_stage=vp_stage),
        vocab_size=vocab,
        max_sequence_length=spec.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=spec.rope_theta,
        rope_scaling=False,
        seq_len_interpolation_factor=linear_scaling,
        vp_stage=vp_stage,
    )
    if spec.rope_scaling is not None and spec.rope_scaling["rope_type"] == "llama3":
        s = spec.rope_scaling
        rotary = model.rotary_pos_emb
        rotary.inv_freq = rotary._apply_scaling(
            rotary.inv_freq,
            factor=float(s["factor"]),
            low_freq_factor=float(s["low_freq_factor"]),
            high_freq_factor=float(s["high_freq_factor"]),
            original_max_position_embeddings=int(s["original_max_position_embeddings"]),
        )
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    plan = _weight_plan(
        spec, tp_rank, tp_size, layer_offset=offset, num_layers=len(model.decoder.layers),
        pre_process=pre_process, post_process=post_process, padded_vocab=vocab,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by, dtype=config.params_dtype,
        transformer_engine_names=use_te,
        ep_rank=groups.ep_rank,
        ep_size=groups.ep_size,
        etp_rank=groups.etp_rank,
        etp_size=groups.etp_size,
    )
    load_plan_into(model, plan, safetensors_files(hf_dir), spec.model_type)
    model.eval()
    return model


def context_parallel_refusal(config) -> Optional[str]:
    """Why the target cannot run with ``config``'s context parallelism (None when it is 1).

    megatron-core 0.16 splits attention over the context-parallel group only in Transformer Engine's
    ``TEDotProductAttention``; its local ``DotProductAttention`` asserts ``context_parallel_size == 1``. The
    target also would need the load-balanced (zig-zag) sequence split and its inverse for the taps, which are
    not implemented; so context parallelism is refused on every backend, with this reason.
    """
    cp = int(getattr(config, "context_parallel_size", 1) or 1)
    if cp == 1:
        return None
    return (
        f"context_parallel_size={cp} is not supported for the frozen target: megatron-core runs context-parallel "
        "attention only in Transformer Engine's TEDotProductAttention (its local DotProductAttention refuses it), "
        "and the target's taps would need un-splitting from the load-balanced sequence order. Use "
        "--sequence-parallel with tensor parallelism to shard long sequences instead."
    )


# --------------------------------------------------------------------------------------------------
# Megatron target (one pipeline stage)
# --------------------------------------------------------------------------------------------------


@dataclass
class MegatronTargetOutput:
    """What one pipeline stage of the megatron target produced.

    Attributes:
        taps: global layer id -> ``[B, S, H]`` output of that layer, for the tapped layers this stage owns.
        output_tensor: ``[S, B, H]`` activations to send to the next stage (None on the last stage).
        final_hidden: ``[B, S, H]`` after the final norm (last stage only): what the output layer reads.
        logits: ``[B, S, V_padded / TP]`` fp32, this rank's vocabulary shard from `output_head` (padded
            columns are ``-inf``); last stage and ``return_logits=True`` only.
    """

    taps: dict = field(default_factory=dict)
    output_tensor: Optional[torch.Tensor] = None
    final_hidden: Optional[torch.Tensor] = None
    logits: Optional[torch.Tensor] = None


class MegatronTarget(_FrozenTarget):
    """A frozen megatron-core ``GPTModel`` stage that captures the taps of the layers it owns.

    Args:
        model: a ``GPTModel`` (one pipeline stage), e.g. from `build_megatron_target`.
        target_layer_ids: global 0-based layers to tap (checked against ``config.num_layers``; the last layer
            and duplicates are refused). Only those this stage owns are hooked.
        vocab_size: the real (unpadded) vocabulary, for `output_head`.
        output_multiplier, final_logit_softcapping: the output transform of `output_head`.
    """

    def __init__(
        self,
        model: nn.Module,
        target_layer_ids: Sequence[int],
        *,
        vocab_size: int,
        output_multiplier: float = 1.0,
        final_logit_softcapping: Optional[float] = None,
        vp_stage: Optional[int] = None,
    ):
        super().__init__()
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        config = model.config
        refusal = context_parallel_refusal(config)
        if refusal:
            raise ValueError("MegatronTarget: " + refusal)
        # Sequence parallelism: inside the stage activations are [S / TP, B, H]; taps and final_hidden are
        # gathered back to the full sequence (the draft needs every position on every TP rank).
        self.sequence_parallel = bool(config.sequence_parallel)
        self.tp_size = int(config.tensor_model_parallel_size)
        self._freeze(model)
        self.model = model
        self.num_layers = int(config.num_layers)
        ids = list(target_layer_ids)
        check_target_layer_ids(ids, self.num_layers)
        self.target_layer_ids = ids
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
        layers = model.decoder.layers
        self.layer_ids = [offset + i for i in range(len(layers))]
        for local, layer in enumerate(layers):
            if getattr(layer, "layer_number", offset + local + 1) != offset + local + 1:
                raise RuntimeError(
                    f"MegatronTarget: local layer {local} has layer_number {layer.layer_number}, expected "
                    f"{offset + local + 1} (stage offset {offset})."
                )
        self.owned_tap_ids = [i for i in ids if i in self.layer_ids]
        self._handles = [
            layers[i - offset].register_forward_hook(self._hook(i, transpose=True)) for i in self.owned_tap_ids
        ]
        self.pre_process = bool(model.pre_process)
        self.post_process = bool(model.post_process)
        self.vocab_size = int(vocab_size)
        self.output_head: Optional[OutputHead] = None
        if self.post_process:
            weight = None
            if model.share_embeddings_and_output_weights and model.output_layer.weight is None:
                weight = model.shared_embedding_or_output_weight()
            self.output_head = OutputHead(
                layer=model.output_layer,
                vocab_size=self.vocab_size,
                tp_group=getattr(model.output_layer, "tp_group", None),
                output_multiplier=output_multiplier,
                final_logit_softcapping=final_logit_softcapping,
                weight=weight,
            )
        self._te = any(type(m).__module__.startswith("megatron.core.extensions.transformer_engine") for m in model.modules())

    def _full_sequence(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self.sequence_parallel:
            return hidden
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        # Forward only (no_grad): a plain all-gather along the sequence over the TP group.
        return gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)

    @classmethod
    def from_pretrained(
        cls,
        hf_dir: str,
        target_layer_ids: Optional[Sequence[int]] = None,
        *,
        config: Optional[DFlashConfig] = None,
        pre_process: Optional[bool] = None,
        post_process: Optional[bool] = None,
        **build_kwargs: Any,
    ) -> "MegatronTarget":
        """Build the stage from a HF directory (`build_megatron_target`) and wrap it.

        Give either ``target_layer_ids`` or the draft ``config`` (its tapped layers and output transform;
        its target depth, hidden size and vocabulary must match the checkpoint).
        """
        spec = hf_target_spec(hf_dir)
        multiplier, softcap = 1.0, None
        if config is not None:
            mismatches = []
            if config.num_target_layers != spec.num_layers:
                mismatches.append(f"num_target_layers={config.num_target_layers} but the target has {spec.num_layers}")
            if config.hidden_size != spec.hidden_size:
                mismatches.append(f"hidden_size={config.hidden_size} but the target's is {spec.hidden_size}")
            if config.vocab_size != spec.vocab_size:
                mismatches.append(f"vocab_size={config.vocab_size} but the target's is {spec.vocab_size}")
            if mismatches:
                raise ValueError("MegatronTarget: the draft config does not match the target: " + "; ".join(mismatches) + ".")
            if target_layer_ids is None:
                target_layer_ids = config.target_layer_ids
            multiplier, softcap = config.output_multiplier, config.final_logit_softcapping
        if target_layer_ids is None:
            raise ValueError("MegatronTarget.from_pretrained: give target_layer_ids or the draft config.")
        model = build_megatron_target(hf_dir, pre_process=pre_process, post_process=post_process, **build_kwargs)
        return cls(
            model,
            target_layer_ids,
            vocab_size=spec.vocab_size,
            output_multiplier=multiplier,
            final_logit_softcapping=softcap,
            vp_stage=build_kwargs.get("vp_stage"),
        )

    @property
    def embedding(self) -> Optional[nn.Module]:
        """The vocab-parallel input embedding (``VocabParallelEmbedding``); None on stages without it."""
        return self.model.embedding.word_embeddings if self.pre_process else None

    # ------------------------------------------------------------------ forward helpers
    def _rotary(self, seq_length: int, batch: int, position_ids: Optional[torch.Tensor], device) -> Optional[torch.Tensor]:
        if getattr(self.model.config, "multi_latent_attention", False):
            # MLASelfAttention builds its own RoPE for positions 0..S-1 and takes no per-token positions.
            if position_ids is not None:
                default = torch.arange(seq_length, device=position_ids.device).expand(batch, seq_length)
                if tuple(position_ids.shape) != (batch, seq_length) or not torch.equal(position_ids, default):
                    raise ValueError(
                        "MegatronTarget: a multi-latent-attention target runs RoPE at positions 0..S-1 only "
                        "(megatron-core's MLASelfAttention takes no position ids); per-document positions "
                        "(--pack-sequences) are not supported with it."
                    )
            return None
        rotary = self.model.rotary_pos_emb
        if position_ids is None:
            return rotary(seq_length)  # [S, 1, 1, D], positions 0..S-1
        if tuple(position_ids.shape) != (batch, seq_length):
            raise ValueError(
                f"MegatronTarget: position_ids must be [batch, seq_length] = {(batch, seq_length)}, "
                f"got {tuple(position_ids.shape)}."
            )
        inv_freq = rotary.inv_freq.to(device=device, dtype=torch.float32)
        positions = position_ids.to(device=device, dtype=torch.float32).t()  # [S, B]
        if rotary.seq_len_interpolation_factor is not None:
            positions = positions / rotary.seq_len_interpolation_factor
        freqs = positions[..., None] * inv_freq  # fp32 [S, B, D/2]
        return torch.cat([freqs, freqs], dim=-1)[:, :, None, :]  # [S, B, 1, D]

    def _check_sequence(self, seq_length: int) -> None:
        if self.sequence_parallel and seq_length % self.tp_size:
            raise ValueError(
                f"MegatronTarget: with sequence parallelism the sequence length ({seq_length}) must be a multiple "
                f"of tensor_model_parallel_size={self.tp_size}; pad the batch (e.g. --seq-length) to a multiple."
            )

    def _attention_mask(self, attention_mask, batch: int, seq_length: int, device) -> Optional[torch.Tensor]:
        if attention_mask is None:
            return None  # megatron's causal default
        if self._te:
            raise ValueError(
                "MegatronTarget: an explicit attention_mask is not supported with the Transformer Engine spec "
                "(its causal kernel ignores masks); pass attention_mask=None."
            )
        if attention_mask.dim() == 2:  # [B, S] padding mask, 1/True = real token
            if tuple(attention_mask.shape) != (batch, seq_length):
                raise ValueError(
                    f"MegatronTarget: a 2-D attention_mask must be [batch, seq_length] = {(batch, seq_length)}, "
                    f"got {tuple(attention_mask.shape)}."
                )
            keep = attention_mask.to(device=device, dtype=torch.bool)
            return causal_mask(seq_length, device) | ~keep[:, None, None, :]
        if attention_mask.dim() == 4 and attention_mask.dtype == torch.bool and attention_mask.shape[-2:] == (seq_length, seq_length):
            return attention_mask.to(device)  # [B or 1, 1, S, S], True = masked (megatron's convention)
        raise ValueError(
            "MegatronTarget: attention_mask must be None, a [batch, seq_length] padding mask (1 = token) or a "
            f"bool [batch or 1, 1, S, S] mask (True = masked); got {tuple(attention_mask.shape)} {attention_mask.dtype}."
        )

    @torch.no_grad()
    def forward(
        self,
        input_ids: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        *,
        input_tensor: Optional[torch.Tensor] = None,
        return_logits: bool = False,
        need_final_hidden: bool = True,
    ) -> MegatronTargetOutput:
        """Run this stage.

        Args:
            input_ids: ``[B, S]`` token ids (first stage; ignored elsewhere).
            attention_mask: None (causal; megatron builds it), a ``[B, S]`` padding mask, or a bool
                ``[B or 1, 1, S, S]`` mask with True = masked (local spec only).
            position_ids: ``[B, S]`` RoPE positions (e.g. per document when packed); default ``0..S-1``.
            input_tensor: ``[S, B, H]`` activations from the previous stage (stages after the first).
            return_logits: also return this rank's fp32 logit shard (last stage).
            need_final_hidden: False on the last stage: stop after the last tapped layer this stage owns
                (``final_hidden`` is None), what training needs when no loss reads the target's prediction.
                Earlier stages always run whole (the next stage needs their output).
        """
        if return_logits and not need_final_hidden:
            raise ValueError("MegatronTarget: return_logits=True needs the final hidden states (need_final_hidden=True).")
        model = self.model
        if self.pre_process:
            if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
                shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
                raise ValueError(f"MegatronTarget: the first stage needs input_ids [batch, seq_length], got {shape}.")
            batch, seq_length = input_ids.shape
            device = input_ids.device
            self._check_sequence(seq_length)
            hidden = model.embedding(input_ids=input_ids, position_ids=None)  # [S, B, H] ([S / TP, B, H] under SP)
        else:
            if not isinstance(input_tensor, torch.Tensor) or input_tensor.dim() != 3:
                shape = tuple(input_tensor.shape) if isinstance(input_tensor, torch.Tensor) else type(input_tensor).__name__
                raise ValueError(
                    f"MegatronTarget: a stage after the first needs input_tensor [S, B, H] from the previous stage, got {shape}."
                )
            seq_length, batch = input_tensor.shape[:2]
            if self.sequence_parallel:
                seq_length *= self.tp_size  # this rank's shard of the sequence
            device = input_tensor.device
            hidden = None
        rotary = self._rotary(seq_length, batch, position_ids, device)
        mask = self._attention_mask(attention_mask, batch, seq_length, device)
        stop = not need_final_hidden and self.post_process and len(self.owned_tap_ids) > 0
        if not self.pre_process:
            model.decoder.set_input_tensor(input_tensor)
        try:
            captured, out = self._capture(
                lambda: model.decoder(hidden_states=hidden, attention_mask=mask, rotary_pos_emb=rotary),
                stop_after=max(self.owned_tap_ids) if stop else None,
            )
        finally:
            if not self.pre_process:
                model.decoder.set_input_tensor(None)
        result = MegatronTargetOutput(taps={i: captured[i] for i in self.owned_tap_ids})
        if out is None:
            return result
        if self.post_process:
            result.final_hidden = self._full_sequence(out).transpose(0, 1).contiguous()
            if return_logits:
                result.logits = self.output_head.local_logits(result.final_hidden)
        else:
            result.output_tensor = out
        return result
