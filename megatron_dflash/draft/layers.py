"""Tensor-parallel DFlash decoder layer: attention over [target prefix | own block], SwiGLU MLP.

Projections are megatron-core layers: q/k/v and gate/up are `ColumnParallelLinear`
(each rank holds `heads / TP` heads and `intermediate / TP` channels), o and down are
`RowParallelLinear` (their partial sums are all-reduced). Everything between the two is
local to a rank, so a layer costs two all-reduces in forward and two in backward.

Shapes: B batch, S context length, N blocks, W block size, H hidden, D head_dim,
Hq / Hkv the rank-local query / KV heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    set_tensor_model_parallel_attributes,
)
from torch import nn

from ..common.parallel import reduce_grad_over_group
from .attention import BlockVisibility, block_attention
from .config import DFlashConfig
from .gated_mlp import gated_mlp, swiglu
from .kv_cache import DraftKVCache
from .norm import RMSNorm
from .rope import apply_rope


def _init_method(std: float):
    def init_(weight: torch.Tensor) -> torch.Tensor:
        return nn.init.normal_(weight, mean=0.0, std=std)

    return init_


class _SingleRankSafe:
    """Mixin: a one-rank group runs the plain linear.

    The group is given to megatron's constructor (`tp_group=`), which keeps it whenever
    `torch.distributed` is initialised; without `torch.distributed` megatron 0.16 stores None
    instead (`get_tensor_model_parallel_group_if_none`) and its region helpers would assert in
    forward/backward. With one rank there is nothing to communicate, so the layer is just `F.linear`.
    """

    def forward(self, input_, *args, **kwargs):
        if self.tp_group is None or self.tp_group.size() == 1:
            return F.linear(input_, self.weight, self.bias), None
        # Megatron's weight-gradient path only flattens 3-D inputs; ours are
        # [B, N, W, H] blocks, so fold the leading dimensions into one.
        leading = input_.shape[:-1]
        output, bias = super().forward(input_.reshape(1, -1, input_.shape[-1]), *args, **kwargs)
        return output.reshape(*leading, output.shape[-1]), bias


class _ColumnParallelLinear(_SingleRankSafe, ColumnParallelLinear):
    pass


class _RowParallelLinear(_SingleRankSafe, RowParallelLinear):
    pass


def column_parallel(in_features, out_features, *, bias, parallel_config, tp_group, std):
    layer = _ColumnParallelLinear(
        in_features,
        out_features,
        config=parallel_config,
        init_method=_init_method(std),
        bias=bias,
        gather_output=False,
        tp_group=tp_group,
    )
    _mark_partitioned(layer, weight_dim=0, bias_partitioned=True)
    return layer


def row_parallel(in_features, out_features, *, bias, parallel_config, tp_group, std):
    layer = _RowParallelLinear(
        in_features,
        out_features,
        config=parallel_config,
        init_method=_init_method(std),
        bias=bias,
        input_is_parallel=True,
        skip_bias_add=False,
        tp_group=tp_group,
    )
    _mark_partitioned(layer, weight_dim=1, bias_partitioned=False)
    return layer


def _mark_partitioned(layer: nn.Module, *, weight_dim: int, bias_partitioned: bool) -> None:
    """Mark split parameters the way megatron's optimizer and grad-norm code expect.

    Megatron sets these attributes only when it initialises the weights itself; a body
    built with `perform_initialization=False` (to load a checkpoint) would otherwise look
    replicated, and its grad norm would drop the shards of ranks > 0.
    """
    marked = [(layer.weight, weight_dim)]
    if layer.bias is not None and bias_partitioned:
        marked.append((layer.bias, 0))
    for param, dim in marked:
        if not hasattr(param, "tensor_model_parallel"):
            set_tensor_model_parallel_attributes(param, True, dim, 1)


class DFlashAttention(nn.Module):
    """Queries from the block slots; keys/values from the context feature and the block.

    Context keys use the same `k_proj`/`v_proj` as block keys (as in the published
    drafters); q/k get a per-head RMSNorm, then RoPE at their own positions. Decoding passes a
    `DraftKVCache`: the context keys/values computed here are those of the newly committed
    context only, written into the cache, and the blocks attend over the cache (docs/design.md
    §3 Block attention).
    """

    def __init__(self, config: DFlashConfig, layer_idx: int, parallel_config: ModelParallelConfig, tp_group):
        super().__init__()
        tp = tp_group.size()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads // tp
        self.num_kv_heads = config.num_key_value_heads // tp
        self.causal, self.sliding_window = config.layer_attention(layer_idx)
        self.tp_group = tp_group
        H, D, std = config.hidden_size, config.head_dim, config.initializer_range
        common = dict(bias=config.attention_bias, parallel_config=parallel_config, tp_group=tp_group, std=std)
        self.q_proj = column_parallel(H, config.num_attention_heads * D, **common)
        self.k_proj = column_parallel(H, config.num_key_value_heads * D, **common)
        self.v_proj = column_parallel(H, config.num_key_value_heads * D, **common)
        self.o_proj = row_parallel(config.num_attention_heads * D, H, **common)
        self.q_norm = RMSNorm(D, config.rms_norm_eps, dtype=parallel_config.params_dtype)
        self.k_norm = RMSNorm(D, config.rms_norm_eps, dtype=parallel_config.params_dtype)

    def forward(
        self,
        hidden: torch.Tensor,
        context: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        visibility: BlockVisibility,
        attention_backend: str = "auto",
        kv_cache: Optional[DraftKVCache] = None,
    ) -> torch.Tensor:
        """`hidden [B, N, W, H]`, `context [B, S, H]` -> `[B, N, W, H]`.

        `rope` = (cos_block, sin_block `[B, N, W, D]`, cos_context, sin_context `[B, S, D]`).
        Without `kv_cache` the blocks attend over the keys/values of `context` (training). With a
        prepared `kv_cache` (decoding), `context` is the context committed since the last forward:
        its keys/values are written into the cache and the blocks attend over the cache.
        """
        B, N, W, _ = hidden.shape
        S = context.shape[1]
        D = self.head_dim
        cos_block, sin_block, cos_ctx, sin_ctx = rope
        q_norm_w = reduce_grad_over_group(self.q_norm.weight, self.tp_group)
        k_norm_w = reduce_grad_over_group(self.k_norm.weight, self.tp_group)

        q = self.q_proj(hidden)[0].view(B, N, W, self.num_heads, D)
        q = apply_rope(self.q_norm(q, q_norm_w), cos_block, sin_block)
        k_blk = self.k_proj(hidden)[0].view(B, N, W, self.num_kv_heads, D)
        k_blk = apply_rope(self.k_norm(k_blk, k_norm_w), cos_block, sin_block)
        v_blk = self.v_proj(hidden)[0].view(B, N, W, self.num_kv_heads, D)
        k_ctx = self.k_proj(context)[0].view(B, S, self.num_kv_heads, D)
        k_ctx = apply_rope(self.k_norm(k_ctx, k_norm_w), cos_ctx, sin_ctx)
        v_ctx = self.v_proj(context)[0].view(B, S, self.num_kv_heads, D)
        if kv_cache is not None:
            k_ctx, v_ctx = kv_cache.update(self.layer_idx, k_ctx, v_ctx)

        out = block_attention(
            q, k_ctx, v_ctx, k_blk, v_blk, visibility, scale=D**-0.5, backend=attention_backend
        )
        return self.o_proj(out.reshape(B, N, W, self.num_heads * D))[0]


class DFlashMLP(nn.Module):
    """SwiGLU: `down(silu(gate(x)) * up(x))`, gate/up column-parallel, down row-parallel.

    The projections are megatron-core layers (weights, initialisation, tensor-parallel split);
    forward runs them through `gated_mlp`, which keeps only `x` and the gate/up outputs for
    backward (see that module). A family with another gated activation overrides `activation`.
    """

    def __init__(self, config: DFlashConfig, parallel_config: ModelParallelConfig, tp_group):
        super().__init__()
        H, I, std = config.hidden_size, config.intermediate_size, config.initializer_range
        common = dict(bias=False, parallel_config=parallel_config, tp_group=tp_group, std=std)
        self.gate_proj = column_parallel(H, I, **common)
        self.up_proj = column_parallel(H, I, **common)
        self.down_proj = row_parallel(I, H, **common)

    def activation(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """Elementwise `(gate, up) [rows, I_local] -> [rows, I_local]`."""
        return swiglu(gate, up)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x [..., H]` -> `[..., H]`."""
        return gated_mlp(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight, self.activation,
                         self.gate_proj.tp_group)


# Builds one optional sublayer: `(config, dtype) -> nn.Module`.
SublayerBuilder = Callable[[DFlashConfig, torch.dtype], nn.Module]


@dataclass(frozen=True)
class DFlashLayerSubmodules:
    """The optional sublayers of a `DFlashDecoderLayer`, asked for at construction.

    In the spirit of megatron-core's `ModuleSpec` / `TransformerLayerSubmodules`: each field is a
    builder `(config, dtype) -> nn.Module`, or None for the identity (the plain DFlash layer). A
    variant that needs more inside its layers passes its builders to the body
    (`DFlashBody(..., layer_submodules=...)`), e.g. DFlash 2's in-block convolutions.

    Fields:
        attention_conv: wraps the attention sublayer. The module has
            `prepare(x [B, N, W, H]) -> (x', coefficients)`, applied before the sublayer, and
            `finish(y, coefficients) -> y'`, applied after it.
        mlp_conv: the same around the MLP.
    """

    attention_conv: Optional[SublayerBuilder] = None
    mlp_conv: Optional[SublayerBuilder] = None


class DFlashDecoderLayer(nn.Module):
    """Pre-norm residual layer. The context feature is not normed here: it is shared by
    every layer and was normed once by the body's `hidden_norm`.

    `submodules` adds the optional sublayers around attention and MLP (`DFlashLayerSubmodules`;
    identity by default). They are registered after the norms, so the parameter order is
    backbone first, then the variant's additions.
    """

    def __init__(
        self,
        config: DFlashConfig,
        layer_idx: int,
        parallel_config: ModelParallelConfig,
        tp_group,
        submodules: DFlashLayerSubmodules = DFlashLayerSubmodules(),
    ):
        super().__init__()
        dtype = parallel_config.params_dtype
        self.self_attn = DFlashAttention(config, layer_idx, parallel_config, tp_group)
        self.mlp = DFlashMLP(config, parallel_config, tp_group)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.attention_conv = _build(submodules.attention_conv, config, dtype)
        self.mlp_conv = _build(submodules.mlp_conv, config, dtype)

    def forward(
        self,
        hidden,
        context,
        rope,
        visibility: BlockVisibility,
        attention_backend: str = "auto",
        kv_cache: Optional[DraftKVCache] = None,
    ):
        """`hidden [B, N, W, H]`, `context [B, S, H]` -> `[B, N, W, H]`; `kv_cache` as in `DFlashAttention`."""
        hidden = hidden + _around(
            self.attention_conv,
            lambda x: self.self_attn(x, context, rope, visibility, attention_backend, kv_cache),
            self.input_layernorm(hidden),
        )
        return hidden + _around(self.mlp_conv, self.mlp, self.post_attention_layernorm(hidden))


def _build(builder: Optional[SublayerBuilder], config: DFlashConfig, dtype: torch.dtype) -> Optional[nn.Module]:
    return None if builder is None else builder(config, dtype)


def _around(conv: Optional[nn.Module], sublayer, x: torch.Tensor) -> torch.Tensor:
    """`sublayer(x)`, wrapped in `conv`'s prepare/finish when the layer has one."""
    if conv is None:
        return sublayer(x)
    x, coefficients = conv.prepare(x)
    return conv.finish(sublayer(x), coefficients)
