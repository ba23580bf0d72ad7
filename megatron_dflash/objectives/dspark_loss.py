"""Placeholder of the DSpark objective (docs/design.md §18 DSpark): the signature only, so the variant imports.

The real kernel replaces this module; here the loss is the weighted CE of the Markov-corrected logits, enough
for the variant's wiring tests (no value of it is asserted).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from .dflash_loss import DFlashMetrics
from ..plan.batch_plan import DFlashBatchPlan

__all__ = ["DSparkLossOutput", "DSparkMetrics", "dspark_loss"]


class DSparkMetrics(DFlashMetrics):
    """Additive fp64 sums (placeholder): DFlash's fields, only the supervised slots counted."""


@dataclass
class DSparkLossOutput:
    loss_sum: torch.Tensor
    weight_sum: torch.Tensor
    metrics: DSparkMetrics


def dspark_loss(hidden, plan: DFlashBatchPlan, input_ids, head, *, teacher_hidden, markov_features=None,
                markov_w2=None, confidence_logits=None, ce_weight: float = 0.1, l1_weight: float = 0.9,
                bce_weight: float = 1.0, decay_gamma: Optional[float] = 4.0, chunk_slots: int = 1024,
                loss_mask=None) -> DSparkLossOutput:
    """Slot `k` of a block at `p` predicts `x_{p+k+1}`; CE of the (corrected) local logits of this shard's labels."""
    B, N, W, _ = hidden.shape
    S = input_ids.shape[1]
    pos = plan.anchor_positions[:, :, None] + 1 + torch.arange(W, device=hidden.device)
    labels = torch.gather(input_ids, 1, pos.clamp(max=S - 1).reshape(B, -1)).view(B, N, W)
    valid = plan.block_valid[:, :, None] & (pos < S)
    logits = head.local_logits(hidden)
    if markov_features is not None:
        logits = logits + F.linear(markov_features.to(markov_w2.dtype), markov_w2).float()
    start = head.vocab_range[0]  # under TP: the CE of this shard's labels only (a placeholder, not the objective)
    local = torch.where((labels >= start) & (labels < start + logits.shape[-1]), labels - start, -100)
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), local.reshape(-1), reduction="none").view(B, N, W)
    weight = valid.float()
    loss_sum = (nll * weight).sum() * ce_weight
    if confidence_logits is not None:
        loss_sum = loss_sum + bce_weight * (confidence_logits.float() * 0).sum()
    zero = torch.zeros((), dtype=torch.float64, device=hidden.device)
    metrics = DSparkMetrics(weight.sum().double(), zero, zero, plan.block_valid.sum().double())
    return DSparkLossOutput(loss_sum, weight.sum().detach(), metrics)
