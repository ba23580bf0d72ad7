"""The frozen target's output layer as the draft objectives and decoding see it (`OutputHead`).

The target's head is megatron's vocab-parallel ``ColumnParallelLinear`` (this rank holds rows
``vocab_range`` of the weight) or a plain ``nn.Linear`` lm_head at TP=1. `OutputHead` adds what the
draft needs on top of the raw layer: the real vocabulary size (padding columns excluded), the target's
output transform (multiplier, soft cap) and the explicit tensor-parallel group. It lives apart from the
losses so the target, the pipeline and decoding do not depend on the objective
(docs/design.md §7 Module map).

Shapes: H hidden size, V vocabulary (local shard: ``V_padded / TP``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..common.parallel import SingleRankGroup, reduce_grad_over_group, tensor_parallel_group
from ..draft.config import DFlashConfig
from ..draft.draft_vocab import DraftVocabulary

__all__ = ["OutputHead"]


def _is_column_parallel(layer: nn.Module) -> bool:
    """Megatron-style column-parallel linear: knows the width of its vocabulary shard."""
    return hasattr(layer, "output_size_per_partition") and not isinstance(layer, nn.Linear)


@dataclass
class OutputHead:
    """The frozen target's output layer as seen by the objective.

    Args:
        layer: a megatron ``ColumnParallelLinear`` (vocab-parallel: this rank holds rows
            ``vocab_range`` of the weight) or a plain ``nn.Linear`` lm_head (TP=1). Only its ``weight`` and
            ``bias`` are used (see `local_logits`).
        vocab_size: the real vocabulary size V. The layer may be wider (megatron pads the vocabulary to a
            multiple of ``128 * TP``); columns ``>= vocab_size`` are excluded from softmax and argmax.
        tp_group: the group that splits the vocabulary. For a column-parallel layer: this group, else the
            layer's ``tp_group``, else megatron's TP group (`common.parallel.tensor_parallel_group`). A plain
            ``nn.Linear`` is always one rank.
        output_multiplier: the target multiplies its raw logits by this (``dflash_config``).
        final_logit_softcapping: if set, logits become ``cap * tanh(logits / cap)`` after the multiplier.
        weight: the output weight to pass to the layer when it owns none (megatron builds the output layer
            with ``skip_weight_param_allocation=True`` for targets with tied embeddings and passes the
            embedding weight at call time). Column-parallel layers only.
        draft_vocab: set on a draft's own head over a reduced vocabulary (`of_draft`): its ``vocab_size`` columns
            are the target ids ``draft_vocab.ids``; the losses map their target-id labels through it
            (docs/design.md §20 Reduced draft vocabulary).
    """

    layer: nn.Module
    vocab_size: int
    tp_group: object = None
    output_multiplier: float = 1.0
    final_logit_softcapping: Optional[float] = None
    weight: Optional[torch.Tensor] = None
    draft_vocab: Optional[DraftVocabulary] = None

    def __post_init__(self) -> None:
        if isinstance(self.layer, nn.Linear):
            if self.tp_group is not None and getattr(self.tp_group, "size", lambda: 1)() > 1:
                raise ValueError(
                    "OutputHead: a plain nn.Linear holds the whole vocabulary, but a tensor-parallel group of "
                    f"size {self.tp_group.size()} was given. Use a megatron ColumnParallelLinear for a "
                    "vocab-parallel head, or drop tp_group."
                )
            if self.weight is not None:
                raise ValueError("OutputHead.weight is only for column-parallel layers built without a weight.")
            self.tp_group = SingleRankGroup()
            self._local_vocab = self.layer.out_features
        elif _is_column_parallel(self.layer):
            group = self.tp_group if self.tp_group is not None else getattr(self.layer, "tp_group", None)
            self.tp_group = tensor_parallel_group(group)
            self._local_vocab = int(self.layer.output_size_per_partition)
        else:
            raise ValueError(
                f"OutputHead.layer must be a megatron ColumnParallelLinear or an nn.Linear, got "
                f"{type(self.layer).__name__}."
            )
        self.vocab_size = int(self.vocab_size)
        padded = self._local_vocab * self.tp_group.size()
        if not 1 <= self.vocab_size <= padded:
            raise ValueError(
                f"OutputHead: vocab_size={self.vocab_size} but the layer has {padded} output columns in all "
                f"({self._local_vocab} per rank x TP {self.tp_group.size()}); vocab_size must be between 1 and "
                "the layer's width (pass the real, unpadded vocabulary)."
            )
        if not (math.isfinite(self.output_multiplier) and self.output_multiplier > 0):
            raise ValueError(f"OutputHead.output_multiplier={self.output_multiplier} must be finite and > 0.")
        if self.final_logit_softcapping is not None and not self.final_logit_softcapping > 0:
            raise ValueError(
                f"OutputHead.final_logit_softcapping={self.final_logit_softcapping} must be > 0 or None."
            )

    @classmethod
    def from_config(
        cls, layer: nn.Module, config: DFlashConfig, tp_group=None, weight: Optional[torch.Tensor] = None
    ) -> "OutputHead":
        """A head with the vocabulary size and output transform of the draft's config."""
        return cls(
            layer=layer,
            vocab_size=config.vocab_size,
            tp_group=tp_group,
            output_multiplier=config.output_multiplier,
            final_logit_softcapping=config.final_logit_softcapping,
            weight=weight,
        )

    @classmethod
    def of_draft(cls, body: nn.Module, target_head: "OutputHead",
                 vocab: Optional[DraftVocabulary] = None) -> "OutputHead":
        """The head ``body`` proposes through: ``target_head`` itself, or with a reduced vocabulary the draft's
        own head (``body.lm_head``, ``body.d2t``) with the target head's output transform; a rank holding fewer
        rows than its shard's width gets zero rows (columns past the draft vocabulary, which `local_logits` sets
        to ``-inf``). Build it per step when the head trains (the padding is then part of the graph), passing
        the ``vocab`` read once from ``body.d2t`` (reading it here copies ``d2t`` to the host and checks it, a
        device sync)."""
        if not hasattr(body, "lm_head"):  # the full target vocabulary
            return target_head
        layer = body.lm_head
        rows, width = layer.weight.shape[0], layer.output_size_per_partition
        weight = None if rows == width else F.pad(layer.weight, (0, 0, 0, width - rows))
        if vocab is None:
            vocab = DraftVocabulary.from_d2t(body.d2t, target_head.vocab_size).to(body.d2t.device)
        return cls(layer=layer, vocab_size=vocab.size, tp_group=layer.tp_group,
                   output_multiplier=target_head.output_multiplier,
                   final_logit_softcapping=target_head.final_logit_softcapping, weight=weight, draft_vocab=vocab)

    def to_draft(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Target-id ``labels [...]`` -> ``(column ids [...], inside [...] bool)``: the draft id of each label
        (0 outside the draft vocabulary, where ``inside`` is False); the labels themselves and all True
        without a reduced vocabulary."""
        if self.draft_vocab is None:
            return labels, torch.ones_like(labels, dtype=torch.bool)
        draft = self.draft_vocab.draft_index(labels.device)[labels]
        inside = draft >= 0
        return draft.clamp(min=0), inside

    def to_target(self, columns: torch.Tensor) -> torch.Tensor:
        """Column ids of this head -> target ids (the same ids without a reduced vocabulary)."""
        if self.draft_vocab is None:
            return columns
        return self.draft_vocab.ids.to(columns.device)[columns]

    @property
    def local_vocab_size(self) -> int:
        """Columns of this rank's shard, ``V_padded / TP``."""
        return self._local_vocab

    @property
    def vocab_range(self) -> tuple[int, int]:
        """``(start, end)`` of this rank's vocabulary shard (end exclusive, may include padding)."""
        start = self.tp_group.rank() * self._local_vocab
        return start, start + self._local_vocab

    def local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [..., H] -> [..., V / TP]`` fp32 logits of this rank's shard, as the target reads them.

        ``hidden @ W_local^T (+ bias)`` with the layer's (or the given) weight; in backward the gradient
        w.r.t. ``hidden`` is summed over the TP group (each rank holds only its shard's contribution).

        Applies the output multiplier, then the soft cap, then sets padded vocabulary columns to ``-inf``
        (after the cap: ``tanh`` would otherwise turn ``-inf`` into ``-cap``).
        """
        weight = self.weight if self.weight is not None else self.layer.weight
        if weight is None:
            raise ValueError(
                "OutputHead: the layer owns no weight (megatron's skip_weight_param_allocation, used for tied "
                "embeddings); pass the output weight as OutputHead(weight=...)."
            )
        bias = getattr(self.layer, "bias", None)
        # The matmul is done here rather than by the module: megatron's layer resolves its gradient
        # all-reduce through parallel_state (and fails outside an initialised launch); the group is explicit here.
        hidden = reduce_grad_over_group(hidden.to(weight.dtype), self.tp_group)
        logits = F.linear(hidden, weight, bias)
        logits = logits.float()
        if self.output_multiplier != 1.0:
            logits = logits * self.output_multiplier
        if self.final_logit_softcapping is not None:
            cap = float(self.final_logit_softcapping)
            logits = torch.tanh(logits / cap) * cap
        start, end = self.vocab_range
        if end > self.vocab_size:  # this shard holds padding columns
            columns = torch.arange(start, end, device=logits.device)
            logits = logits.masked_fill(columns >= self.vocab_size, float("-inf"))
        return logits

    def requires_grad(self) -> bool:
        """Whether any tensor the head computes with requires a gradient."""
        if self.weight is not None and self.weight.requires_grad:
            return True
        return any(p.requires_grad for p in self.layer.parameters())
