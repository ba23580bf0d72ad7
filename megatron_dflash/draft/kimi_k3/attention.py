"""Kimi K3 multi-latent attention (MLA) of the draft, tensor-parallel over heads, without RoPE.

Queries come from the block slots only: `q_b_proj(q_a_layernorm(q_a_proj(x)))` (or `q_proj(x)`
when `q_lora_rank` is None), `Hq` heads of `qk_nope_head_dim + qk_rope_head_dim` channels.
Keys and values of a token `t` (a block slot, or a position of the shared context feature)
come from its compressed latent `kv_a_proj_with_mqa(t) = [latent | shared]`:
`kv_b_proj(kv_a_layernorm(latent))` gives every head its `qk_nope_head_dim` key channels and
its `v_head_dim` value channels, and the `qk_rope_head_dim` slice `shared` is appended to
every head's key as is (NoPE: no rotary anywhere, so positions never enter the draft).

After that expansion MLA is plain multi-head attention with one K/V head per query head, so it
runs through the project's block-attention kernels (`draft.attention.block_attention`). Those take
one head dim for queries, keys and values: the smaller of the two is zero-padded to the larger
(zeros add nothing to a dot product and produce zero output channels, which are dropped), so
the result is exact; it costs `max(Dqk, Dv) / Dv` more value work.

Tensor parallelism: `q_b_proj` / `q_proj`, `kv_b_proj` and the output gate `g_proj` are
column-parallel (each rank owns `Hq / TP` heads), `o_proj` row-parallel; the low-rank A
projections and their norms are replicated (every rank needs the whole latent). Their
gradients come out whole on every rank: megatron's column-parallel layers all-reduce the
gradient of their input, and the head-shared key slice, which each rank uses for its own heads
only, has its gradient summed over the group here.

Shapes: B batch, S context length, N blocks, W block size, H hidden, Hl = Hq / TP local heads,
Dqk = qk_nope_head_dim + qk_rope_head_dim, Dv = v_head_dim, D = max(Dqk, Dv).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.model_parallel_config import ModelParallelConfig
from torch import nn

from ...common.parallel import reduce_grad_over_group
from ..attention import BlockVisibility, block_attention
from ..kv_cache import DraftKVCache
from ..layers import column_parallel, row_parallel
from ..norm import RMSNorm
from .config import KimiK3DraftConfig

# K3 builds its latent norms (`q_a_layernorm`, `kv_a_layernorm`) with the RMSNorm default
# epsilon, not `rms_norm_eps`; the draft must do the same to compute what the target's layers do.
LATENT_NORM_EPS = 1e-6


def replicated_linear(in_features: int, out_features: int, *, dtype: torch.dtype, std: float) -> nn.Linear:
    """A bias-free linear that every tensor-parallel rank holds whole."""
    layer = nn.Linear(in_features, out_features, bias=False, dtype=dtype)
    nn.init.normal_(layer.weight, mean=0.0, std=std)
    return layer


def _pad_head_dim(x: torch.Tensor, size: int) -> torch.Tensor:
    return x if x.shape[-1] == size else F.pad(x, (0, size - x.shape[-1]))


class KimiK3Attention(nn.Module):
    """MLA over [the context before the block's anchor | the block's own slots] (module docstring)."""

    def __init__(self, config: KimiK3DraftConfig, layer_idx: int, parallel_config: ModelParallelConfig, tp_group):
        super().__init__()
        tp = tp_group.size()
        self.layer_idx = layer_idx
        self.tp_group = tp_group
        self.num_heads = config.num_attention_heads // tp
        self.num_kv_heads = self.num_heads  # one K/V head per query head once the latent is expanded
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.q_head_dim = config.q_head_dim
        self.head_dim = max(self.q_head_dim, self.v_head_dim)  # what the kernel sees
        self.scale = self.q_head_dim**-0.5
        H, Hq, std = config.hidden_size, config.num_attention_heads, config.initializer_range
        dtype = parallel_config.params_dtype
        common = dict(bias=False, parallel_config=parallel_config, tp_group=tp_group, std=std)
        if self.q_lora_rank is not None:
            self.q_a_proj = replicated_linear(H, self.q_lora_rank, dtype=dtype, std=std)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS, dtype=dtype)
            self.q_b_proj = column_parallel(self.q_lora_rank, Hq * self.q_head_dim, **common)
        else:
            self.q_proj = column_parallel(H, Hq * self.q_head_dim, **common)
        self.kv_a_proj_with_mqa = replicated_linear(H, self.kv_lora_rank + self.qk_rope_head_dim, dtype=dtype, std=std)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS, dtype=dtype)
        self.kv_b_proj = column_parallel(self.kv_lora_rank, Hq * (self.qk_nope_head_dim + self.v_head_dim), **common)
        self.o_proj = row_parallel(Hq * self.v_head_dim, H, **common)
        self.use_output_gate = config.mla_use_output_gate
        if self.use_output_gate:
            self.g_proj = column_parallel(H, Hq * self.v_head_dim, **common)

    # ------------------------------------------------------------------ projections
    def query(self, x: torch.Tensor) -> torch.Tensor:
        """`x [..., H]` -> queries `[..., Hl, D]` (zero-padded past Dqk)."""
        if self.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))[0]
        else:
            q = self.q_proj(x)[0]
        return _pad_head_dim(q.view(*x.shape[:-1], self.num_heads, self.q_head_dim), self.head_dim)

    def key_value(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`x [..., H]` -> (keys, values) `[..., Hl, D]` of these tokens, zero-padded to D.

        Keys are `[kv_b nope part | head-shared slice]`; no rotary, so they do not depend on
        the tokens' positions and a decoder may cache them by position as they are.
        """
        leading = x.shape[:-1]
        latent, shared = torch.split(
            self.kv_a_proj_with_mqa(x), [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1
        )
        key_value = self.kv_b_proj(self.kv_a_layernorm(latent))[0]
        key_value = key_value.view(*leading, self.num_heads, self.qk_nope_head_dim + self.v_head_dim)
        key_nope, value = torch.split(key_value, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        # Each rank uses the shared slice for its own heads only: its gradient is a partial sum.
        shared = reduce_grad_over_group(shared, self.tp_group)
        shared = shared.unsqueeze(-2).expand(*leading, self.num_heads, self.qk_rope_head_dim)
        key = torch.cat([key_nope, shared], dim=-1)
        return _pad_head_dim(key, self.head_dim), _pad_head_dim(value, self.head_dim)

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        hidden: torch.Tensor,
        context: Optional[torch.Tensor],
        visibility: BlockVisibility,
        attention_backend: str = "auto",
        kv_cache: Optional[DraftKVCache] = None,
    ) -> torch.Tensor:
        """`hidden [B, N, W, H]`, `context [B, S, H]` -> `[B, N, W, H]`.

        Without `kv_cache` the blocks attend over the keys/values of `context` (training). With a
        prepared `kv_cache` (decoding), `context` is the context committed since the last forward:
        its keys/values (`[B, S, Hl, D]`, expanded and padded; no position enters them) are written
        into the cache and the blocks attend over the cache, as in `draft.layers.DFlashAttention`.
        """
        B, N, W, _ = hidden.shape
        context_key, context_value = self.key_value(context)
        if kv_cache is not None:
            context_key, context_value = kv_cache.update(self.layer_idx, context_key, context_value)
        query = self.query(hidden)
        block_key, block_value = self.key_value(hidden)
        out = block_attention(
            query, context_key, context_value, block_key, block_value, visibility,
            scale=self.scale, backend=attention_backend,
        )
        out = out[..., : self.v_head_dim].reshape(B, N, W, self.num_heads * self.v_head_dim)
        if self.use_output_gate:
            out = out * torch.sigmoid(self.g_proj(hidden)[0])
        return self.o_proj(out)[0]
