"""`KimiK3Body`: the Kimi K3 MLA draft's decoder stack, with `DFlashBody`'s interface.

The same contract as the Qwen3-style body (docs/design.md §2 Conventions, §3 Block attention):
the concatenated target taps become one context feature `c = hidden_norm(fc(concat_i tap_i))`
shared by every layer, and all slots of every block are updated at once, each block seeing the
target context strictly before its anchor and its own slots (bidirectionally), never another
block. The layers are Kimi K3's
full-attention layers (`layers.KimiK3DecoderLayer`); no rotary is applied, so positions play no
part. The body returns hidden states; the caller turns them into logits with the target's
output layer. It owns no embedding and no LM head.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from megatron.core.model_parallel_config import ModelParallelConfig
from torch import nn

from ..attention import BlockVisibility
from ..body import check_body_inputs, default_parallel_config
from ..norm import RMSNorm
from ..parallel import check_parallel_layout, tensor_parallel_group
from ..plan import DFlashBatchPlan
from .config import KimiK3DraftConfig
from .layers import KimiK3DecoderLayer

# One `(keys, values)` pair per layer, each `[B, S, Hl, D]` (`KimiK3Attention.context_key_value`).
ContextKV = Sequence[tuple[torch.Tensor, torch.Tensor]]


class KimiK3Body(nn.Module):
    """Kimi K3 MLA draft body: `forward(target_hidden, block_embeddings, plan) -> hidden states`.

    Args:
        config: the draft's `KimiK3DraftConfig`.
        parallel_config: megatron `ModelParallelConfig` used to build the parallel linears
            (`default_parallel_config()` when None). `sequence_parallel=True` and
            `context_parallel_size > 1` are refused.
        tp_group: tensor-parallel group; megatron's `parallel_state` group when None and
            initialised, a single rank otherwise. Its size must divide `num_attention_heads`
            and `intermediate_size`.
        attention_backend: "auto" (FlexAttention on CUDA, exact chunked kernel elsewhere),
            "chunked", "flex" or "dense" (the reference, for tests).
    """

    def __init__(
        self,
        config: KimiK3DraftConfig,
        parallel_config: Optional[ModelParallelConfig] = None,
        tp_group=None,
        attention_backend: str = "auto",
    ):
        super().__init__()
        if not isinstance(config, KimiK3DraftConfig):
            raise TypeError(f"KimiK3Body needs a KimiK3DraftConfig, got {type(config).__name__}.")
        parallel_config = parallel_config or default_parallel_config()
        check_parallel_layout(parallel_config.sequence_parallel, parallel_config.context_parallel_size)
        self.tp_group = tensor_parallel_group(tp_group)
        config.validate_tensor_parallel(self.tp_group.size())
        self.config = config
        self.attention_backend = attention_backend
        dtype = parallel_config.params_dtype
        H = config.hidden_size
        # fc and the norms are replicated: every rank needs the full context feature.
        self.fc = nn.Linear(config.num_taps * H, H, bias=False, dtype=dtype)
        nn.init.normal_(self.fc.weight, mean=0.0, std=config.initializer_range)
        self.hidden_norm = RMSNorm(H, config.rms_norm_eps, dtype=dtype)
        self.layers = nn.ModuleList(
            KimiK3DecoderLayer(config, i, parallel_config, self.tp_group) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(H, config.rms_norm_eps, dtype=dtype)

    # ------------------------------------------------------------------ checkpointing
    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None) -> dict:
        """Megatron `dist_checkpointing` view of the weights, keyed by the HF names (as
        `DFlashBody.sharded_state_dict`)."""
        if sharded_offsets:
            raise ValueError("KimiK3Body is not a pipeline-sharded module: sharded_offsets must be empty.")
        from ..checkpoint import sharded_state_dict  # checkpoint.py builds bodies: import lazily

        return sharded_state_dict(self, prefix)

    # ------------------------------------------------------------------ forward
    def context_feature(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """`target_hidden [B, S, taps * H]` -> the shared context feature `[B, S, H]`."""
        return self.hidden_norm(self.fc(target_hidden.to(self.fc.weight.dtype)))

    def context_key_values(self, target_hidden: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's context keys and values of `target_hidden [B, S, taps * H]`:
        `[(keys, values) [B, S, Hl, D]]`, one pair per layer.

        Without rotary they depend on each position's taps only, so a decoder computes them once
        per committed position and caches them (`blocks_from_cache`)."""
        context = self.context_feature(target_hidden)
        return [layer.self_attn.context_key_value(context) for layer in self.layers]

    def blocks_from_cache(
        self,
        block_embeddings: torch.Tensor,
        context_kv: ContextKV,
        visibility: BlockVisibility,
        attention_backend: Optional[str] = None,
    ) -> torch.Tensor:
        """The layers and the final norm over cached context keys/values.

        Args:
            block_embeddings: `[B, N, W, H]`.
            context_kv: per layer `(keys, values)` `[B, S, Hl, D]` (`context_key_values`).
            visibility: which cached positions and slots each block sees (in-block direction
                is the config's, i.e. bidirectional).
            attention_backend: `block_attention` backend; the body's own when None.

        Returns:
            `[B, N, W, H]` after the final norm (not zeroed at invalid blocks).
        """
        if len(context_kv) != len(self.layers):
            raise ValueError(f"context_kv has {len(context_kv)} layers, the draft {len(self.layers)}.")
        backend = attention_backend or self.attention_backend
        hidden = block_embeddings.to(self.fc.weight.dtype)
        for layer, kv in zip(self.layers, context_kv):
            hidden = layer(hidden, None, visibility, backend, context_kv=kv)
        return self.norm(hidden)

    def forward(
        self,
        target_hidden: torch.Tensor,
        block_embeddings: torch.Tensor,
        plan: DFlashBatchPlan,
        position_ids: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Draft hidden states for every block slot.

        Args:
            target_hidden: `[B, S, taps * H]`, the target's chosen layer outputs
                concatenated in `target_layer_ids` order.
            block_embeddings: `[B, N, W, H]`, the target's input embedding of
                `[anchor, MASK, ...]` per block (times `input_embedding_scale`).
            plan: the `DFlashBatchPlan` of this batch.
            position_ids: accepted for call compatibility and ignored: the draft has no rotary
                embedding (the plan's positions are not used either).

        Returns:
            `[B, N, W, H]` after the final norm; exactly zero at invalid blocks (all slots of a
            valid block are returned, supervised or not, as `DFlashBody.forward`).
        """
        del position_ids
        check_body_inputs(self.config, self.tp_group, target_hidden, block_embeddings, plan)
        plan = plan.to(target_hidden.device)
        context = self.context_feature(target_hidden)
        hidden = block_embeddings.to(self.fc.weight.dtype)
        for i, layer in enumerate(self.layers):
            causal, window = self.config.layer_attention(i)
            visibility = BlockVisibility.from_plan(plan, causal=causal, sliding_window=window)
            hidden = layer(hidden, context, visibility, self.attention_backend)
        valid = plan.block_valid[:, :, None, None]
        return torch.where(valid, self.norm(hidden), torch.zeros((), dtype=hidden.dtype, device=hidden.device))
