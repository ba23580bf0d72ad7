"""`DraftBody` and `DFlashBody`: the draft's decoder stack over the target context and the draft blocks.

`DraftBody` is the skeleton every draft family shares (context feature, layer loop, final norm,
input checks, checkpoint view); a family supplies its decoder layers and what they take per
forward: `DFlashBody` the Qwen3-style layers and their RoPE tables, `kimi_k3.KimiK3Body` K3's MLA
layers (docs/design.md §16 Kimi K3 draft family). The body turns the concatenated target taps into one context feature
`c = hidden_norm(fc(concat_i tap_i))`, shared by every layer, and updates all slots of
every block at once. Each block sees the target prefix strictly before its anchor (its
own document, its own window) and the slots of its own block, never another block. The
body returns hidden states; the caller turns them into logits with the target's output
layer. It owns no embedding and, unless it has a reduced draft vocabulary (its own head over K target rows,
`draft.draft_vocab.DraftLMHead`, docs/design.md §20 Reduced draft vocabulary), no LM head.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from megatron.core.model_parallel_config import ModelParallelConfig
from torch import nn

from ..common.parallel import agree_or_raise, check_parallel_layout, tensor_parallel_group
from ..plan.batch_plan import DFlashBatchPlan
from .attention import BlockVisibility
from .config import DFlashConfig
from .draft_vocab import DraftLMHead
from .kv_cache import DraftKVCache
from .layers import DFlashDecoderLayer, DFlashLayerSubmodules
from .norm import RMSNorm
from .rope import rope_cos_sin, rope_inv_freq
from .sharding import sharded_state_dict


def default_parallel_config(**overrides) -> ModelParallelConfig:
    """A megatron `ModelParallelConfig` for the body built outside a Megatron launch.

    `use_cpu_initialization=True` initialises each full weight on the CPU with one RNG
    stream and then slices it, so the weights do not depend on the TP size.
    """
    kwargs = dict(use_cpu_initialization=True, perform_initialization=True, params_dtype=torch.float32)
    kwargs.update(overrides)
    return ModelParallelConfig(**kwargs)


def body_input_error(cfg, target_hidden, block_embeddings, plan) -> Optional[str]:
    """Why a draft body of config `cfg` cannot take these inputs (None when it can).

    Shared by every draft family: `cfg` needs `hidden_size`, `block_size`, `num_taps` and
    `target_layer_ids`."""
    if not isinstance(plan, DFlashBatchPlan):
        return f"plan must be a DFlashBatchPlan, got {type(plan).__name__}"
    if target_hidden.dim() != 3:
        return f"target_hidden must be [batch, seq, taps*hidden], got shape {tuple(target_hidden.shape)}"
    if block_embeddings.dim() != 4:
        return (
            "block_embeddings must be [batch, blocks, block_size, hidden], got shape "
            f"{tuple(block_embeddings.shape)}"
        )
    B, S, F = target_hidden.shape
    if F != cfg.num_taps * cfg.hidden_size:
        return (
            f"target_hidden has {F} features but the draft expects {cfg.num_taps} taps x "
            f"{cfg.hidden_size} = {cfg.num_taps * cfg.hidden_size} (target_layer_ids="
            f"{cfg.target_layer_ids})"
        )
    expected = (B, plan.num_blocks, cfg.block_size, cfg.hidden_size)
    if tuple(block_embeddings.shape) != expected:
        return f"block_embeddings has shape {tuple(block_embeddings.shape)}, expected {expected} from the plan and config"
    if plan.block_size != cfg.block_size:
        return f"plan.block_size={plan.block_size} but config.block_size={cfg.block_size}"
    if tuple(plan.anchor_positions.shape[:1]) != (B,) or plan.seq_length != S:
        return (
            f"plan is for batch {plan.batch_size} x seq {plan.seq_length} but target_hidden is "
            f"[{B}, {S}, ...]"
        )
    return None


def check_body_inputs(cfg, tp_group, target_hidden, block_embeddings, plan) -> None:
    """Raise the same `ValueError` on every rank of `tp_group` if any rank's inputs are bad."""
    error = body_input_error(cfg, target_hidden, block_embeddings, plan)
    signature = [target_hidden.dim(), *target_hidden.shape, block_embeddings.dim(), *block_embeddings.shape]
    agree_or_raise(error, signature, tp_group, target_hidden.device)


class DraftBody(nn.Module):
    """The decoder-stack skeleton every draft family shares: `forward(target_hidden, block_embeddings, plan)`.

    The concatenated target taps become one context feature `c = hidden_norm(fc(concat_i tap_i))`
    (`fc` and the norms replicated: every rank needs the full feature), shared by every layer; the
    family's decoder layers update all slots of every block at once; the final norm closes the stack.
    A family supplies its layers through `make_layer(layer_idx, parallel_config, tp_group)` and the
    per-forward inputs its layers take between the context and the visibility (`layer_inputs`: the
    RoPE tables of a rotary family, nothing for a NoPE one). Its config supplies `hidden_size`,
    `num_taps`, `num_hidden_layers`, `rms_norm_eps`, `initializer_range`,
    `validate_tensor_parallel(tp)` and `layer_attention(layer_idx)`.

    Args:
        config: the family's draft config.
        parallel_config: megatron `ModelParallelConfig` used to build the parallel linears
            (`default_parallel_config()` when None). `sequence_parallel=True` and
            `context_parallel_size > 1` are refused.
        tp_group: tensor-parallel group; megatron's `parallel_state` group when None and
            initialised, a single rank otherwise.
        attention_backend: "auto" (FlexAttention on CUDA, exact chunked kernel elsewhere),
            "chunked", "flex" or "dense" (the reference, for tests).
        make_layer: `(layer_idx, parallel_config, tp_group) -> decoder layer`, called for each layer
            in order (the weights' initialisation order, hence the weights of a seed, is fixed here).
    """

    def __init__(
        self,
        config,
        parallel_config: Optional[ModelParallelConfig],
        tp_group,
        attention_backend: str,
        make_layer: Callable[[int, ModelParallelConfig, object], nn.Module],
    ):
        super().__init__()
        parallel_config = parallel_config or default_parallel_config()
        check_parallel_layout(parallel_config.sequence_parallel, parallel_config.context_parallel_size)
        self.tp_group = tensor_parallel_group(tp_group)
        config.validate_tensor_parallel(self.tp_group.size())
        self.config = config
        self.attention_backend = attention_backend
        dtype = parallel_config.params_dtype
        H = config.hidden_size
        self.fc = nn.Linear(config.num_taps * H, H, bias=False, dtype=dtype)
        nn.init.normal_(self.fc.weight, mean=0.0, std=config.initializer_range)
        self.hidden_norm = RMSNorm(H, config.rms_norm_eps, dtype=dtype)
        self.layers = nn.ModuleList(
            make_layer(i, parallel_config, self.tp_group) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(H, config.rms_norm_eps, dtype=dtype)
        K = getattr(config, "draft_vocab_size", None)
        if K is not None:  # a reduced draft vocabulary (docs/design.md §20 Reduced draft vocabulary)
            self.lm_head = DraftLMHead(K, H, tp_group=self.tp_group, dtype=dtype)
            # the serving layout's offsets (target id = draft id + d2t[draft id]); set with the head's rows
            self.register_buffer("d2t", torch.zeros(K, dtype=torch.int64))

    # ------------------------------------------------------------------ validation
    def _validate(self, target_hidden, block_embeddings, plan) -> None:
        check_body_inputs(self.config, self.tp_group, target_hidden, block_embeddings, plan)

    # ------------------------------------------------------------------ checkpointing
    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None) -> dict:
        """Megatron `dist_checkpointing` view of the weights, keyed by the HF names.

        Load the result of `checkpoint.torch_dist_load.load` (megatron's `dist_checkpointing.load`, restricted) with
        `draft.sharding.load_sharded_state_dict_into(body, loaded, prefix)`.
        """
        if sharded_offsets:
            raise ValueError(f"{type(self).__name__} is not a pipeline-sharded module: sharded_offsets must be empty.")
        return sharded_state_dict(self, prefix)

    # ------------------------------------------------------------------ forward
    def context_feature(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """`target_hidden [B, S, taps * H]` -> the shared context feature `[B, S, H]`."""
        return self.hidden_norm(self.fc(target_hidden.to(self.fc.weight.dtype)))

    def layer_inputs(self, plan: DFlashBatchPlan, device) -> tuple:
        """What every layer of this forward takes between the context and the visibility (none here)."""
        return ()

    def forward(
        self,
        target_hidden: torch.Tensor,
        block_embeddings: torch.Tensor,
        plan: DFlashBatchPlan,
        kv_cache: Optional[DraftKVCache] = None,
        attention_backend: Optional[str] = None,
    ) -> torch.Tensor:
        """Draft hidden states for every block slot.

        Args:
            target_hidden: `[B, S, taps * H]`, the target's chosen layer outputs
                concatenated in `target_layer_ids` order.
            block_embeddings: `[B, N, W, H]`, the target's input embedding of
                `[anchor, MASK, ...]` per block (times `input_embedding_scale`).
            plan: the `DFlashBatchPlan` of this batch.
            kv_cache: decoding: the `DraftKVCache` of the context committed so far. `target_hidden`
                is then only the context committed since the last forward; sequence indices are
                positions (context row `j` is cached at `plan.context_position_ids[b, j]`, a block
                sees the cached positions `[context_start, anchor)`). Each layer writes the new
                context's keys/values into the cache and attends over the cache
                (`DFlashBatchPlan.for_decoding` builds such a plan). None: training, the whole context.
            attention_backend: overrides the body's `attention_backend` for this call.

        Returns:
            `[B, N, W, H]` after the final norm; exactly zero at invalid blocks. The slots of a
            valid block are all returned, supervised or not (not zeroed outside `plan.loss_mask`):
            they are the draft's predictions, which do not depend on the supervision, and some
            consumers read unsupervised ones. Domino with `shift_label` trains slot `k` on the token
            at `p + 1 + k` (slot 0 included), supervised by `input_mask[p + 1 + k]`, not by
            `plan.loss_mask[k]`; the DFlash 2 greedy walk picks each slot's token after the previous
            slot's pick, supervised or not, as decoding does. The losses select supervised slots
            (`torch.where`, not a product), so an unsupervised slot's value never reaches a loss or
            a gradient.
        """
        self._validate(target_hidden, block_embeddings, plan)
        plan = plan.to(target_hidden.device)
        if kv_cache is not None:
            if kv_cache.num_layers != len(self.layers):
                raise ValueError(
                    f"the KV cache holds {kv_cache.num_layers} layers but the draft has {len(self.layers)}; "
                    "build it with DraftKVCache(draft, ...) for this draft."
                )
            kv_cache.prepare(plan)
        backend = attention_backend or self.attention_backend
        context = self.context_feature(target_hidden)
        inputs = self.layer_inputs(plan, target_hidden.device)
        hidden = block_embeddings.to(self.fc.weight.dtype)
        for layer in self.layers:
            causal, window = self.config.layer_attention(layer.self_attn.layer_idx)
            visibility = BlockVisibility.from_plan(plan, causal=causal, sliding_window=window)
            hidden = layer(hidden, context, *inputs, visibility, backend, kv_cache)
        valid = plan.block_valid[:, :, None, None]
        return torch.where(valid, self.norm(hidden), torch.zeros((), dtype=hidden.dtype, device=hidden.device))


class DFlashBody(DraftBody):
    """DFlash draft body (the Qwen3-style family): `forward(target_hidden, block_embeddings, plan) -> hidden states`.

    `DraftBody` with Qwen3-style decoder layers (`draft.layers.DFlashDecoderLayer`: RoPE'd GQA block
    attention, SwiGLU MLP); its layers take the RoPE tables of the plan's positions.

    Args:
        config: the draft's `DFlashConfig`.
        parallel_config, tp_group, attention_backend: as `DraftBody`.
        layer_submodules: the optional sublayers every decoder layer builds
            (`draft.layers.DFlashLayerSubmodules`; none by default). Variants pass theirs here.
    """

    def __init__(
        self,
        config: DFlashConfig,
        parallel_config: Optional[ModelParallelConfig] = None,
        tp_group=None,
        attention_backend: str = "auto",
        layer_submodules: DFlashLayerSubmodules = DFlashLayerSubmodules(),
    ):
        super().__init__(
            config, parallel_config, tp_group, attention_backend,
            make_layer=lambda i, parallel, group: DFlashDecoderLayer(config, i, parallel, group, layer_submodules),
        )

    def rope(self, plan: DFlashBatchPlan, device) -> tuple[torch.Tensor, ...]:
        """fp32 (cos_block, sin_block `[B, N, W, D]`, cos_context, sin_context `[B, S, D]`)."""
        cfg = self.config
        inv_freq, scale = rope_inv_freq(
            cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings, device
        )
        cos_b, sin_b = rope_cos_sin(plan.position_ids.to(device), inv_freq, scale)
        cos_c, sin_c = rope_cos_sin(plan.context_position_ids.to(device), inv_freq, scale)
        return cos_b, sin_b, cos_c, sin_c

    def layer_inputs(self, plan: DFlashBatchPlan, device) -> tuple:
        """The RoPE tables every layer applies (`rope`), as one argument."""
        return (self.rope(plan, device),)
