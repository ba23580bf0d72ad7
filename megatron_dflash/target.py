"""The frozen target: tap capture from a HF model or a megatron-core `GPTModel` (any TP, any PP).

The tap of target layer ``i`` (0-based) is the **output of decoder layer i**, i.e. HF
``hidden_states[i + 1]`` (DESIGN section 2). It is captured here, in exactly one way: a forward
hook on decoder layer ``i`` that keeps that layer's output. Nothing else in the package adds or
subtracts the offset; `hf_hidden_state_index` states it for code that reads HF
``output_hidden_states`` (decoding).

Two targets share one contract:

* `HFTarget` wraps a transformers causal LM (Qwen3, Llama) in a single process:
  ``forward(input_ids [B, S]) -> TargetOutput(taps [B, S, taps * H], final_hidden [B, S, H], logits)``,
  taps concatenated in ``target_layer_ids`` order.
* `MegatronTarget` wraps a megatron-core `GPTModel` (one pipeline stage of it). Its forward captures
  the taps of the layers this stage owns, keyed by **global** layer id, as ``[B, S, H]`` tensors (megatron
  works in ``[S, B, H]`` inside), so a pipeline schedule can route them to the stage that holds the draft.
  `concat_taps` turns a complete set into the ``[B, S, taps * H]`` context input of the body.

Both are frozen: parameters never require gradients, the module stays in eval mode whatever its parent
does, and forwards run under ``torch.no_grad()`` (not inference mode: the taps feed the draft's autograd
graph). Both expose ``embedding`` (the target's input embedding module, vocab-parallel under megatron) and
``output_head`` (an `objectives.OutputHead` over the target's output layer, with the draft's output
multiplier and soft cap).

The megatron target is built from a HF checkpoint directory by `build_megatron_target`, with our own
converter `convert_hf_to_megatron_state_dict` (Qwen3 and Llama families: GQA, RMSNorm, SwiGLU, Qwen3's
q/k norms, tied or untied embeddings, ``rope_theta``, linear and llama3 RoPE scaling). Other families and
features (attention/MLP biases, sliding windows, YaRN, MoE) are refused with an error that names them.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .config import DFlashConfig, check_target_layer_ids, read_rope_parameters
from .objectives import OutputHead

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
    "fused_qkv_weight",
    "convert_hf_to_megatron_state_dict",
    "load_hf_state_dict",
    "build_megatron_target",
    "MegatronTargetOutput",
    "MegatronTarget",
]

SUPPORTED_MODEL_TYPES = ("qwen3", "llama")


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


class _FrozenTarget(nn.Module):
    """Shared freezing: no parameter requires grad, eval mode always, hooks store only while capturing."""

    def _freeze(self, model: nn.Module) -> None:
        model.requires_grad_(False)
        model.eval()

    def train(self, mode: bool = True):  # noqa: D102 - the target never trains (no dropout, ever)
        super().train(False)
        return self

    def _hook(self, layer_id: int, transpose: bool):
        def hook(module, args, output):
            if self._captured is None:
                return
            hidden = _layer_output(output).detach()
            if transpose:  # megatron [S, B, H] -> [B, S, H]
                hidden = hidden.transpose(0, 1)
            # Always a (contiguous) copy, also where the transpose is a no-op (B = 1): nothing the model
            # does after this layer (megatron adds residuals in place in eval mode) may change the tap.
            self._captured[layer_id] = hidden.clone(memory_format=torch.contiguous_format)

        return hook


# --------------------------------------------------------------------------------------------------
# HF target (single process)
# --------------------------------------------------------------------------------------------------


class HFTarget(_FrozenTarget):
    """A frozen transformers causal LM (Qwen3, Llama) that returns DFlash taps.

    Args:
        model: a ``*ForCausalLM`` whose base model (``model.get_decoder()``) has ``.layers``.
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
        layers = getattr(decoder, "layers", None)
        if not isinstance(layers, nn.ModuleList):
            raise ValueError(
                f"HFTarget: {type(model).__name__} has no decoder layer list (expected model.get_decoder().layers, "
                "as in Qwen3/Llama causal LMs)."
            )
        self._decoder = decoder
        self.num_layers = len(layers)
        ids = list(target_layer_ids)
        check_target_layer_ids(ids, self.num_layers)
        self.target_layer_ids = ids
        self._captured: Optional[dict] = None
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
        hf = model.config
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

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        *,
        return_logits: bool = False,
    ) -> TargetOutput:
        """Run the target on ``input_ids [B, S]``; ``attention_mask``/``position_ids`` go to HF unchanged."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise ValueError(f"HFTarget: input_ids must be a [batch, seq_length] tensor, got {shape}.")
        self._captured = {}
        try:
            out = self._decoder(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=False,
                return_dict=True,
            )
            captured = self._captured
        finally:
            self._captured = None
        taps = torch.cat([captured[i] for i in self.target_layer_ids], dim=-1)
        final_hidden = out.last_hidden_state
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
    """Read and check a Qwen3/Llama config; anything this converter cannot reproduce exactly is refused."""
    cfg = _hf_config_dict(hf_config)
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"megatron target: model_type={model_type!r} is not supported; supported families: "
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
    if scaling is not None:
        rope_type = scaling.get("rope_type")
        if rope_type not in ("linear", "llama3"):
            raise ValueError(
                f"megatron target: rope_scaling type {rope_type!r} is not supported (supported: default, "
                "'linear', 'llama3')."
            )
        if not float(scaling.get("factor", 0)) > 0:
            raise ValueError(f"megatron target: rope_scaling={scaling} needs a positive 'factor'.")
    dtype_name = cfg.get("torch_dtype") or cfg.get("dtype")
    return HFTargetSpec(
        model_type=model_type,
        num_layers=int(cfg["num_hidden_layers"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_attention_heads=heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        vocab_size=int(cfg["vocab_size"]),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        qk_layernorm=model_type == "qwen3",
        # transformers' PretrainedConfig default is True.
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        rope_theta=float(theta),
        rope_scaling=scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        dtype=_DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None,
    )


def padded_vocab_size(vocab_size: int, tp_size: int, make_vocab_size_divisible_by: int = 128) -> int:
    """Megatron's padding: the vocabulary rounded up to a multiple of ``make_vocab_size_divisible_by * TP``."""
    multiple = int(make_vocab_size_divisible_by) * int(tp_size)
    return int(math.ceil(vocab_size / multiple) * multiple)


def _parallel_sizes() -> tuple[int, int]:
    import torch.distributed as dist
    from megatron.core import parallel_state

    if dist.is_available() and dist.is_initialized() and parallel_state.model_parallel_is_initialized():
        return (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
        )
    return 1, 1


def _check_tp(spec: HFTargetSpec, tp: int) -> None:
    for name, value in (
        ("num_key_value_heads", spec.num_key_value_heads),
        ("num_attention_heads", spec.num_attention_heads),
        ("intermediate_size", spec.intermediate_size),
    ):
        if value % tp:
            raise ValueError(
                f"megatron target: tensor_model_parallel_size={tp} must divide {name}={value} "
                f"(this converter splits whole query groups across TP ranks)."
            )


def megatron_target_config(hf_config: Any, **overrides: Any):
    """A megatron-core ``TransformerConfig`` reproducing a HF Qwen3/Llama config exactly.

    TP/PP sizes default to megatron's ``parallel_state`` (1 when uninitialised); ``params_dtype`` to the
    checkpoint's dtype (fp32 if unknown). Dropout is off and no fused kernel is required. Keyword
    ``overrides`` are passed to ``TransformerConfig`` last (e.g. ``params_dtype=torch.bfloat16``).
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    spec = hf_target_spec(hf_config)
    tp, pp = _parallel_sizes()
    tp = overrides.get("tensor_model_parallel_size", tp)
    _check_tp(spec, tp)
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
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        perform_initialization=False,  # every weight is loaded from the checkpoint
        use_cpu_initialization=not torch.cuda.is_available(),
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


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


# --------------------------------------------------------------------------------------------------
# HF weights -> megatron weights
# --------------------------------------------------------------------------------------------------


def _chunk(tensor: torch.Tensor, tp_rank: int, tp_size: int, dim: int) -> torch.Tensor:
    if tensor.shape[dim] % tp_size:
        raise ValueError(f"cannot split a tensor of shape {tuple(tensor.shape)} on dim {dim} into {tp_size} parts.")
    return torch.chunk(tensor, tp_size, dim=dim)[tp_rank]


def _pad_rows(weight: torch.Tensor, rows: int) -> torch.Tensor:
    if weight.shape[0] == rows:
        return weight
    pad = weight.new_zeros((rows - weight.shape[0],) + tuple(weight.shape[1:]))
    return torch.cat([weight, pad], dim=0)


def fused_qkv_weight(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_query_groups: int, head_dim: int) -> torch.Tensor:
    """Megatron's ``linear_qkv`` weight: per query group ``[q heads of the group; k; v]``.

    ``q [heads * hd, H]``, ``k``/``v`` ``[groups * hd, H]`` -> ``[groups * (heads/groups + 2) * hd, H]``, the
    layout `SelfAttention.get_query_key_value_tensors` views as ``[groups, (q_per_group + 2) * hd]``.
    """
    hidden = q.shape[-1]
    q = q.reshape(num_query_groups, -1, head_dim, hidden)
    k = k.reshape(num_query_groups, 1, head_dim, hidden)
    v = v.reshape(num_query_groups, 1, head_dim, hidden)
    return torch.cat([q, k, v], dim=1).reshape(-1, hidden)


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
) -> dict[str, torch.Tensor]:
    """The state dict of one (TP rank, PP stage) shard of a megatron ``GPTModel`` from HF Qwen3/Llama weights.

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

    Layouts: ``linear_qkv`` is the per-query-group interleaved ``[q_g; k_g; v_g]`` matrix, split by whole
    groups across TP; ``linear_proj`` and ``linear_fc2`` are split on their input dim; ``linear_fc1`` is
    ``[gate shard; up shard]`` per rank; the embedding and output layer are split by vocabulary rows. With
    tied embeddings the output layer is absent on a stage that also holds the embedding (megatron reuses the
    embedding weight) and is the embedding's copy otherwise.
    """
    spec = hf_target_spec(hf_config)
    _check_tp(spec, tp_size)
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank={tp_rank} must be in [0, {tp_size}).")
    if num_layers is None:
        num_layers = spec.num_layers - layer_offset
    if layer_offset < 0 or num_layers < 0 or layer_offset + num_layers > spec.num_layers:
        raise ValueError(
            f"layers {layer_offset}..{layer_offset + num_layers - 1} are outside the target's {spec.num_layers} layers."
        )
    vocab = padded_vocab or padded_vocab_size(spec.vocab_size, tp_size, make_vocab_size_divisible_by)
    if vocab < spec.vocab_size or vocab % tp_size:
        raise ValueError(f"padded_vocab={vocab} must be >= vocab_size={spec.vocab_size} and divisible by TP={tp_size}.")

    def get(name: str) -> torch.Tensor:
        if name not in hf_state_dict:
            raise KeyError(f"HF checkpoint has no tensor {name!r} (a {spec.model_type} checkpoint was expected).")
        tensor = hf_state_dict[name]
        return tensor.to(dtype) if dtype is not None else tensor

    def vocab_shard(name: str) -> torch.Tensor:
        weight = get(name)
        if weight.shape[0] != spec.vocab_size:
            raise ValueError(f"{name} has {weight.shape[0]} rows but vocab_size={spec.vocab_size}.")
        return _chunk(_pad_rows(weight, vocab), tp_rank, tp_size, 0).contiguous()

    if transformer_engine_names:
        input_norm, mlp_norm = "self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight"
    else:
        input_norm, mlp_norm = "input_layernorm.weight", "pre_mlp_layernorm.weight"

    out: dict[str, torch.Tensor] = {}
    if pre_process:
        out["embedding.word_embeddings.weight"] = vocab_shard("model.embed_tokens.weight")
    for local in range(num_layers):
        src = f"model.layers.{layer_offset + local}."
        dst = f"decoder.layers.{local}."
        qkv = fused_qkv_weight(
            get(src + "self_attn.q_proj.weight"),
            get(src + "self_attn.k_proj.weight"),
            get(src + "self_attn.v_proj.weight"),
            spec.num_key_value_heads,
            spec.head_dim,
        )
        # Groups are contiguous row blocks of the fused matrix: TP takes whole groups.
        out[dst + "self_attention.linear_qkv.weight"] = _chunk(qkv, tp_rank, tp_size, 0).contiguous()
        out[dst + "self_attention.linear_proj.weight"] = _chunk(get(src + "self_attn.o_proj.weight"), tp_rank, tp_size, 1).contiguous()
        if spec.qk_layernorm:
            out[dst + "self_attention.q_layernorm.weight"] = get(src + "self_attn.q_norm.weight")
            out[dst + "self_attention.k_layernorm.weight"] = get(src + "self_attn.k_norm.weight")
        gate = _chunk(get(src + "mlp.gate_proj.weight"), tp_rank, tp_size, 0)
        up = _chunk(get(src + "mlp.up_proj.weight"), tp_rank, tp_size, 0)
        out[dst + "mlp.linear_fc1.weight"] = torch.cat([gate, up], dim=0).contiguous()
        out[dst + "mlp.linear_fc2.weight"] = _chunk(get(src + "mlp.down_proj.weight"), tp_rank, tp_size, 1).contiguous()
        out[dst + input_norm] = get(src + "input_layernorm.weight")
        out[dst + mlp_norm] = get(src + "post_attention_layernorm.weight")
    if post_process:
        out["decoder.final_layernorm.weight"] = get("model.norm.weight")
        if not spec.tie_word_embeddings:
            out["output_layer.weight"] = vocab_shard("lm_head.weight")
        elif not pre_process:
            out["output_layer.weight"] = vocab_shard("model.embed_tokens.weight")
    return out


class _SafetensorsDirectory(Mapping):
    """Lazy ``name -> tensor`` view of the safetensors files of a HF directory (one or many shards)."""

    def __init__(self, directory: str):
        from safetensors import safe_open

        index = os.path.join(directory, "model.safetensors.index.json")
        single = os.path.join(directory, "model.safetensors")
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        elif os.path.isfile(single):
            files = ["model.safetensors"]
        else:
            raise FileNotFoundError(
                f"{directory} holds no model.safetensors or model.safetensors.index.json; save the target with "
                "save_pretrained(safe_serialization=True)."
            )
        self._handles = {name: safe_open(os.path.join(directory, name), framework="pt") for name in files}
        self._where = {key: name for name, handle in self._handles.items() for key in handle.keys()}

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


def build_megatron_target(
    hf_dir: str,
    *,
    pre_process: Optional[bool] = None,
    post_process: Optional[bool] = None,
    use_te: bool = False,
    make_vocab_size_divisible_by: int = 128,
    vp_stage: Optional[int] = None,
    **config_overrides: Any,
):
    """A megatron-core ``GPTModel`` stage with the weights of the HF Qwen3/Llama checkpoint in ``hf_dir``.

    Needs megatron's ``parallel_state`` initialised (TP/PP sizes and this rank's coordinates come from it).
    ``pre_process``/``post_process`` default to "first/last pipeline stage". The vocabulary is padded to a
    multiple of ``make_vocab_size_divisible_by * TP``. Returns the model in eval mode; wrap it in
    `MegatronTarget` (or use `MegatronTarget.from_pretrained`) to freeze it and capture taps.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    if not parallel_state.model_parallel_is_initialized():
        raise ValueError("build_megatron_target needs megatron's parallel_state initialised (initialize_model_parallel).")
    spec = hf_target_spec(hf_dir)
    config = megatron_target_config(hf_dir, **config_overrides)
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=True)
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    vocab = padded_vocab_size(spec.vocab_size, tp_size, make_vocab_size_divisible_by)
    linear_scaling = None
    if spec.rope_scaling is not None and spec.rope_scaling["rope_type"] == "linear":
        linear_scaling = float(spec.rope_scaling["factor"])
    model = GPTModel(
        config=config,
        transformer_layer_spec=megatron_target_layer_spec(spec.qk_layernorm, use_te=use_te),
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
    state = convert_hf_to_megatron_state_dict(
        load_hf_state_dict(hf_dir),
        hf_dir,
        tp_rank,
        tp_size,
        layer_offset=offset,
        num_layers=len(model.decoder.layers),
        pre_process=pre_process,
        post_process=post_process,
        padded_vocab=vocab,
        dtype=config.params_dtype,
        transformer_engine_names=use_te,
    )
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise RuntimeError(
            f"build_megatron_target: the converted weights do not match the model: missing {missing}, "
            f"unexpected {unexpected}."
        )
    model.eval()
    return model


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
        if config.sequence_parallel:
            raise ValueError(
                "MegatronTarget: sequence_parallel=True is not supported yet (taps and block embeddings need the "
                "full sequence on every TP rank); build the target with sequence_parallel=False."
            )
        if getattr(config, "context_parallel_size", 1) > 1:
            raise ValueError("MegatronTarget: context_parallel_size > 1 is not supported; use 1.")
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
        self._captured: Optional[dict] = None
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
    def _rotary(self, seq_length: int, batch: int, position_ids: Optional[torch.Tensor], device) -> torch.Tensor:
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
            causal = torch.ones(seq_length, seq_length, dtype=torch.bool, device=device).triu(1)
            return causal[None, None] | ~keep[:, None, None, :]
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
    ) -> MegatronTargetOutput:
        """Run this stage.

        Args:
            input_ids: ``[B, S]`` token ids (first stage; ignored elsewhere).
            attention_mask: None (causal; megatron builds it), a ``[B, S]`` padding mask, or a bool
                ``[B or 1, 1, S, S]`` mask with True = masked (local spec only).
            position_ids: ``[B, S]`` RoPE positions (e.g. per document when packed); default ``0..S-1``.
            input_tensor: ``[S, B, H]`` activations from the previous stage (stages after the first).
            return_logits: also return this rank's fp32 logit shard (last stage).
        """
        model = self.model
        if self.pre_process:
            if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
                shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
                raise ValueError(f"MegatronTarget: the first stage needs input_ids [batch, seq_length], got {shape}.")
            batch, seq_length = input_ids.shape
            device = input_ids.device
            hidden = model.embedding(input_ids=input_ids, position_ids=None)  # [S, B, H]
        else:
            if not isinstance(input_tensor, torch.Tensor) or input_tensor.dim() != 3:
                shape = tuple(input_tensor.shape) if isinstance(input_tensor, torch.Tensor) else type(input_tensor).__name__
                raise ValueError(
                    f"MegatronTarget: a stage after the first needs input_tensor [S, B, H] from the previous stage, got {shape}."
                )
            seq_length, batch = input_tensor.shape[:2]
            device = input_tensor.device
            hidden = None
        rotary = self._rotary(seq_length, batch, position_ids, device)
        mask = self._attention_mask(attention_mask, batch, seq_length, device)
        self._captured = {}
        if not self.pre_process:
            model.decoder.set_input_tensor(input_tensor)
        try:
            out = model.decoder(hidden_states=hidden, attention_mask=mask, rotary_pos_emb=rotary)
            captured = self._captured
        finally:
            self._captured = None
            if not self.pre_process:
                model.decoder.set_input_tensor(None)
        result = MegatronTargetOutput(taps={i: captured[i] for i in self.owned_tap_ids})
        if self.post_process:
            result.final_hidden = out.transpose(0, 1).contiguous()
            if return_logits:
                result.logits = self.output_head.local_logits(result.final_hidden)
        else:
            result.output_tensor = out
        return result
