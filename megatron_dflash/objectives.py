"""DFlash training objectives: block inputs, labels, loss weights, the chunked vocab-parallel loss, metrics.

Conventions (docs/design.md §2 Conventions and §6 Objectives; they must never drift from what serving does):

* a block with anchor ``p`` has ``W = gamma + 1`` slots; slot 0 holds the real anchor token ``x_p``, slots
  ``1..gamma`` the MASK token, all embedded with the **target's** input embedding times
  ``input_embedding_scale``;
* slot ``k`` predicts the token **at** ``p + k``; slot 0 is never supervised and never computed;
* slot ``k`` has loss weight ``w_k = exp(-(k - 1) / decay_gamma)`` (uniform when ``decay_gamma`` is None);
* the loss is ``sum(w * loss * mask) / sum(w * mask)`` over the **whole global batch**. The objective returns
  numerator and denominator separately (`DFlashLossOutput.loss_sum`, `.weight_sum`) and the training loop
  divides once by the global denominator, like megatron's ``calculate_per_token_loss=True``. Averaging per
  micro-batch would make the objective depend on how the global batch is split.

Memory: the loss never materialises logits of all slots. The ``M = B * N * gamma`` predicted slots are cut
into fixed-size chunks of ``chunk_slots`` rows (static shapes, no host synchronisation). With the target's
head frozen (training) the loss is fused (`_FusedHeadLoss`): each chunk's ``[chunk, V / TP]`` logits are
formed in one reused buffer, turned into the loss and then, in place, into the gradient w.r.t. the logits,
and multiplied by the head's weight into the gradient w.r.t. the hidden states; backward only scales that
by the incoming gradient, nothing is recomputed. A trainable head takes the per-chunk path under
activation recomputation instead. Either way the peak is one chunk of logits whatever the number of slots.
Unsupervised slots inside a chunk are computed and weighted by zero.

Vocab-parallel cross entropy (same scheme as megatron's ``vocab_parallel_cross_entropy``, written here with
an explicit group because megatron's reads ``parallel_state``): local max -> all-reduce MAX; sum of
``exp(z - max)`` and the target's shifted logit (taken on the shard that owns it) -> one all-reduce SUM;
``nll = log(sum_exp) - z_target``; the backward is analytical, ``softmax - onehot``, from the saved local
softmax. Each rank's gradient w.r.t. the (replicated) hidden states covers only its vocabulary shard;
`OutputHead.local_logits` sums it over the TP group in backward.

Shapes: B batch, S context length, N blocks per row, W block size, H hidden size, V vocabulary (local
shard: ``V / TP``), M = B * N * (W - 1) predicted slots.
"""

from __future__ import annotations

import math
import dataclasses
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .head import OutputHead
from .parallel import SingleRankGroup, is_distributed_group
from .plan import DFlashBatchPlan

__all__ = [
    "OutputHead",
    "block_tokens",
    "embed_blocks",
    "block_labels",
    "decay_weights",
    "DFlashMetrics",
    "acceptance_lengths",
    "counted_blocks",
    "DFlashLossOutput",
    "dflash_loss",
    "SOFT_TARGETS",
]

SOFT_TARGETS = ("none", "ce", "kl")
# Sentinel above any vocabulary index, for the MIN all-reduce that picks the global argmax.
_NO_INDEX = torch.iinfo(torch.int64).max


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


# --------------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------------


def _f64(value, device=None) -> torch.Tensor:
    return torch.as_tensor(value, dtype=torch.float64, device=device).detach()


class AdditiveMetrics:
    """Base of dataclasses whose fields are fp64 scalar sums.

    They add up over micro-batches (`+`) and over ranks (`all_reduce`, one collective for all
    fields); ratios are derived only after summing, so a micro-batch with few tokens is not
    over-weighted. Subclasses are dataclasses whose fields are all such sums.
    """

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def zeros(cls, device=None):
        return cls(*(torch.zeros((), dtype=torch.float64, device=device) for _ in cls.field_names()))

    def _stack(self) -> torch.Tensor:
        return torch.stack([_f64(getattr(self, name)) for name in self.field_names()])

    def __add__(self, other):
        if type(other) is not type(self):
            return NotImplemented
        mine = self._stack()
        return type(self)(*(mine + other._stack().to(mine.device)).unbind())

    def all_reduce(self, group=None):
        """Sum over the ranks of ``group`` (torch.distributed's default group when None) in one all-reduce."""
        if not (dist.is_available() and dist.is_initialized()):
            return self
        if isinstance(group, SingleRankGroup) or dist.get_world_size(group) == 1:
            return self
        stacked = self._stack().clone()
        dist.all_reduce(stacked, op=dist.ReduceOp.SUM, group=group)
        return type(self)(*stacked.unbind())


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
# Vocab-parallel cross entropy (hard or soft targets) with global argmax
# --------------------------------------------------------------------------------------------------


def _all_reduce(tensor: torch.Tensor, op, group) -> torch.Tensor:
    if is_distributed_group(group):
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-row ``logsumexp(z) - sum_v q_v z_v`` over a vocabulary split across ``group``.

    Hard targets: ``q`` = one-hot of ``target`` (given as indices). Soft targets: ``q = target_probs``, the
    local shard of a distribution. Also returns the global argmax of ``z`` (ties: smallest index) as a
    non-differentiable output. Backward: ``(softmax(z) - q) * grad``.
    """

    @staticmethod
    def forward(ctx, logits, target, target_probs, vocab_start, group):
        # logits: [c, Vl] fp32; target: [c] int64 or None; target_probs: [c, Vl] or None.
        rows = torch.arange(logits.shape[0], device=logits.device)
        local_max, local_arg = logits.max(dim=-1)
        global_max = _all_reduce(local_max.clone(), dist.ReduceOp.MAX, group)
        # One [c, Vl] buffer: exp(z - max) computed in place (it becomes the saved softmax).
        exp = torch.sub(logits, global_max[:, None]).exp_()
        zero = torch.zeros((), device=logits.device)
        if target_probs is None:
            local_target = target - vocab_start
            owned = (local_target >= 0) & (local_target < logits.shape[-1])
            local_target = local_target.clamp(0, logits.shape[-1] - 1)
            picked = torch.where(owned, logits[rows, local_target] - global_max, zero)
        else:
            # sum_v q_v (z_v - max); 0 * -inf (padding columns) must count as 0.
            picked = torch.where(target_probs > 0, target_probs * logits, zero).sum(-1)
            picked = picked - global_max * target_probs.sum(-1)
        sums = _all_reduce(torch.stack([exp.sum(dim=-1), picked]), dist.ReduceOp.SUM, group)
        sum_exp, target_logit = sums[0], sums[1]
        loss = torch.log(sum_exp) - target_logit
        # Global argmax: only a shard whose max equals the global max offers its first maximal index.
        candidate = torch.where(
            local_max == global_max,
            local_arg + vocab_start,
            torch.full((), _NO_INDEX, dtype=torch.int64, device=logits.device),
        )
        argmax = _all_reduce(candidate, dist.ReduceOp.MIN, group)
        softmax = exp.div_(sum_exp[:, None])
        if target_probs is None:
            ctx.save_for_backward(softmax, local_target, owned)
        else:
            ctx.save_for_backward(softmax, target_probs)
        ctx.hard = target_probs is None
        ctx.mark_non_differentiable(argmax)
        return loss, argmax

    @staticmethod
    def backward(ctx, grad_loss, grad_argmax):
        # The saved softmax is used once (and recomputed under activation checkpointing), so the
        # gradient is formed in its buffer, as megatron's vocab-parallel cross entropy does.
        if ctx.hard:
            grad, local_target, owned = ctx.saved_tensors
            rows = torch.arange(grad.shape[0], device=grad.device)
            grad[rows, local_target] -= owned.to(grad.dtype)
        else:
            grad, target_probs = ctx.saved_tensors
            grad.sub_(target_probs)
        grad.mul_(grad_loss[:, None])
        return grad, None, None, None, None


def _vocab_parallel_softmax(logits: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """Local shard of ``softmax(logits)`` over the split vocabulary and ``sum_v q_v log q_v`` per row."""
    global_max = _all_reduce(logits.max(dim=-1).values.clone(), dist.ReduceOp.MAX, group)
    shifted = logits - global_max[:, None]
    exp = shifted.exp()
    sum_exp = _all_reduce(exp.sum(dim=-1), dist.ReduceOp.SUM, group)
    probs = exp / sum_exp[:, None]
    # sum q log q = sum q * shifted - log(sum_exp); padding columns have q = 0 and shifted = -inf.
    q_shifted = torch.where(probs > 0, probs * shifted, torch.zeros((), device=logits.device)).sum(-1)
    q_shifted = _all_reduce(q_shifted, dist.ReduceOp.SUM, group)
    return probs, q_shifted - torch.log(sum_exp)


# --------------------------------------------------------------------------------------------------
# The fused head loss: gradient w.r.t. the hidden states formed in forward, chunk by chunk
# --------------------------------------------------------------------------------------------------


def _row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``[c, V] x [c, V] -> [c]`` row-wise dot product without a ``[c, V]`` temporary."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


class _FusedHeadLoss(torch.autograd.Function):
    """``sum_r w_r * loss_r`` over the slots of a frozen, vocab-parallel head, with the gradients computed in
    forward.

    The objective is a plain weighted sum, so its gradient w.r.t. the hidden states ``dH [M, H]`` does not
    depend on anything after the loss except one scalar (the incoming gradient). Each chunk of ``c`` rows
    runs: logits into one reused ``[c, V_real]`` fp32 buffer (``V_real``: this shard's columns below
    ``vocab_size``; padding columns are never formed, they carry probability 0) -> output transform in
    place -> ``amax`` and its MAX all-reduce -> picked logits -> ``exp`` in place -> SUM all-reduce ->
    per-row loss -> ``(softmax - q) * coefficient`` in place -> ``dH[rows] = G @ W_real``. Backward only
    scales ``dH`` and sums it over the TP group (each rank's ``dH`` covers its vocabulary shard), the
    all-reduce `OutputHead.local_logits` does. The head's weight gets no gradient: callers use this path
    only for a frozen head.

    Per-row loss: hard targets ``lse(z) - z[label]``; soft targets ``T^2 (lse(z) - sum_v q_v z_v)`` with
    ``z`` the logits over ``T`` and ``q = softmax(teacher / T)``, plus ``T^2 sum_v q_v log q_v`` for "kl".
    A row is *correct* when its label's logit equals the global row maximum (``z[label] - max == 0``
    exactly; ties, which fp32 logits practically never produce, count as correct).

    Domino (``features``/``shard`` given, hard targets): a second set of logits ``final = base + features @
    shard^T`` (the delta added after the output transform) in a second buffer, and the loss
    ``(1 - mix) * final_CE + mix * base_CE``; the gradients w.r.t. ``features [M, E]`` and ``shard
    [V_local, E]`` are formed in forward too (``shard``'s accumulated over the chunks).

    Inputs: hidden ``[M, H]``, labels ``[M]`` int64 (any valid id on unsupervised rows), weights ``[M]``
    fp32 (0: unsupervised), teacher ``[M_t, H]`` and teacher_index ``[M]`` or None, features ``[M, E]`` and
    shard ``[V_local, E]`` or None, mix (Domino's ``lambda_base``).
    Outputs: loss_sum (fp32 scalar), then, non-differentiable, the base loss sum, the final loss sum (0
    without Domino), correct ``[M]`` bool of the base logits and of the final ones (the base's without Domino).
    """

    @staticmethod
    def forward(ctx, hidden, labels, weights, teacher, teacher_index, features, shard, head, soft_target,
                temperature, mix, chunk, with_grad):
        group = head.tp_group
        weight = head.weight if head.weight is not None else head.layer.weight
        bias = getattr(head.layer, "bias", None)
        start = head.vocab_range[0]
        real = max(0, min(head.local_vocab_size, head.vocab_size - start))  # this shard's real columns
        weight = weight[:real]
        bias = bias[:real].float() if bias is not None else None
        soft = soft_target != "none"
        domino = features is not None
        cap = head.final_logit_softcapping
        multiplier = float(head.output_multiplier)
        M = hidden.shape[0]
        device = hidden.device
        rows_max = max(1, min(chunk, M))
        # The reused buffers: logits (turned into exp, then into the gradient), and for soft targets the
        # teacher's, for Domino the final logits, for the soft cap its tanh (needed for the chain rule).
        logits_buf = torch.empty(rows_max, real, dtype=torch.float32, device=device)
        second_buf = torch.empty_like(logits_buf) if soft or domino else None
        tanh_buf = torch.empty_like(logits_buf) if cap is not None else None
        grad_hidden = torch.empty(M if with_grad else 0, hidden.shape[-1], dtype=weight.dtype, device=device)
        if domino:
            shard_real = shard[:real].float()
            grad_features = torch.empty(M if with_grad else 0, features.shape[-1], dtype=torch.float32, device=device)
            grad_shard = torch.zeros(shard.shape, dtype=torch.float32, device=device)
        zero = torch.zeros((), device=device)
        base_sum = torch.zeros((), dtype=torch.float32, device=device)
        final_sum = torch.zeros((), dtype=torch.float32, device=device)
        base_correct = torch.empty(M, dtype=torch.bool, device=device)
        final_correct = torch.empty(M, dtype=torch.bool, device=device) if domino else base_correct
        scale = temperature * temperature if soft else 1.0
        # d loss_r / d logits after the transform = (softmax - q) * w * T^2 / T (soft: T^2 scales the loss,
        # 1/T comes from z / T). The transform's own factor (multiplier, tanh') follows; without Domino the
        # multiplier is folded into the row factor (one pass less).
        base_factor = (mix if domino else 1.0) * scale / temperature * (1.0 if domino else multiplier)
        final_factor = 1.0 - mix

        def transformed_logits(h, out, tanh_out):
            """``out <- transform(h @ W_real^T + b) / T`` in place; returns the view of ``n`` rows."""
            n = h.shape[0]
            out = out[:n]
            if weight.dtype == torch.float32:
                torch.matmul(h.to(torch.float32), weight.t(), out=out)
            else:
                out.copy_(F.linear(h.to(weight.dtype), weight))
            if bias is not None:
                out.add_(bias)
            if cap is not None:
                t = tanh_out[:n] if tanh_out is not None else out
                torch.tanh(out.mul_(multiplier / cap), out=t)
                if t is not out:
                    out.copy_(t)
                out.mul_(cap / temperature)
            elif multiplier / temperature != 1.0:
                out.mul_(multiplier / temperature)
            return out

        def cross_entropy_to_grad(z, label, owned, q, row):
            """Per-row loss and correctness of logits ``z``; ``z`` becomes ``(softmax - q) * row`` in place
            (``q``: the soft target, or the one-hot of ``label`` when None)."""
            n = z.shape[0]
            z_max = _all_reduce(_row_amax(z), dist.ReduceOp.MAX, group)
            label_shifted = torch.where(owned, z.gather(1, label)[:, 0] - z_max, zero) if real else zero.expand(n)
            if q is not None:
                picked = _row_dot(q, z) - z_max * q.sum(dim=-1)
            z.sub_(z_max[:, None]).exp_()
            stats = [z.sum(dim=-1), label_shifted] + ([picked] if q is not None else [])
            stats = _all_reduce(torch.stack(stats), dist.ReduceOp.SUM, group)
            sum_exp = stats[0]
            loss = torch.log(sum_exp) - (stats[2] if q is not None else stats[1])
            if with_grad:
                # exp * (row / sum_exp), then - q * row: as few passes over the buffer as possible.
                z.mul_((row / sum_exp)[:, None])
                if q is not None:
                    z.addcmul_(q, row[:, None], value=-1.0)
                elif real:
                    z.scatter_add_(1, label, -(owned * row).to(z.dtype)[:, None])
            return loss, stats[1] == 0

        for lo in range(0, M, rows_max):
            hi = min(lo + rows_max, M)
            n = hi - lo
            w = weights[lo:hi]
            label = labels[lo:hi] - start
            owned = (label >= 0) & (label < real)
            label = label.clamp(0, max(real - 1, 0))[:, None]
            q = None
            if soft:
                # Teacher: q = softmax(t), and sum_v q_v log q_v = sum_v q_v (t_v - tmax) - log(sum exp).
                t = transformed_logits(teacher.index_select(0, teacher_index[lo:hi]), second_buf, None)
                t_max = _all_reduce(_row_amax(t), dist.ReduceOp.MAX, group)
                t.sub_(t_max[:, None])
                e = logits_buf[:n]  # scratch for exp(t - tmax) until the draft's logits are formed
                torch.exp(t, out=e)
                t_stats = _all_reduce(torch.stack([e.sum(dim=-1), _row_dot(e, t)]), dist.ReduceOp.SUM, group)
                neg_entropy = t_stats[1] / t_stats[0] - torch.log(t_stats[0])
                q = t.copy_(e).div_(t_stats[0][:, None])
            z = transformed_logits(hidden[lo:hi], logits_buf, tanh_buf)
            if domino:
                final = second_buf[:n].copy_(z).addmm_(features[lo:hi].float(), shard_real.t())
            loss, base_correct[lo:hi] = cross_entropy_to_grad(z, label, owned, q, w * base_factor)
            if soft_target == "kl":
                loss = loss + neg_entropy
            # `where`, not a product: an unsupervised slot's loss may be inf and 0 * inf is NaN.
            base_sum += torch.where(w != 0, loss * (w * scale), zero).sum()
            if domino:
                loss, final_correct[lo:hi] = cross_entropy_to_grad(final, label, owned, None, w * final_factor)
                final_sum += torch.where(w != 0, loss * w, zero).sum()
            if not with_grad:
                continue
            if domino:
                # `final` holds d loss / d final logits = d loss / d delta; it joins the base gradient.
                torch.matmul(final, shard_real, out=grad_features[lo:hi])
                grad_shard[:real].addmm_(final.t(), features[lo:hi].float())
                z.add_(final)
                if multiplier != 1.0:
                    z.mul_(multiplier)
            if cap is not None:
                th = tanh_buf[:n]
                z.mul_(th.mul_(th).neg_().add_(1.0))
            if weight.dtype == torch.float32:
                torch.matmul(z, weight, out=grad_hidden[lo:hi])
            else:
                grad_hidden[lo:hi] = z.to(weight.dtype) @ weight
        if domino:
            loss_sum = mix * base_sum + (1.0 - mix) * final_sum
            ctx.save_for_backward(grad_hidden, grad_features, grad_shard)
            ctx.dtypes = (hidden.dtype, features.dtype, shard.dtype)
        else:
            loss_sum = base_sum.clone()
            ctx.save_for_backward(grad_hidden)
            ctx.dtypes = (hidden.dtype,)
        ctx.group = group
        ctx.mark_non_differentiable(base_sum, final_sum, base_correct, final_correct)
        return loss_sum, base_sum, final_sum, base_correct, final_correct

    @staticmethod
    def backward(ctx, grad_loss_sum, *unused):
        grads = []
        for index, (saved, dtype) in enumerate(zip(ctx.saved_tensors, ctx.dtypes)):
            grad = saved.mul_(grad_loss_sum.to(saved.dtype))  # saved once, used once
            if index < 2:  # hidden states and features are replicated: each rank's part covers its shard
                grad = _all_reduce(grad, dist.ReduceOp.SUM, ctx.group)
            grads.append(grad.to(dtype))
        grad_hidden = grads[0]
        grad_features, grad_shard = grads[1:] if len(grads) == 3 else (None, None)
        return (grad_hidden, None, None, None, None, grad_features, grad_shard) + (None,) * 6


def _row_amax(logits: torch.Tensor) -> torch.Tensor:
    """Row maximum (``amax``: no indices, several times cheaper than ``max``); -inf for a shard without
    real columns."""
    if logits.shape[-1] == 0:
        return torch.full(logits.shape[:-1], float("-inf"), device=logits.device)
    return logits.amax(dim=-1)



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


def _chunk_loss(head: OutputHead, soft_target: str, temperature: float, teacher_flat: Optional[torch.Tensor]):
    """The per-chunk computation run under activation recomputation.

    ``(h [c, H], labels [c], weights [c], teacher_index [c] or None) -> (weighted loss sum, argmax [c])``.
    """
    start = head.vocab_range[0]
    group = head.tp_group

    def run(h, labels, weights, teacher_index):
        logits = head.local_logits(h)
        if temperature != 1.0:
            logits = logits / temperature
        probs = neg_entropy = None
        if soft_target != "none":
            with torch.no_grad():
                teacher = head.local_logits(teacher_flat.index_select(0, teacher_index))
                if temperature != 1.0:
                    teacher = teacher / temperature
                probs, neg_entropy = _vocab_parallel_softmax(teacher, group)
        loss, argmax = _VocabParallelCrossEntropy.apply(logits, labels, probs, start, group)
        if soft_target == "kl":
            loss = loss + neg_entropy  # KL(q || p) = CE(q, p) - H(q)
        if soft_target != "none" and temperature != 1.0:
            loss = loss * (temperature * temperature)
        # `where`, not a product: an unsupervised slot's loss may be inf and 0 * inf is NaN.
        weighted = torch.where(weights != 0, loss * weights, torch.zeros((), device=loss.device))
        return weighted.sum(), argmax

    return run


def _chunked_head_loss(flat_hidden, flat_labels, flat_weights, teacher_flat, teacher_index, head, soft_target,
                       temperature, size, *, recompute):
    """The per-chunk path: each chunk's logits and loss under activation recomputation (the head may train).

    Returns ``(loss_sum, argmax [M])``.
    """
    M = flat_hidden.shape[0]
    run = _chunk_loss(head, soft_target, temperature, teacher_flat)
    loss_sum = flat_hidden.new_zeros((), dtype=torch.float32)
    argmaxes = []
    pieces = zip(
        flat_hidden.split(size),
        flat_labels.split(size),
        flat_weights.split(size),
        teacher_index.split(size) if teacher_index is not None else [None] * math.ceil(M / size),
    )
    for h, lab, w, t in pieces:
        if recompute:
            part, argmax = checkpoint(run, h, lab, w, t, use_reentrant=False)
        else:
            part, argmax = run(h, lab, w, t)
        loss_sum = loss_sum + part
        argmaxes.append(argmax)
    return loss_sum, torch.cat(argmaxes)


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
) -> DFlashLossOutput:
    """Decay-weighted DFlash loss of one micro-batch, chunked and vocab-parallel.

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
        fused: None (default) uses the fused kernel (`_FusedHeadLoss`: the gradient w.r.t. ``hidden`` is
            formed in forward, chunk by chunk, in one reused ``[chunk_slots, V / TP]`` buffer; nothing is
            recomputed in backward) whenever the head is frozen, else the recomputing per-chunk path
            (which also gives the head's weight its gradient). True requires a frozen head; False forces
            the per-chunk path.

    Returns:
        `DFlashLossOutput` with ``loss_sum``, ``weight_sum`` and the metrics. Metrics: a slot is *correct*
        when its label's logit is the global maximum of its logits (the argmax, ties aside: fp32 logits
        practically never tie); see `acceptance_lengths`.

    No host synchronisation and no data-dependent shapes: every predicted slot of the batch is computed
    in ``ceil(M / chunk_slots)`` chunks, unsupervised ones with weight 0.
    """
    # ---- validation (shapes only: value checks would synchronise with the device) ----
    if not isinstance(plan, DFlashBatchPlan):
        raise ValueError(f"plan must be a DFlashBatchPlan, got {type(plan).__name__}.")
    if not isinstance(head, OutputHead):
        raise ValueError(f"head must be an OutputHead, got {type(head).__name__}; wrap the output layer in OutputHead.")
    B, N, W = plan.batch_size, plan.num_blocks, plan.block_size
    if hidden.dim() != 4 or tuple(hidden.shape[:3]) != (B, N, W):
        raise ValueError(
            f"hidden must be [batch, blocks, block_size, hidden] = [{B}, {N}, {W}, H] for this plan, got "
            f"{tuple(hidden.shape)}."
        )
    H = hidden.shape[-1]
    _check_input_ids(input_ids, plan)
    _check_prefix_lengths(prefix_lengths, plan)
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
    if chunk_slots is not None and (isinstance(chunk_slots, bool) or not isinstance(chunk_slots, int) or chunk_slots < 1):
        raise ValueError(f"chunk_slots={chunk_slots!r} must be a positive int or None (one chunk).")
    if fused not in (None, True, False):
        raise ValueError(f"fused={fused!r} must be None (automatic), True or False.")
    if fused and head.requires_grad():
        raise ValueError(
            "fused=True needs a frozen output head (the fused loss gives the head's weight no gradient); "
            "freeze the head or pass fused=None / False."
        )
    for name, tensor in (("loss_mask", loss_mask), ("weights", weights)):
        if tensor is not None and tuple(tensor.shape) != (B, N, W):
            raise ValueError(f"{name} must have shape [batch, blocks, block_size] = {(B, N, W)}, got {tuple(tensor.shape)}.")

    device = hidden.device
    plan = plan.to(device)
    input_ids = input_ids.to(device)
    slots = _slot_index(W, device)

    # ---- what is supervised, with which weight ----
    if loss_mask is None:
        mask = plan.loss_mask
        if prefix_lengths is not None:
            mask = mask & (slots[None, None, :] >= prefix_lengths.to(device)[:, :, None])
    else:
        mask = loss_mask.to(device).bool()
    mask = mask & (slots > 0)[None, None, :]
    if weights is None:
        weights = decay_weights(plan, decay_gamma=decay_gamma, prefix_lengths=prefix_lengths, device=device)
    else:
        weights = weights.to(device=device, dtype=torch.float32)
    effective = torch.where(mask, weights, torch.zeros((), device=device))  # [B, N, W]

    # ---- flatten the predicted slots 1..W-1 ----
    G = W - 1
    M = B * N * G
    labels = block_labels(input_ids, plan)
    labels = torch.where(mask, labels, torch.zeros((), dtype=torch.int64, device=device))  # masked: any valid id
    flat_hidden = hidden[:, :, 1:, :].reshape(M, H)
    flat_labels = labels[:, :, 1:].reshape(M)
    flat_weights = effective[:, :, 1:].reshape(M)
    teacher_flat = teacher_index = None
    if soft_target != "none":
        teacher_flat = teacher_hidden.to(device).reshape(B * plan.seq_length, -1)
        # Target position p + k - 1 predicts the token at p + k.
        positions = (plan.anchor_positions[:, :, None] + slots[None, None, 1:] - 1).clamp(0, plan.seq_length - 1)
        rows = torch.arange(B, device=device)[:, None, None] * plan.seq_length
        teacher_index = (rows + positions).reshape(M)

    # ---- chunks ----
    size = M if chunk_slots is None else min(chunk_slots, M)
    if fused is None:
        fused = not head.requires_grad()
    if fused:
        with_grad = torch.is_grad_enabled() and hidden.requires_grad
        loss_sum, _, _, label_is_max, _ = _FusedHeadLoss.apply(
            flat_hidden, flat_labels, flat_weights, teacher_flat, teacher_index, None, None, head, soft_target,
            float(temperature), 0.0, size, with_grad,
        )
        label_is_max = label_is_max.view(B, N, G)
    else:
        loss_sum, label_is_max = _chunked_head_loss(
            flat_hidden, flat_labels, flat_weights, teacher_flat, teacher_index, head, soft_target,
            float(temperature), size, recompute=torch.is_grad_enabled() and (hidden.requires_grad or head.requires_grad()),
        )
        label_is_max = label_is_max.view(B, N, G) == labels[:, :, 1:]

    # ---- metrics ----
    with torch.no_grad():
        supervised = mask[:, :, 1:]
        correct = label_is_max & supervised
        acceptance = acceptance_lengths(correct, supervised, plan.block_valid, first_slot=prefix_lengths)
        counted = counted_blocks(supervised, plan.block_valid, prefix_lengths)
        metrics = DFlashMetrics(
            supervised_tokens=supervised.sum().to(torch.float64),
            correct_tokens=correct.sum().to(torch.float64),
            acceptance_sum=acceptance.sum().to(torch.float64),
            valid_blocks=counted.sum().to(torch.float64),
        )
        weight_sum = effective.sum().to(torch.float32)
    return DFlashLossOutput(loss_sum=loss_sum, weight_sum=weight_sum, metrics=metrics)
