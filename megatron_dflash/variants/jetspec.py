"""JetSpec: the DFlash backbone with causal in-block attention, distilled from the target by forward KL.

Two changes to plain DFlash (docs/design.md §12 Variants, §3 Block attention):

* **Causal in-block attention.** Slot ``k`` of a block sees the target context strictly before the
  anchor and the slots ``0..k`` of its own block, never a later slot, on every layer. The direction is
  decided by `DFlashConfig.layer_attention` (the one resolver of training masks and decoding), so a
  `JetSpecConfig` (``causal=True``) makes `DFlashBody` causal in training and decoding (one forward) with
  no other change. The exported ``config.json`` says so twice: ``is_causal: true`` (what the reference
  modeling code reads) and ``dflash_config.causal: true``.
* **Forward KL to the target.** Slot ``k`` of a block at ``p`` is distilled from the target's own
  next-token distribution for position ``p + k``, i.e. the teacher logits computed from the target's
  final hidden state at ``p + k - 1``:

      loss_k = T**2 * KL( softmax(teacher_{p+k-1} / T) || softmax(draft_k / T) )

  weighted by the DFlash slot weights and normalised over the global batch like every DFlash loss
  (`jetspec_loss` returns numerator and denominator). The metrics compare the draft's argmax with the
  **target's** argmax at ``p + k - 1`` (not the data token): that is what greedy speculative decoding
  accepts, given the true prefix.

One JetSpec training step::

    config = jetspec_config(dflash_config)            # or JetSpecConfig(...)
    body = DFlashBody(config, ...)
    blocks = embed_blocks(input_ids, plan, embedding, mask_token_id=config.mask_token_id)
    hidden = body(target_hidden, blocks, plan)
    out = jetspec_loss(hidden, plan, input_ids, head, teacher_hidden, temperature=2.0)
    (out.loss_sum / global_weight_sum).backward()

The loss is the DFlash skeleton with soft targets: `objectives.dflash_loss.dflash_loss.slot_targets` and the one kernel
`objectives.head_loss.head_loss(soft_target="kl")` (chunked, vocab-parallel, never all logits at once); the
target's argmax for the metrics is found chunk by chunk with `topk_vocab_parallel`, one extra no-grad
pass of the head over the teacher rows.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..draft.config import DFLASH_ARCHITECTURE, DFlashConfig, resolve_causal
from ..objectives.dflash_loss import (
    DFlashLossOutput,
    SlotTargets,
    check_block_hidden,
    dflash_metrics,
    slot_targets,
    teacher_rows,
)
from ..objectives.head_loss import check_loss_options, head_loss, topk_vocab_parallel
from ..plan.batch_plan import DFlashBatchPlan
from ..target.head import OutputHead

__all__ = ["JetSpecConfig", "jetspec_config", "jetspec_loss", "teacher_argmax_ids"]


# ================================================================================== config


@dataclass
class JetSpecConfig(DFlashConfig):
    """`DFlashConfig` of a JetSpec draft: in-block attention causal on every layer.

    `causal` is fixed to True (a JetSpec draft trained bidirectionally is a plain DFlash draft); any
    other value is refused. Sliding-window layers keep their window and are causal as well.
    """

    causal: Optional[bool] = True

    def validate(self) -> None:
        super().validate()
        if self.causal is not True:
            raise ValueError(
                f"JetSpecConfig.causal={self.causal!r}: JetSpec drafts are causal in-block on every layer; "
                "use DFlashConfig for a bidirectional draft."
            )

    def to_hf_dict(self, architecture: Optional[str] = None) -> dict[str, Any]:
        """The DFlash `config.json` with ``is_causal: true`` and ``dflash_config.causal: true``.

        The architecture stays ``DFlashDraftModel``: a JetSpec draft is a DFlash draft whose in-block
        attention is causal, which the reference and the serving runtimes read from ``is_causal``.
        """
        if architecture not in (None, DFLASH_ARCHITECTURE):
            raise ValueError(
                f"architecture={architecture!r}: a JetSpec draft is written as {DFLASH_ARCHITECTURE!r} "
                "with is_causal: true."
            )
        out = super().to_hf_dict(DFLASH_ARCHITECTURE)
        out["is_causal"] = True
        out["dflash_config"]["causal"] = True
        return out

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any], **overrides: Any) -> "JetSpecConfig":
        """Read a JetSpec `config.json`.

        Raises:
            ValueError: the file does not declare causal in-block attention (`draft.config.resolve_causal`:
                ``dflash_config.causal``, else the top-level ``is_causal``): reading a bidirectional draft
                as JetSpec would silently change its attention. NeMo AutoModel's JetSpec drafters
                (``is_causal: false``, ``dflash_config.causal: true``) are causal.
        """
        if "causal" not in overrides and resolve_causal(data) is not True:
            raise ValueError(
                "config.json does not declare causal in-block attention (is_causal / causal true): not a "
                "JetSpec draft. Load it with DFlashConfig."
            )
        return super().from_hf_dict(data, **overrides)

    def save_pretrained(self, directory: str, architecture: Optional[str] = None) -> None:
        super().save_pretrained(directory, architecture=architecture)


def jetspec_config(config: DFlashConfig) -> JetSpecConfig:
    """The `JetSpecConfig` with every field of `config` and ``causal=True``.

    Args:
        config: a plain `DFlashConfig` (or a `JetSpecConfig`, returned as an equal copy).

    Raises:
        ValueError: `config` is another variant's config (DFlash 2, Domino): their extra fields and
            in-block direction do not carry over to JetSpec.
    """
    if type(config) not in (DFlashConfig, JetSpecConfig):
        raise ValueError(
            f"jetspec_config needs a plain DFlashConfig, got {type(config).__name__}; JetSpec is the DFlash "
            "backbone with causal in-block attention, not a variant of another variant."
        )
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(DFlashConfig)}
    values["causal"] = True
    values["target_layer_ids"] = list(values["target_layer_ids"])
    values["layer_types"] = list(values["layer_types"])
    values["extra_hf_fields"] = dict(values["extra_hf_fields"])
    return JetSpecConfig(**values)


# ================================================================================== loss


@torch.no_grad()
def teacher_argmax_ids(
    plan: DFlashBatchPlan,
    head: OutputHead,
    teacher_hidden: torch.Tensor,
    *,
    chunk_slots: Optional[int] = 1024,
) -> torch.Tensor:
    """``[B, N, W]`` int64: the target's greedy token for every slot, ``argmax(head(teacher[p + k - 1]))``.

    Slot ``k`` of a block at ``p`` gets the target's argmax at ``p + k - 1`` (its prediction of the
    token at ``p + k``); slot 0 gets 0 (it is never predicted). Computed chunk by chunk over the
    vocabulary-parallel head (peak ``chunk_slots x V / TP`` logits), identical on every TP rank.
    """
    B, N, W, S = plan.batch_size, plan.num_blocks, plan.block_size, plan.seq_length
    if teacher_hidden.dim() != 3 or tuple(teacher_hidden.shape[:2]) != (B, S):
        raise ValueError(
            f"teacher_hidden must be [batch, seq_length, hidden] = [{B}, {S}, H], got {tuple(teacher_hidden.shape)}."
        )
    device = teacher_hidden.device
    plan = plan.to(device)
    slots = torch.arange(1, W, device=device)
    positions = (plan.anchor_positions[:, :, None] + slots - 1).clamp(0, S - 1)  # [B, N, W-1]
    rows = torch.arange(B, device=device)[:, None, None] * S
    index = (rows + positions).reshape(-1)
    flat = teacher_hidden.reshape(B * S, -1)
    M = index.numel()
    size = M if chunk_slots is None else max(1, min(int(chunk_slots), M))
    start = head.vocab_range[0]
    ids = [
        topk_vocab_parallel(head.local_logits(flat.index_select(0, part)), 1, start, head.tp_group)[1][:, 0]
        for part in index.split(size)
    ]
    out = torch.zeros(B, N, W, dtype=torch.int64, device=device)
    out[:, :, 1:] = torch.cat(ids).view(B, N, W - 1)
    return out


def jetspec_loss(
    hidden: torch.Tensor,
    plan: DFlashBatchPlan,
    input_ids: torch.Tensor,
    head: OutputHead,
    teacher_hidden: torch.Tensor,
    *,
    temperature: float = 1.0,
    decay_gamma: Optional[float] = None,
    loss_mask: Optional[torch.Tensor] = None,
    weights: Optional[torch.Tensor] = None,
    chunk_slots: Optional[int] = 1024,
    fused: Optional[bool] = None,
) -> DFlashLossOutput:
    """JetSpec objective of one micro-batch: temperature-scaled forward KL to the target, per slot.

    ``loss_k = T**2 * KL(softmax(teacher_{p+k-1} / T) || softmax(draft_k / T))`` with the slot weights
    ``w_k`` of `objectives.dflash_loss.dflash_loss.decay_weights` (uniform when ``decay_gamma`` is None, the JetSpec paper's
    main setting); ``loss_sum = sum(w * mask * loss)`` and ``weight_sum = sum(w * mask)``, to be summed
    over the global batch before dividing (as for `objectives.dflash_loss.dflash_loss.dflash_loss`).

    Args:
        hidden: ``[B, N, W, H]`` output of a causal (JetSpec) body.
        plan: the batch plan.
        input_ids: ``[B, S]`` the context tokens; they only fix the shapes here (the supervision is the
            target's distribution, the default mask is ``plan.loss_mask``).
        head: the target's output layer (`OutputHead`, vocab-parallel or not).
        teacher_hidden: ``[B, S, H]`` the target's final normed hidden states (the input of its output
            layer): the teacher logits are ``head(teacher_hidden)``.
        temperature: T > 0 of both distributions; the loss is scaled by ``T**2``.
        decay_gamma, loss_mask, weights, chunk_slots, fused: as `objectives.dflash_loss.dflash_loss.dflash_loss`.

    Returns:
        `objectives.dflash_loss.dflash_loss.DFlashLossOutput`. Its metrics count a slot as correct when the draft's argmax equals
        the **target's** argmax at ``p + k - 1``; ``acceptance_length`` is then the greedy acceptance
        length against the target (bonus included), the quantity speculative decoding realises.
    """
    check_block_hidden(hidden, plan)
    check_loss_options(head, chunk_slots, fused)
    if not isinstance(teacher_hidden, torch.Tensor):
        raise ValueError("teacher_hidden [B, S, H] (the target's final normed hidden states) is required for JetSpec.")
    if not (isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
            and temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature={temperature!r} must be a positive finite number.")
    B, S = plan.batch_size, plan.seq_length
    if not isinstance(input_ids, torch.Tensor) or tuple(input_ids.shape) != (B, S):
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be [batch, seq_length] = {(B, S)}, got {shape}.")
    if loss_mask is not None and tuple(loss_mask.shape) != (B, plan.num_blocks, plan.block_size):
        raise ValueError(
            f"loss_mask must have shape {(B, plan.num_blocks, plan.block_size)}, got {tuple(loss_mask.shape)}."
        )
    greedy = teacher_argmax_ids(plan, head, teacher_hidden, chunk_slots=chunk_slots)  # [B, N, W]
    device = hidden.device
    plan = plan.to(device)
    if loss_mask is not None:
        loss_mask = loss_mask.to(device).bool() & plan.block_valid[:, :, None]
    # The supervision and weights of DFlash; the label of a slot (it feeds only the metrics, the loss is the
    # KL to the target's distribution) is the target's greedy token, what greedy decoding accepts.
    dflash = slot_targets(input_ids.to(device), plan, decay_gamma=decay_gamma, loss_mask=loss_mask, weights=weights)
    targets = SlotTargets.from_mask(greedy.to(device)[:, :, 1:], dflash.supervised, dflash.weights, first_slot=1)
    terms = head_loss(
        targets.flat_hidden(hidden), targets.flat_labels, targets.flat_weights, head, chunk_slots=chunk_slots,
        fused=fused, teacher=teacher_hidden.to(device).reshape(B * S, -1), teacher_index=teacher_rows(plan),
        soft_target="kl", temperature=float(temperature),
    )
    return DFlashLossOutput(
        loss_sum=terms.loss_sum, weight_sum=targets.weight_sum, metrics=dflash_metrics(targets, terms.base_correct, plan)
    )
