"""DFlash training objectives: block inputs, slot targets and loss weights, the DFlash loss, additive metrics.

Conventions (docs/design.md §2 Conventions and §6 Objectives; they must never drift from what serving does):

* a block with anchor ``p`` has ``W = gamma + 1`` slots; slot 0 holds the real anchor token ``x_p``, slots
  ``1..gamma`` the MASK token, all embedded with the **target's** input embedding times
  ``input_embedding_scale``;
* slot ``k`` predicts the token **at** ``p + k``; slot 0 is never supervised and never computed;
* slot ``k`` has loss weight ``w_k = exp(-(k - 1) / decay_gamma)`` (uniform when ``decay_gamma`` is None), or,
  with a D-PACE `LossWeighting`, a detached weight formed from the cross entropies of its block's slots
  (`dpace_weights`), known only once the kernel has computed every slot's loss;
* the loss is ``sum(w * loss * mask) / sum(w * mask)`` over the **whole global batch**. The objective returns
  numerator and denominator separately (`DFlashLossOutput.loss_sum`, `.weight_sum`) and the training loop
  divides once by the global denominator, like megatron's ``calculate_per_token_loss=True``. Averaging per
  micro-batch would make the objective depend on how the global batch is split.

One skeleton for every variant: `slot_targets` (or a variant's own `SlotTargets`) says which slots are
supervised, with which label and weight; `objectives.head_loss.head_loss`, the one chunked vocab-parallel CE / KL kernel,
turns the flattened slots into ``loss_sum`` and per-slot correctness; `dflash_metrics` (or a variant's
metrics) counts them. Memory: never the logits of all slots, one ``[chunk_slots, V / TP]`` chunk at a time
(static shapes, no host synchronisation); unsupervised slots inside a chunk are computed and weighted by zero.

Shapes: B batch, S context length, N blocks per row, W block size, H hidden size, V vocabulary (local
shard: ``V / TP``), M = B * N * (W - 1) predicted slots.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from ..common.parallel import SingleRankGroup, distributed_ready
from ..plan.batch_plan import DFlashBatchPlan
from ..target.head import OutputHead
from .head_loss import SOFT_TARGETS, check_loss_options, head_loss

__all__ = [
    "OutputHead",
    "block_tokens",
    "embed_blocks",
    "block_labels",
    "decay_weights",
    "DPACE_SCHEMES",
    "LOSS_WEIGHTINGS",
    "DPACE_NORMALIZATIONS",
    "dpace_weights",
    "LossWeighting",
    "check_weighting",
    "AdditiveMetrics",
    "all_reduce_together",
    "DFlashMetrics",
    "EmittedPathMetrics",
    "acceptance_lengths",
    "counted_blocks",
    "SlotTargets",
    "slot_targets",
    "shifted_supervision",
    "teacher_rows",
    "DFlashLossOutput",
    "dflash_loss",
    "dflash_metrics",
    "SOFT_TARGETS",
]



# --------------------------------------------------------------------------------------------------
# Block inputs, labels and weights
# --------------------------------------------------------------------------------------------------


def _check_input_ids(input_ids: torch.Tensor, plan: DFlashBatchPlan) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a [batch, seq_length] integer tensor, got {shape}.")
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must be an integer tensor, got dtype {input_ids.dtype}; use .long().")
    if tuple(input_ids.shape) != (plan.batch_size, plan.seq_length):
        raise ValueError(
            f"input_ids has shape {tuple(input_ids.shape)} but the plan is for batch {plan.batch_size} x "
            f"seq_length {plan.seq_length}; build the plan from this batch's mask."
        )


def _check_prefix_lengths(prefix_lengths: Optional[torch.Tensor], plan: DFlashBatchPlan) -> None:
    if prefix_lengths is None:
        return
    if not isinstance(prefix_lengths, torch.Tensor) or tuple(prefix_lengths.shape) != (
        plan.batch_size,
        plan.num_blocks,
    ):
        shape = tuple(prefix_lengths.shape) if isinstance(prefix_lengths, torch.Tensor) else type(prefix_lengths).__name__
        raise ValueError(
            f"prefix_lengths must be a [batch, blocks] = {(plan.batch_size, plan.num_blocks)} integer tensor, "
            f"got {shape}."
        )
    if prefix_lengths.dtype.is_floating_point or prefix_lengths.dtype == torch.bool:
        raise ValueError(f"prefix_lengths must be an integer tensor, got dtype {prefix_lengths.dtype}.")


def _slot_index(block_size: int, device) -> torch.Tensor:
    return torch.arange(block_size, dtype=torch.int64, device=device)


def block_labels(input_ids: torch.Tensor, plan: DFlashBatchPlan) -> torch.Tensor:
    """``[B, N, W]`` int64: the token at ``anchor + k`` for slot ``k`` (slot 0: the anchor token itself).

    Invalid blocks hold whatever the clamped gather finds; they are never supervised.
    """
    _check_input_ids(input_ids, plan)
    plan = plan.to(input_ids.device)
    B, N, W = plan.batch_size, plan.num_blocks, plan.block_size
    index = plan.token_indices.reshape(B, N * W)
    return torch.gather(input_ids.long(), 1, index).view(B, N, W)


def block_tokens(
    input_ids: torch.Tensor,
    plan: DFlashBatchPlan,
    *,
    mask_token_id: int,
    prefix_lengths: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``[B, N, W]`` int64 input tokens of every block.

    Plain DFlash: ``[x_p, MASK, ..., MASK]``. With ``prefix_lengths`` ``l [B, N]`` (variable-prefix
    training): real tokens ``x_{p+k}`` at slots ``k < l``, MASK at ``k >= l``. Invalid blocks are all MASK.
    """
    if isinstance(mask_token_id, bool) or not isinstance(mask_token_id, int) or mask_token_id < 0:
        raise ValueError(f"mask_token_id must be a non-negative int (a row of the target embedding), got {mask_token_id!r}.")
    _check_prefix_lengths(prefix_lengths, plan)
    labels = block_labels(input_ids, plan)
    plan = plan.to(input_ids.device)
    slots = _slot_index(plan.block_size, labels.device)
    if prefix_lengths is None:
        visible = (slots == 0)[None, None, :] & plan.block_valid[:, :, None]
    else:
        visible = (slots[None, None, :] < prefix_lengths.to(labels.device)[:, :, None]) & plan.block_valid[:, :, None]
    return torch.where(visible, labels, torch.full((), mask_token_id, dtype=torch.int64, device=labels.device))


def embed_blocks(
    input_ids: torch.Tensor,
    plan: DFlashBatchPlan,
    embedding: nn.Module,
    *,
    mask_token_id: int,
    input_embedding_scale: float = 1.0,
    prefix_lengths: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``[B, N, W, H]`` block embeddings: ``embedding(block_tokens(...)) * input_embedding_scale``.

    ``embedding`` is the target's input embedding **module** (``nn.Embedding`` or megatron's
    ``VocabParallelEmbedding``), called as a module so that a vocab-parallel table does its own lookup and
    all-reduce; indexing its weight would read only this rank's shard.
    """
    tokens = block_tokens(input_ids, plan, mask_token_id=mask_token_id, prefix_lengths=prefix_lengths)
    embedded = embedding(tokens)
    if isinstance(embedded, tuple):
        embedded = embedded[0]
    if input_embedding_scale != 1.0:
        embedded = embedded * input_embedding_scale
    return embedded


def decay_weights(
    plan_or_shape: Union[DFlashBatchPlan, tuple],
    *,
    decay_gamma: Optional[float] = None,
    block_size: Optional[int] = None,
    prefix_lengths: Optional[torch.Tensor] = None,
    device=None,
) -> torch.Tensor:
    """``[B, N, W]`` fp32 per-slot loss weights (not multiplied by any mask).

    ``w_k = exp(-(k - start) / decay_gamma)`` for slots ``k >= start`` and 0 below, where ``start = 1``
    (slot 0 is the anchor) or, with ``prefix_lengths`` ``l [B, N]``, ``start = l``: the decay restarts at
    the first masked slot. ``decay_gamma=None`` gives weight 1 from ``start`` on.

    Args:
        plan_or_shape: a `DFlashBatchPlan`, or a shape ``(B, N)`` (then ``block_size`` is required) or
            ``(B, N, W)``.
        decay_gamma: decay length (> 0) or None.
        block_size: W when ``plan_or_shape`` is ``(B, N)``.
        prefix_lengths: ``[B, N]`` integer, first supervised slot of each block.
        device: device of the result (default: the plan's, or ``prefix_lengths``', or CPU).
    """
    if isinstance(plan_or_shape, DFlashBatchPlan):
        B, N, W = plan_or_shape.batch_size, plan_or_shape.num_blocks, plan_or_shape.block_size
        if block_size is not None and block_size != W:
            raise ValueError(f"decay_weights: block_size={block_size} disagrees with the plan's block_size={W}.")
        device = device if device is not None else plan_or_shape.device
    else:
        shape = tuple(int(s) for s in plan_or_shape)
        if len(shape) == 3:
            B, N, W = shape
            if block_size is not None and block_size != W:
                raise ValueError(f"decay_weights: block_size={block_size} disagrees with shape {shape}.")
        elif len(shape) == 2:
            if block_size is None:
                raise ValueError("decay_weights: pass block_size=W with a (batch, blocks) shape.")
            (B, N), W = shape, int(block_size)
        else:
            raise ValueError(f"decay_weights: expected a plan, (batch, blocks) or (batch, blocks, block_size), got {shape}.")
    if W < 2:
        raise ValueError(f"decay_weights: block_size={W} must be >= 2.")
    if decay_gamma is not None and not (isinstance(decay_gamma, (int, float)) and decay_gamma > 0):
        raise ValueError(f"decay_gamma={decay_gamma!r} must be a positive number or None (uniform weights).")
    if device is None and prefix_lengths is not None:
        device = prefix_lengths.device
    slots = _slot_index(W, device).to(torch.float32)
    if prefix_lengths is None:
        start = torch.ones(B, N, 1, dtype=torch.float32, device=device)
    else:
        if tuple(prefix_lengths.shape) != (B, N):
            raise ValueError(f"prefix_lengths must have shape {(B, N)}, got {tuple(prefix_lengths.shape)}.")
        start = prefix_lengths.to(device=device, dtype=torch.float32)[:, :, None]
    distance = slots[None, None, :] - start  # [B, N, W]
    if decay_gamma is None:
        weights = torch.ones_like(distance)
    else:
        weights = torch.exp(-distance.clamp(min=0) / float(decay_gamma))
    return torch.where(distance >= 0, weights, torch.zeros((), device=device))


# D-PACE (docs/design.md §6 Objectives): the full weighting and the two ablations of its reference, by name.
DPACE_SCHEMES = ("dpace", "dpace-cumulative-confidence-only", "dpace-continuation-value-only")
LOSS_WEIGHTINGS = ("decay",) + DPACE_SCHEMES
# The denominators of a D-PACE run: the weight sum (ModelOpt), the supervised slots (speculators), the rows
# with a supervised slot (SpecForge's sequences); each summed over the whole global batch.
DPACE_NORMALIZATIONS = ("weight_sum", "supervised", "sequences")


@torch.no_grad()
def dpace_weights(nll: torch.Tensor, supervised: torch.Tensor, *, alpha: float = 0.5,
                  scheme: str = "dpace") -> torch.Tensor:
    """``[..., P]`` fp32 detached D-PACE weights of the predicted slots of each block (0 where unsupervised).

    Per block over its supervised slots: ``q_i = exp(-nll_i)``, ``q~_i = (1 - alpha) q_i + alpha`` (1 on an
    unsupervised slot, which so leaves the product alone), ``C_j = prod_{i <= j} q~_i``, and

    * "dpace": ``w_j = sum_{m >= j} mask_m C_m`` (the expected accepted length's weight of slot ``j``);
    * "dpace-cumulative-confidence-only": ``w_j = C_j``;
    * "dpace-continuation-value-only": ``w_j = sum_{m >= j} mask_m C_m / C_j``.

    Args:
        nll: ``[..., P]`` the per-slot cross entropy with the label (any value where unsupervised).
        supervised: ``[..., P]`` bool.
        alpha: smoothing in [0, 1] (1: uniform weights for "dpace-cumulative-confidence-only").
        scheme: one of `DPACE_SCHEMES`.
    """
    if scheme not in DPACE_SCHEMES:
        raise ValueError(f"scheme={scheme!r} must be one of {DPACE_SCHEMES}.")
    if not (isinstance(alpha, (int, float)) and 0.0 <= alpha <= 1.0):
        raise ValueError(f"alpha={alpha!r} must be in [0, 1].")
    supervised = supervised.bool()
    one = torch.ones((), dtype=torch.float32, device=nll.device)
    smoothed = torch.where(supervised, (1.0 - alpha) * torch.exp(-nll.float()) + alpha, one)
    cumulative = torch.cumprod(smoothed, dim=-1)
    if scheme == "dpace-cumulative-confidence-only":
        weights = cumulative
    else:
        counted = torch.where(supervised, cumulative, one.new_zeros(()))
        # sum over m >= j as a reversed cumulative sum: the total minus a prefix sum would cancel to the rounding
        # error of the total where the tail is small (late slots of a confident block), which the ratio of
        # "dpace-continuation-value-only" then divides by a small C_j.
        suffix = counted.flip(-1).cumsum(dim=-1).flip(-1)
        weights = suffix if scheme == "dpace" else suffix / cumulative.clamp(min=torch.finfo(torch.float32).tiny)
    return torch.where(supervised, weights, one.new_zeros(()))


@dataclass(frozen=True)
class LossWeighting:
    """How the slots of a block are weighted and the loss normalised (docs/design.md §6 Objectives).

    Fields:
        scheme: "decay" (the static ``exp(-(k - 1) / decay_gamma)``; ``decay_gamma`` is passed on its own)
            or one of `DPACE_SCHEMES` (weights from the draft's own per-slot cross entropy, no decay).
        dpace_alpha: D-PACE's smoothing ``alpha`` in [0, 1].
        normalization: D-PACE's denominator, one of `DPACE_NORMALIZATIONS`; the static decay always divides
            by its weight sum.
    """

    scheme: str = "decay"
    dpace_alpha: float = 0.5
    normalization: str = "weight_sum"

    def __post_init__(self):
        if self.scheme not in LOSS_WEIGHTINGS:
            raise ValueError(f"loss weighting {self.scheme!r} must be one of {LOSS_WEIGHTINGS}.")
        if not (isinstance(self.dpace_alpha, (int, float)) and 0.0 <= self.dpace_alpha <= 1.0):
            raise ValueError(f"dpace_alpha={self.dpace_alpha!r} must be in [0, 1].")
        if self.normalization not in DPACE_NORMALIZATIONS:
            raise ValueError(f"normalization {self.normalization!r} must be one of {DPACE_NORMALIZATIONS}.")

    @property
    def dynamic(self) -> bool:
        """The weights depend on the losses (a D-PACE scheme)."""
        return self.scheme != "decay"

    def describe(self, decay_gamma: Optional[float] = None) -> str:
        """One phrase for the run's log, e.g. ``dpace (alpha 0.5, / weight_sum)``."""
        if not self.dynamic:
            return "decay (uniform)" if decay_gamma is None else f"decay (gamma {decay_gamma:g})"
        return f"{self.scheme} (alpha {self.dpace_alpha:g}, / {self.normalization})"

    def row_weights(self, targets: "SlotTargets"):
        """For `objectives.head_loss.head_loss`: the per-row losses ``[M]`` -> D-PACE weights ``[M]`` of
        ``targets``' blocks (None for the static decay, whose weights ``targets`` holds)."""
        if not self.dynamic:
            return None
        supervised = targets.supervised
        return lambda nll: dpace_weights(nll.view(supervised.shape), supervised, alpha=float(self.dpace_alpha),
                                         scheme=self.scheme).reshape(-1)

    def denominator(self, targets: "SlotTargets", used_weights: Optional[torch.Tensor]) -> torch.Tensor:
        """fp32 scalar (no grad): this micro-batch's share of the global denominator. ``used_weights``: the
        ``[M]`` weights the kernel applied (`HeadLossTerms.weights`; None for the static decay)."""
        if not self.dynamic or self.normalization == "weight_sum":
            return targets.weight_sum if used_weights is None else used_weights.detach().sum().to(torch.float32)
        if self.normalization == "supervised":
            return targets.supervised.sum().to(torch.float32)
        # "sequences": the rows with a supervised slot. A row without one adds nothing to learn; counting it
        # would turn a global batch with nothing to learn into an optimizer step (§9 skips a zero denominator).
        return targets.supervised.flatten(1).any(dim=1).sum().to(torch.float32)


def check_weighting(weighting: Optional[LossWeighting], decay_gamma, weights, soft_target: str = "none"):
    """The run's `LossWeighting` (the static decay when None); D-PACE takes no decay, no given weights and no
    soft targets (its confidences are the label's probability)."""
    weighting = LossWeighting() if weighting is None else weighting
    if not isinstance(weighting, LossWeighting):
        raise ValueError(f"weighting must be a LossWeighting, got {type(weighting).__name__}.")
    if weighting.dynamic:
        if decay_gamma is not None or weights is not None:
            raise ValueError(f"{weighting.scheme} forms its own slot weights: leave decay_gamma and weights None.")
        if soft_target != "none":
            raise ValueError(f"{weighting.scheme} weighs the cross entropy with the label; it does not apply to "
                             f"soft_target={soft_target!r}.")
    return weighting


# --------------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------------


def _f64(value, device=None) -> torch.Tensor:
    return torch.as_tensor(value, dtype=torch.float64, device=device).detach()


class AdditiveMetrics:
    """Base of dataclasses whose fields are fp64 scalar sums.

    They add up over micro-batches (`+`) and over ranks (`all_reduce`, one collective for all
    fields; `all_reduce_together` for several records in one collective); ratios are derived only
    after summing, so a micro-batch with few tokens is not over-weighted. Subclasses are dataclasses
    whose fields are all such sums.

    ``logged`` names the ratios a training log shows: ``(logged name, property)`` pairs, in order
    (`log_values`).

    ``field_widths`` names the fields that are fixed-length vectors of sums (``{name: length}``, e.g. one
    sum per block position); every other field is a scalar. The length is the class's, not the data's, so
    `zeros` can build a record without seeing one.
    """

    logged: tuple = ()
    field_widths: dict = {}

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def _shapes(cls) -> tuple[tuple, ...]:
        return tuple((cls.field_widths[n],) if n in cls.field_widths else () for n in cls.field_names())

    @classmethod
    def size(cls) -> int:
        """Number of fp64 values in a record (a vector field counts its length)."""
        return sum(math.prod(shape) for shape in cls._shapes())

    @classmethod
    def zeros(cls, device=None):
        return cls(*(torch.zeros(shape, dtype=torch.float64, device=device) for shape in cls._shapes()))

    @classmethod
    def _unstack(cls, flat: torch.Tensor):
        """The record of ``flat [size]`` (`_stack`'s inverse)."""
        shapes = cls._shapes()
        parts = flat.split([math.prod(shape) for shape in shapes])
        return cls(*(part.reshape(shape) for part, shape in zip(parts, shapes)))

    def _stack(self) -> torch.Tensor:
        return torch.cat([_f64(getattr(self, name)).reshape(-1) for name in self.field_names()])

    def __add__(self, other):
        if type(other) is not type(self):
            return NotImplemented
        mine = self._stack()
        return self._unstack(mine + other._stack().to(mine.device))

    def all_reduce(self, group=None):
        """Sum over the ranks of ``group`` (torch.distributed's default group when None) in one all-reduce."""
        return all_reduce_together([self], group)[0]

    def to(self, device) -> "AdditiveMetrics":
        """The same sums on ``device`` (one copy of all fields: e.g. to the host once before logging)."""
        return self._unstack(self._stack().to(device))

    def log_values(self) -> dict:
        """``{logged name: float}`` of the ratios in ``logged`` (synchronises with the device)."""
        return {name: float(getattr(self, attribute)) for name, attribute in self.logged}


def all_reduce_together(records, group=None) -> list:
    """Sum several `AdditiveMetrics` records (of any types) over the ranks of ``group`` in one all-reduce.

    ``group`` None is torch.distributed's default group; without an initialised process group, or on a
    single rank, the records come back as they are.
    """
    records = list(records)
    if not distributed_ready():
        return records
    if isinstance(group, SingleRankGroup) or dist.get_world_size(group) == 1:
        return records
    stacked = torch.cat([r._stack() for r in records])
    dist.all_reduce(stacked, op=dist.ReduceOp.SUM, group=group)
    out, at = [], 0
    for r in records:
        n = r.size()
        out.append(r._unstack(stacked[at : at + n]))
        at += n
    return out


@dataclass
class DFlashMetrics(AdditiveMetrics):
    """Additive fp64 scalar statistics: sum them over micro-batches, all-reduce them over data parallelism.

    Fields:
        supervised_tokens: number of supervised predicted slots (``mask`` True).
        correct_tokens: supervised slots whose draft argmax equals the label.
        acceptance_sum: sum over counted blocks of `acceptance_lengths` (bonus token included).
        valid_blocks: number of counted blocks (valid, with a supervised first predicted slot).

    Ratios are derived only after summing, so micro-batches with few tokens or blocks are not over-weighted.
    """

    supervised_tokens: torch.Tensor
    correct_tokens: torch.Tensor
    acceptance_sum: torch.Tensor
    valid_blocks: torch.Tensor

    derived = ("accuracy", "acceptance_length")  # ratios reported next to the sums
    logged = (("accuracy", "accuracy"), ("acceptance", "acceptance_length"))

    @property
    def accuracy(self) -> torch.Tensor:
        """``correct_tokens / supervised_tokens`` (0 when nothing is supervised)."""
        return self.correct_tokens / self.supervised_tokens.clamp(min=1)

    @property
    def acceptance_length(self) -> torch.Tensor:
        """Mean accepted tokens per block including the bonus token, ``acceptance_sum / valid_blocks``."""
        return self.acceptance_sum / self.valid_blocks.clamp(min=1)

    def to_dict(self) -> dict:
        """Python floats for logging (synchronises with the device)."""
        return {name: float(getattr(self, name)) for name in self.field_names() + tuple(self.derived)}


@dataclass
class EmittedPathMetrics(DFlashMetrics):
    """Statistics of a variant whose emitted tokens differ from the backbone's argmax (DFlash 2's
    selector walk, Domino's corrected walk).

    The inherited `correct_tokens` / `acceptance_sum` (and `accuracy` / `acceptance_length`)
    describe the path the draft emits at decode time, `base_*` the backbone's own argmax, on the
    same denominators, so the two compare directly. Subclasses add fields and extend `derived`.
    """

    base_correct_tokens: torch.Tensor
    base_acceptance_sum: torch.Tensor

    derived = DFlashMetrics.derived + ("base_accuracy", "base_acceptance_length")
    logged = DFlashMetrics.logged + (("base accuracy", "base_accuracy"), ("base acceptance", "base_acceptance_length"))

    @property
    def base_accuracy(self) -> torch.Tensor:
        return self.base_correct_tokens / self.supervised_tokens.clamp(min=1)

    @property
    def base_acceptance_length(self) -> torch.Tensor:
        return self.base_acceptance_sum / self.valid_blocks.clamp(min=1)

    def as_dflash_metrics(self) -> DFlashMetrics:
        """The emitted path as plain `DFlashMetrics` (what a generic loop logs)."""
        return DFlashMetrics(self.supervised_tokens, self.correct_tokens, self.acceptance_sum, self.valid_blocks)


def acceptance_lengths(
    correct: torch.Tensor,
    supervised: torch.Tensor,
    block_valid: torch.Tensor,
    *,
    first_slot: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``[B, N]`` fp32 greedy acceptance length of every block, bonus token included.

    Index ``j`` of the ``[B, N, W-1]`` inputs is predicted slot ``k = j + 1``. Counting starts at slot
    ``first_slot`` (``[B, N]``, default 1; variable-prefix training starts at the first masked slot) and
    runs over consecutive slots that are both supervised and correct; the first wrong **or unsupervised**
    slot ends it (an unsupervised gap is not evidence of acceptance). The result is that count plus one
    bonus token.

    A block is *counted* when it is valid and its first counted slot is supervised (a block with nothing to
    predict measures nothing); uncounted blocks get 0. `counted_blocks` gives the mask.
    """
    if correct.shape != supervised.shape or correct.dim() != 3 or tuple(block_valid.shape) != tuple(correct.shape[:2]):
        raise ValueError(
            f"acceptance_lengths: correct {tuple(correct.shape)} and supervised {tuple(supervised.shape)} must be "
            f"[B, N, W-1] and block_valid {tuple(block_valid.shape)} [B, N]."
        )
    ok, counted = _shifted_ok(correct, supervised, block_valid, first_slot)
    run = torch.cumprod(ok.to(torch.int32), dim=-1).sum(dim=-1)
    return torch.where(counted, run.to(torch.float32) + 1.0, torch.zeros((), device=correct.device))


def counted_blocks(supervised: torch.Tensor, block_valid: torch.Tensor, first_slot: Optional[torch.Tensor] = None):
    """``[B, N]`` bool: blocks that enter ``valid_blocks`` (valid, first counted slot supervised)."""
    return _shifted_ok(supervised, supervised, block_valid, first_slot)[1]


def _shifted_ok(correct, supervised, block_valid, first_slot):
    """(ok ``[B, N, W-1]`` re-indexed so that index 0 is ``first_slot``, counted ``[B, N]``)."""
    ok = correct.bool() & supervised.bool()
    sup = supervised.bool()
    if first_slot is not None:
        G = ok.shape[-1]
        index = torch.arange(G, device=ok.device)[None, None, :] + (first_slot.to(ok.device).long()[:, :, None] - 1)
        inside = (index >= 0) & (index < G)
        index = index.clamp(0, G - 1)
        ok = torch.gather(ok, 2, index) & inside
        sup = torch.gather(sup, 2, index) & inside
    counted = block_valid.bool() & sup[..., 0]
    return ok, counted



# --------------------------------------------------------------------------------------------------
# Slot targets: what each predicted slot is trained on
# --------------------------------------------------------------------------------------------------


@dataclass
class SlotTargets:
    """The supervision of the predicted slots of one micro-batch, the input of `objectives.head_loss.head_loss`.

    Index ``j`` of the last dimension is block slot ``first_slot + j`` (DFlash: slots ``1..W-1``; Domino with
    ``shift_label``: ``0..W-1``).

    Attributes:
        labels: ``[B, N, P]`` int64 label of each predicted slot; 0 where unsupervised (any valid id keeps
            the kernel's gathers in range without a host check).
        supervised: ``[B, N, P]`` bool.
        weights: ``[B, N, P]`` fp32 ``w * mask`` (0 where unsupervised).
        first_slot: the block slot of index 0.
        tokens: ``[B, N, W]`` the blocks' ground-truth tokens (slot 0: the anchor), unmasked, when the builder
            read them (DFlash 2's selector conditions on them).
    """

    labels: torch.Tensor
    supervised: torch.Tensor
    weights: torch.Tensor
    first_slot: int
    tokens: Optional[torch.Tensor] = None

    @classmethod
    def from_mask(cls, labels, supervised, weights, first_slot: int, tokens=None) -> "SlotTargets":
        """Zero the labels and weights of unsupervised slots."""
        supervised = supervised.bool()
        zero = torch.zeros((), device=labels.device)
        return cls(
            labels=torch.where(supervised, labels, zero.long()),
            supervised=supervised,
            weights=torch.where(supervised, weights.to(device=labels.device, dtype=torch.float32), zero),
            first_slot=first_slot,
            tokens=tokens,
        )

    def within(self, head: OutputHead) -> "SlotTargets":
        """These targets with weight 0 on slots whose label lies outside ``head``'s reduced draft vocabulary
        (docs/design.md §20 Reduced draft vocabulary): excluded from the loss and its denominator, still
        supervised (the metrics count them wrong). ``self`` without a reduced vocabulary."""
        if head.draft_vocab is None:
            return self
        _, inside = head.to_draft(self.labels)
        weights = torch.where(inside, self.weights, torch.zeros((), device=self.weights.device))
        return dataclasses.replace(self, weights=weights)

    @property
    def num_predicted(self) -> int:
        return self.labels.shape[-1]

    @property
    def weight_sum(self) -> torch.Tensor:
        """fp32 scalar ``sum(w * mask)`` (no grad): this micro-batch's share of the global denominator."""
        return self.weights.sum().to(torch.float32)

    def flat_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[B, N, W, H] -> [M, H]``, the predicted slots in the order of the flat labels."""
        first = self.first_slot
        return hidden[:, :, first : first + self.num_predicted, :].reshape(-1, hidden.shape[-1])

    @property
    def flat_labels(self) -> torch.Tensor:
        return self.labels.reshape(-1)

    @property
    def flat_weights(self) -> torch.Tensor:
        return self.weights.reshape(-1)


def slot_targets(
    input_ids: torch.Tensor,
    plan: DFlashBatchPlan,
    *,
    decay_gamma: Optional[float] = None,
    loss_mask: Optional[torch.Tensor] = None,
    weights: Optional[torch.Tensor] = None,
    prefix_lengths: Optional[torch.Tensor] = None,
    shift_label: bool = False,
    input_mask: Optional[torch.Tensor] = None,
) -> SlotTargets:
    """The DFlash supervision of slots ``1..W-1``: slot ``k`` of a block at ``p`` is labelled ``x_{p+k}``.

    With ``shift_label`` every slot ``k = 0..W-1`` predicts: it is labelled ``x_{p+k+1}`` (Domino's
    ``shift_label``, DSpark), supervised as `shifted_supervision` says (or ``loss_mask``, index ``k`` = slot
    ``k``), with weight ``exp(-k / decay_gamma)``; ``first_slot`` is 0 and ``tokens`` are then each slot's
    previous token (slot 0: the anchor).

    Args:
        input_ids: ``[B, S]`` the context tokens.
        plan: the batch plan (on the device of ``input_ids``).
        decay_gamma: slot decay length (None: uniform weights).
        loss_mask: ``[B, N, W]`` bool, default ``plan.loss_mask`` (and, with ``prefix_lengths``, only slots
            ``k >= l``). Slot 0 is never supervised, whatever the mask says.
        weights: ``[B, N, W]`` per-slot weights, default `decay_weights` (restarted at ``prefix_lengths``).
        prefix_lengths: ``[B, N]`` variable-prefix lengths ``l`` (not with ``shift_label``).
        shift_label: the shifted layout above.
        input_mask: ``[B, S]`` bool, read by the shifted layout only (the plan's ``loss_mask`` holds it for the
            positions inside the blocks): whether the token at ``p + W`` (the last slot's
            label, past the block) is supervised; None: it is, when it exists (see `shifted_supervision`).
    """
    B, N, W = plan.batch_size, plan.num_blocks, plan.block_size
    for name, tensor in (("loss_mask", loss_mask), ("weights", weights)):
        if tensor is not None and tuple(tensor.shape) != (B, N, W):
            raise ValueError(f"{name} must have shape [batch, blocks, block_size] = {(B, N, W)}, got {tuple(tensor.shape)}.")
    if shift_label:
        return _shifted_slot_targets(input_ids, plan, decay_gamma, loss_mask, weights, prefix_lengths, input_mask)
    device = input_ids.device
    slots = _slot_index(W, device)
    if loss_mask is None:
        mask = plan.loss_mask
        if prefix_lengths is not None:
            mask = mask & (slots[None, None, :] >= prefix_lengths.to(device)[:, :, None])
    else:
        mask = loss_mask.to(device).bool()
    mask = mask & (slots > 0)[None, None, :]
    if weights is None:
        weights = decay_weights(plan, decay_gamma=decay_gamma, prefix_lengths=prefix_lengths, device=device)
    tokens = block_labels(input_ids, plan)
    return SlotTargets.from_mask(tokens[:, :, 1:], mask[:, :, 1:], weights[:, :, 1:], first_slot=1, tokens=tokens)


def shifted_supervision(plan: DFlashBatchPlan, input_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[B, N, W]`` bool: which slots of the shifted layout (slot ``k`` labelled ``x_{p+k+1}``) have a label.

    Slot ``k < W-1`` labels position ``p + k + 1`` inside the block: the plan's ``loss_mask[k + 1]`` (valid
    block, the mask at that position). The last slot's label ``p + W`` lies past the block: supervised when
    ``p + W < S``, the position continues the anchor's document (``context_position_ids`` keeps counting; a
    packed document boundary restarts them) and, when ``input_mask [B, S]`` is given, ``input_mask[p + W]``.
    """
    B, S, W = plan.batch_size, plan.seq_length, plan.block_size
    device = plan.anchor_positions.device
    if input_mask is not None and tuple(input_mask.shape) != (B, S):
        raise ValueError(f"input_mask must be [batch, seq_length] = {(B, S)}, got {tuple(input_mask.shape)}.")
    last = plan.anchor_positions + W  # p + W, one past the block
    ctx_pos = plan.context_position_ids
    anchor_pos = torch.gather(ctx_pos, 1, plan.anchor_positions)
    last_pos = torch.gather(ctx_pos, 1, last.clamp(max=S - 1))
    ok = plan.block_valid & (last < S) & (last_pos == anchor_pos + W)
    if input_mask is not None:
        ok = ok & torch.gather(input_mask.to(device).bool(), 1, last.clamp(max=S - 1))
    return torch.cat([plan.loss_mask[:, :, 1:], ok[:, :, None]], dim=2).bool()


def _shifted_slot_targets(input_ids, plan, decay_gamma, loss_mask, weights, prefix_lengths, input_mask) -> SlotTargets:
    """`slot_targets` with ``shift_label``: slots ``0..W-1`` labelled ``x_{p+1..p+W}``."""
    if prefix_lengths is not None:
        raise ValueError("slot_targets: shift_label and prefix_lengths do not combine (every slot already predicts).")
    B, N, W, S = plan.batch_size, plan.num_blocks, plan.block_size, plan.seq_length
    device = input_ids.device
    label_pos = plan.anchor_positions[:, :, None] + 1 + _slot_index(W, device)
    labels = torch.gather(input_ids.long(), 1, label_pos.clamp(max=S - 1).reshape(B, N * W)).view(B, N, W)
    if loss_mask is None:
        supervised = shifted_supervision(plan, input_mask)
    else:
        supervised = loss_mask.to(device).bool() & plan.block_valid[:, :, None]
    if weights is None:
        first = torch.zeros(B, N, dtype=torch.int64, device=device)  # the decay starts at slot 0
        weights = decay_weights(plan, decay_gamma=decay_gamma, prefix_lengths=first, device=device)
    return SlotTargets.from_mask(labels, supervised, weights, first_slot=0, tokens=block_labels(input_ids, plan))


def teacher_rows(plan: DFlashBatchPlan, predicted: Optional[int] = None) -> torch.Tensor:
    """``[B * N * P]`` rows of the flattened ``[B * S, H]`` target states that distil the predicted slots:
    predicted index ``j`` (label at ``p + j + 1``) is distilled from position ``p + j``, whose next token it is.

    ``P = predicted``, default ``W - 1`` (DFlash: slot ``k = j + 1``, position ``p + k - 1``); the shifted
    layout (`slot_targets` with ``shift_label``) has ``P = W`` (slot ``k = j``, position ``p + k``).
    """
    B, S, W = plan.batch_size, plan.seq_length, plan.block_size
    P = W - 1 if predicted is None else int(predicted)
    device = plan.anchor_positions.device
    positions = (plan.anchor_positions[:, :, None] + _slot_index(P, device)[None, None, :]).clamp(0, S - 1)
    rows = torch.arange(B, device=device)[:, None, None] * S
    return (rows + positions).reshape(-1)


def check_block_hidden(hidden: torch.Tensor, plan: DFlashBatchPlan, hidden_size: Optional[int] = None) -> None:
    """``hidden`` is the ``[B, N, W, H]`` body output of ``plan`` (shapes only: no host synchronisation)."""
    if not isinstance(plan, DFlashBatchPlan):
        raise ValueError(f"plan must be a DFlashBatchPlan, got {type(plan).__name__}.")
    B, N, W = plan.batch_size, plan.num_blocks, plan.block_size
    if (not isinstance(hidden, torch.Tensor) or hidden.dim() != 4 or tuple(hidden.shape[:3]) != (B, N, W)
            or (hidden_size is not None and hidden.shape[-1] != hidden_size)):
        shape = tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__
        raise ValueError(
            f"hidden must be [batch, blocks, block_size, hidden] = [{B}, {N}, {W}, {hidden_size or 'H'}] for this "
            f"plan, got {shape}."
        )


# --------------------------------------------------------------------------------------------------
# The loss
# --------------------------------------------------------------------------------------------------


@dataclass
class DFlashLossOutput:
    """What one micro-batch contributes to the global-batch objective.

    Attributes:
        loss_sum: differentiable fp32 scalar ``sum(w * loss_per_slot * mask)``.
        weight_sum: fp32 scalar without grad, ``sum(w * mask)``. The training loss is
            ``sum(loss_sum) / sum(weight_sum)`` over every micro-batch and data-parallel rank of the
            global batch.
        metrics: additive `DFlashMetrics` of this micro-batch.
    """

    loss_sum: torch.Tensor
    weight_sum: torch.Tensor
    metrics: DFlashMetrics



def _check_soft_target(soft_target: str, temperature, teacher_hidden, plan: DFlashBatchPlan) -> None:
    """`dflash_loss`'s soft-target arguments: the kind, the temperature and the teacher's ``[B, S, H]`` states."""
    B = plan.batch_size
    if soft_target not in SOFT_TARGETS:
        raise ValueError(f"soft_target={soft_target!r} must be one of {SOFT_TARGETS}.")
    if not (isinstance(temperature, (int, float)) and temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature={temperature!r} must be a positive finite number.")
    if soft_target == "none" and temperature != 1.0:
        raise ValueError(
            f"temperature={temperature} only applies to soft targets; set soft_target='ce' or 'kl', or leave "
            "temperature at 1.0."
        )
    if soft_target != "none":
        if teacher_hidden is None:
            raise ValueError(
                f"soft_target={soft_target!r} needs teacher_hidden [B, S, H]: the target's final normed hidden "
                "states, from which the teacher logits are computed."
            )
        if teacher_hidden.dim() != 3 or tuple(teacher_hidden.shape[:2]) != (B, plan.seq_length):
            raise ValueError(
                f"teacher_hidden must be [batch, seq_length, hidden] = [{B}, {plan.seq_length}, H], got "
                f"{tuple(teacher_hidden.shape)}."
            )


def dflash_loss(
    hidden: torch.Tensor,
    plan: DFlashBatchPlan,
    input_ids: torch.Tensor,
    head: OutputHead,
    *,
    decay_gamma: Optional[float] = None,
    loss_mask: Optional[torch.Tensor] = None,
    weights: Optional[torch.Tensor] = None,
    teacher_hidden: Optional[torch.Tensor] = None,
    soft_target: str = "none",
    temperature: float = 1.0,
    chunk_slots: Optional[int] = 1024,
    prefix_lengths: Optional[torch.Tensor] = None,
    fused: Optional[bool] = None,
    weighting: Optional[LossWeighting] = None,
) -> DFlashLossOutput:
    """Decay- or D-PACE-weighted DFlash loss of one micro-batch, chunked and vocab-parallel.

    Args:
        hidden: ``[B, N, W, H]`` draft body output (any float dtype; logits are computed in fp32).
        plan: the batch plan.
        input_ids: ``[B, S]`` the context tokens; slot ``k`` of a block at ``p`` is labelled ``input_ids[p+k]``.
            Supervised labels must lie in ``[0, vocab_size)`` (not checked: it would synchronise).
        head: the target's output layer (`OutputHead`).
        decay_gamma: slot decay length (None: uniform weights).
        loss_mask: ``[B, N, W]`` bool, default ``plan.loss_mask`` (and, with ``prefix_lengths``, only slots
            ``k >= l``). Slot 0 is never supervised, whatever the mask says.
        weights: ``[B, N, W]`` per-slot weights, default `decay_weights` (restarted at ``prefix_lengths``).
        teacher_hidden: ``[B, S, H]`` the target's final normed hidden states; required for soft targets.
            Slot ``k`` of a block at ``p`` is distilled from the target's logits at ``p + k - 1`` (the
            position whose next-token distribution is the token at ``p + k``).
        soft_target: "none" (cross entropy with the label), "ce" (cross entropy against
            ``q = softmax(teacher / T)`` with the draft at ``softmax(z / T)``) or "kl" (forward
            ``KL(q || softmax(z / T))``); both soft losses are scaled by ``T**2`` so gradients keep their
            magnitude across temperatures. "ce" and "kl" differ by the teacher entropy only (same gradients).
        temperature: T > 0, soft targets only.
        chunk_slots: predicted slots per chunk (None: all in one chunk). Peak logits memory is
            ``chunk_slots x V / TP`` fp32 (plus its gradient and the soft cap's intermediates).
        prefix_lengths: ``[B, N]`` variable-prefix lengths ``l``: slots ``< l`` are inputs, not predicted;
            the default mask and weights start at ``l``, and acceptance is counted from slot ``l``.
        fused: None (default) uses the fused kernel (`objectives.head_loss._FusedHeadLoss`: the gradient w.r.t. ``hidden`` is
            formed in forward, chunk by chunk, in one reused ``[chunk_slots, V / TP]`` buffer; nothing is
            recomputed in backward) whenever the head is frozen, else the recomputing per-chunk path
            (which also gives the head's weight its gradient). True requires a frozen head; False forces
            the per-chunk path.
        weighting: the slot weighting and normalisation (`LossWeighting`; None: the static decay). A D-PACE
            scheme weighs each supervised slot by `dpace_weights` of its block's cross entropies (detached,
            formed by the kernel once every slot's loss is known) and sets ``weight_sum`` to its
            normalisation's share; it takes neither ``decay_gamma``, ``weights`` nor soft targets.

    Returns:
        `DFlashLossOutput` with ``loss_sum``, ``weight_sum`` and the metrics. Metrics: a slot is *correct*
        when its label's logit is the global maximum of its logits (the argmax, ties aside: fp32 logits
        practically never tie); see `acceptance_lengths`.

    No host synchronisation and no data-dependent shapes: every predicted slot of the batch is computed
    in ``ceil(M / chunk_slots)`` chunks, unsupervised ones with weight 0.
    """
    # ---- validation (shapes only: value checks would synchronise with the device) ----
    check_block_hidden(hidden, plan)
    check_loss_options(head, chunk_slots, fused)
    weighting = check_weighting(weighting, decay_gamma, weights, soft_target)
    B = plan.batch_size
    _check_input_ids(input_ids, plan)
    _check_prefix_lengths(prefix_lengths, plan)
    _check_soft_target(soft_target, temperature, teacher_hidden, plan)

    device = hidden.device
    plan = plan.to(device)
    targets = slot_targets(input_ids.to(device), plan, decay_gamma=decay_gamma, loss_mask=loss_mask, weights=weights,
                           prefix_lengths=prefix_lengths).within(head)
    teacher_flat = teacher_index = None
    if soft_target != "none":
        teacher_flat = teacher_hidden.to(device).reshape(B * plan.seq_length, -1)
        teacher_index = teacher_rows(plan)
    terms = head_loss(
        targets.flat_hidden(hidden), targets.flat_labels, targets.flat_weights, head, chunk_slots=chunk_slots,
        fused=fused, teacher=teacher_flat, teacher_index=teacher_index, soft_target=soft_target,
        temperature=float(temperature), row_weights=weighting.row_weights(targets),
    )
    metrics = dflash_metrics(targets, terms.base_correct, plan, prefix_lengths)
    return DFlashLossOutput(loss_sum=terms.loss_sum, weight_sum=weighting.denominator(targets, terms.weights),
                            metrics=metrics)


@torch.no_grad()
def dflash_metrics(targets: "SlotTargets", correct: torch.Tensor, plan: DFlashBatchPlan,
                   prefix_lengths: Optional[torch.Tensor] = None) -> DFlashMetrics:
    """`DFlashMetrics` of the predicted slots 1..W-1: ``correct [M]`` (or ``[B, N, W-1]``) bool per slot."""
    supervised = targets.supervised
    correct = correct.view(supervised.shape) & supervised
    acceptance = acceptance_lengths(correct, supervised, plan.block_valid, first_slot=prefix_lengths)
    counted = counted_blocks(supervised, plan.block_valid, prefix_lengths)
    return DFlashMetrics(
        supervised_tokens=supervised.sum().to(torch.float64),
        correct_tokens=correct.sum().to(torch.float64),
        acceptance_sum=acceptance.sum().to(torch.float64),
        valid_blocks=counted.sum().to(torch.float64),
    )
