"""`KimiK3Body`: the Kimi K3 MLA draft's decoder stack, on the shared `draft.body.DraftBody` skeleton.

The same contract as the Qwen3-style body (docs/design.md §2 Conventions, §3 Block attention):
the concatenated target taps become one context feature `c = hidden_norm(fc(concat_i tap_i))`
shared by every layer, and all slots of every block are updated at once, each block seeing the
target context strictly before its anchor and its own slots (bidirectionally), never another
block. The family supplies only its layers: Kimi K3's full-attention layers
(`layers.KimiK3DecoderLayer`); no rotary is applied, so positions play no part and its layers
take no per-forward inputs besides the context. The body returns hidden states; the caller turns
them into logits with the target's output layer. It owns no embedding and no LM head.
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.model_parallel_config import ModelParallelConfig

from ...plan.batch_plan import DFlashBatchPlan
from ..body import DraftBody
from ..kv_cache import DraftKVCache
from .config import KimiK3DraftConfig
from .layers import KimiK3DecoderLayer


class KimiK3Body(DraftBody):
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
        if not isinstance(config, KimiK3DraftConfig):
            raise TypeError(f"KimiK3Body needs a KimiK3DraftConfig, got {type(config).__name__}.")
        super().__init__(
            config, parallel_config, tp_group, attention_backend,
            make_layer=lambda i, parallel, group: KimiK3DecoderLayer(config, i, parallel, group),
        )

    def forward(
        self,
        target_hidden: torch.Tensor,
        block_embeddings: torch.Tensor,
        plan: DFlashBatchPlan,
        kv_cache: Optional[DraftKVCache] = None,
        attention_backend: Optional[str] = None,
        position_ids: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """`DraftBody.forward`; `position_ids` is accepted for call compatibility and ignored: the
        draft has no rotary embedding (the plan's positions are not used either).

        Returns:
            `[B, N, W, H]` after the final norm; exactly zero at invalid blocks.
        """
        del position_ids
        return super().forward(target_hidden, block_embeddings, plan, kv_cache, attention_backend)
