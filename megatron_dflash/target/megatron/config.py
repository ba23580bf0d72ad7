"""HF config -> megatron-core config and layer specs of the frozen target (docs/design.md §17 Target families).

`hf_target_spec` reads a HF ``config.json`` (Qwen3, Llama, Qwen3-MoE, DeepSeek-V3) into the `HFTargetSpec`
the converter needs, refusing what the megatron target cannot reproduce (attention/MLP biases, sliding
windows, YaRN outside DeepSeek-V3's multi-latent attention, routings megatron-core computes differently) with
an error that names it; DeepSeek-V3's YaRN ``rope_scaling`` maps onto megatron's MLA YaRN, softmax-scale
correction included. `megatron_target_config` turns it into a ``TransformerConfig`` (``MLATransformerConfig``
for DeepSeek-V3) at this job's TP / PP / EP sizes, `check_parallel_sizes` says whether those sizes split the
target, and `megatron_target_block_spec` picks the modules of each layer: megatron's local spec with
`TargetRMSNorm` (and `MLALatentRMSNorm` for MLA's latent norms), or Transformer Engine's.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ...common.parallel import current_process_groups, megatron_ready
from ...draft.config import read_rope_parameters
from ..families import resolve_text_config

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "HFTargetSpec",
    "hf_target_spec",
    "padded_vocab_size",
    "check_parallel_sizes",
    "megatron_target_config",
    "megatron_target_layer_spec",
    "megatron_target_block_spec",
    "MLA_LATENT_NORM_EPS",
    "MLALatentRMSNorm",
    "TargetRMSNorm",
]

SUPPORTED_MODEL_TYPES = ("qwen3", "llama", "qwen3_moe", "deepseek_v3")


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


def check_parallel_sizes(spec: HFTargetSpec, tp: int, ep: int = 1, etp: Optional[int] = None) -> None:
    """Refuse TP / EP / expert-TP sizes that do not split ``spec``'s heads, latent ranks, MLP columns and experts
    into whole parts (``etp`` None: the tensor-parallel size, megatron's default)."""
    etp_defaulted = etp is None
    etp = tp if etp_defaulted else etp
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
            values = [v for n, _, _, v in checks if n == size_name]
            if size_name == "tensor_model_parallel_size" and spec.num_experts and etp_defaulted:
                values.append(spec.moe_intermediate_size)  # expert TP follows TP: it must split the experts too
            fits = _common_divisors(values)
            raise ValueError(
                f"megatron target: {size_name}={size} must divide {name}={value} (this converter splits whole "
                f"query groups, experts and MLP columns across ranks); use {size_name} {_one_of(fits)}."
            )


def _common_divisors(values: list) -> list:
    """The sizes that divide every one of ``values`` (the divisors of their greatest common divisor)."""
    g = math.gcd(*values)
    return [d for d in range(1, g + 1) if g % d == 0]


def _one_of(sizes: list) -> str:
    """``[1]`` -> '1', ``[1, 3]`` -> '1 or 3', ``[1, 2, 4]`` -> '1, 2 or 4'."""
    words = [str(s) for s in sizes]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


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
    check_parallel_sizes(spec, tp, sizes["expert_model_parallel_size"], sizes["expert_tensor_parallel_size"])
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
