"""The megatron target: a megatron-core ``GPTModel`` stage built from a HF checkpoint, frozen, capturing taps
(docs/design.md §9 The training step, §13 Parallelism, §17 Target families).

`build_megatron_target` builds one pipeline stage from a HF directory: the config and layer specs of
`target.megatron.config`, the weights of `target.megatron.weights` (one weight plan per rank, streamed shard
by shard into the model; Qwen3, Llama and Qwen3-MoE families: GQA, RMSNorm, SwiGLU, Qwen3's q/k norms, tied or
untied embeddings, ``rope_theta``, linear and llama3 RoPE scaling; Qwen3-MoE's softmax top-k routing with or
without renormalisation, dense ``mlp_only_layers`` / ``decoder_sparse_step``; DeepSeek-V3's multi-latent
attention, sigmoid group-limited routing with the score-correction bias, routed scaling, shared experts and
dense first layers; experts split over ``expert_model_parallel_size`` ranks).

`MegatronTarget` wraps that stage (tensor, expert and sequence parallel) as a `target.taps.FrozenTarget`. Its
forward captures the taps of the layers this stage owns, keyed by **global** layer id, as ``[B, S, H]``
tensors (megatron works in ``[S, B, H]`` inside, ``[S / TP, B, H]`` under sequence parallelism: taps are
gathered back to the full sequence), so a pipeline schedule (`target.megatron.pipeline`) can route them to the
stage that holds the draft; `target.taps.concat_taps` assembles them. Its ``embedding`` is the vocab-parallel
input embedding. Context parallelism is refused (`context_parallel_refusal` says why), and so are
per-document positions with multi-latent attention (megatron's MLA takes no position ids).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
from torch import nn

from ...common.parallel import ProcessGroups, current_process_groups, megatron_ready
from ...common.safetensors_files import target_safetensors_files
from ...draft.config import DFlashConfig, check_target_layer_ids
from ..head import OutputHead
from ..masks import causal_mask
from ..taps import FrozenTarget
from .config import hf_target_spec, megatron_target_block_spec, megatron_target_config, padded_vocab_size
from .weights import checked_weight_plan, load_plan_into

__all__ = [
    "build_megatron_target",
    "context_parallel_refusal",
    "MegatronTargetOutput",
    "MegatronTarget",
]

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
    plan = checked_weight_plan(
        spec, tp_rank, tp_size, layer_offset=offset, num_layers=len(model.decoder.layers),
        pre_process=pre_process, post_process=post_process, padded_vocab=vocab,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by, dtype=config.params_dtype,
        transformer_engine_names=use_te,
        ep_rank=groups.ep_rank,
        ep_size=groups.ep_size,
        etp_rank=groups.etp_rank,
        etp_size=groups.etp_size,
    )
    load_plan_into(model, plan, target_safetensors_files(hf_dir), spec.model_type)
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


class MegatronTarget(FrozenTarget):
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
