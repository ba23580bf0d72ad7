"""The Kimi K3 draft's decoder layer: pre-norm MLA over [context | own block], pre-norm SiTU MLP.

`gate_proj` / `up_proj` are column-parallel and `down_proj` row-parallel, like the Qwen3-style
draft's SwiGLU (`draft.layers.DFlashMLP`); SiTU is elementwise, so it runs on each rank's channels.
A layer costs two all-reduces in forward and two in backward.
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.model_parallel_config import ModelParallelConfig
from torch import nn

from ..attention import BlockVisibility
from ..kv_cache import DraftKVCache
from ..layers import DFlashMLP
from ..norm import RMSNorm
from .attention import KimiK3Attention
from .config import KimiK3DraftConfig
from .situ import situ_and_mul


class KimiK3MLP(DFlashMLP):
    """`down(situ(gate(x)) * bounded(up(x)))` (see `situ.situ_and_mul`): the SwiGLU MLP's projections
    and tensor-parallel split, K3's activation."""

    def __init__(self, config: KimiK3DraftConfig, parallel_config: ModelParallelConfig, tp_group):
        super().__init__(config, parallel_config, tp_group)
        # K3 reads a missing (or zero) gate bound as 1.
        self.beta = float(config.activation_situ_beta or 1.0)
        linear_beta = config.activation_situ_linear_beta
        self.linear_beta = None if linear_beta is None else float(linear_beta)

    def activation(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return situ_and_mul(gate, up, self.beta, self.linear_beta)


class KimiK3DecoderLayer(nn.Module):
    """Pre-norm residual layer. The context feature is not normed here: it is shared by every
    layer and was normed once by the body's `hidden_norm`."""

    def __init__(self, config: KimiK3DraftConfig, layer_idx: int, parallel_config: ModelParallelConfig, tp_group):
        super().__init__()
        dtype = parallel_config.params_dtype
        self.self_attn = KimiK3Attention(config, layer_idx, parallel_config, tp_group)
        self.mlp = KimiK3MLP(config, parallel_config, tp_group)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)

    def forward(
        self,
        hidden: torch.Tensor,
        context: torch.Tensor,
        visibility: BlockVisibility,
        attention_backend: str = "auto",
        kv_cache: Optional[DraftKVCache] = None,
    ) -> torch.Tensor:
        """`hidden [B, N, W, H]`, `context [B, S, H]` -> `[B, N, W, H]`; `kv_cache` as in `KimiK3Attention`."""
        hidden = hidden + self.self_attn(
            self.input_layernorm(hidden), context, visibility, attention_backend, kv_cache
        )
        return hidden + self.mlp(self.post_attention_layernorm(hidden))
