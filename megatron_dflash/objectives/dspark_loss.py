"""The DSpark objective: cross entropy, L1 distance to the target's distribution and a confidence BCE,
in one fused chunked vocab-parallel kernel (docs/design.md §6 Objectives).

Layout (the shifted one, `objectives.dflash_loss.slot_targets` with ``shift_label``): a block at anchor ``p``
has ``W`` slots with input ``[x_p, MASK, ..., MASK]``; slot ``k = 0..W-1`` predicts ``x_{p+k+1}``, so every
slot proposes a token. Supervision is cut at the block's first unsupervised slot (`dspark_slot_targets`):
a token after a gap cannot be accepted, so it is not trained either (the sequence end, a document end and
the input mask all cut the block).

Per slot, with the draft's logits ``z = transform(h W^T) + W2 m`` (``m [r]`` the Markov feature of the
slot, given by the model; ``W2 = markov_w2 [V, r]``; no Markov head: no ``W2 m``), the target's own
next-token logits ``t = transform(g W^T)`` (``g``: the target's final normed hidden state at ``p + k``,
whose next token is the label), ``p = softmax(z)``, ``q = softmax(t)``:

* ``CE = logsumexp(z) - z[label]``;
* ``L1 = sum_v |p_v - q_v|`` (twice the total variation distance);
* ``BCE = BCE_with_logits(c, a)`` of the confidence logit ``c`` against ``a = clamp(1 - L1 / 2, 0, 1)``
  (detached): ``a`` is the probability that speculative sampling accepts the slot's token;

and the micro-batch returns ``loss_sum = sum_k w_k (ce_weight CE_k + l1_weight L1_k + bce_weight BCE_k)``
with ``w_k = exp(-k / decay_gamma)`` times the supervision, and ``weight_sum = sum_k w_k``. The three terms
of the reference are each normalised by the same weight sum (the decayed mask: NeMo AutoModel's
``ce_loss_den``, ``l1_loss_den`` and ``confidence_loss_den`` are one number), so the engine's one global
division ``sum(loss_sum) / sum(weight_sum)`` is exactly ``ce_weight CE + l1_weight L1 + bce_weight BCE``,
each term normalised globally (the reference adds ``1e-6`` to each denominator; nothing else differs).

The kernel (`_FusedDSparkLoss`, a frozen target head): for each chunk of ``c`` slots, in two reused
``[c, V_real]`` fp32 buffers (a third for the soft cap's tanh), with no ``[slots, V]`` tensor kept:

1. *logits*: ``t`` (teacher head matmul) and ``z`` (draft head matmul, plus ``m @ W2_real^T``); one MAX
   all-reduce of both rows' maxima; ``exp`` in place; one SUM all-reduce of both sums of exponentials and
   the label's shifted logit -> ``CE``, ``p`` and ``q`` in the buffers;
2. *L1*: ``q <- p - q`` in place, its L1 norm, then ``sign`` in place and ``sum_v p_v s_v``; one SUM
   all-reduce -> ``L1`` and the global ``S = sum_v p_v s_v`` the L1 gradient needs;
3. *gradients*: ``G = w (ce_weight (p - onehot) + l1_weight p (s - S))`` in the sign buffer
   (``d L1 / d z_j = p_j (s_j - S)``, ``s = sign(p - q)``), then ``d m = G W2_real``, ``d W2_real += G^T m``
   (accumulated over the chunks) and ``d h = (G * transform') W_real``.

Three head matmuls per chunk (``t``, ``z``, ``G W``), which is the minimum without keeping logits: the
teacher's and the draft's logits come from different hidden states, and ``d h`` needs one product with the
head whatever else is kept; the L1 gradient's global ``S`` is available before the buffers are released
because both softmaxes stay in them through the three all-reduces. Nothing is recomputed in backward,
which only scales the gradients and sums those of the replicated ``h`` and ``m`` over the TP group (each
rank's covers its vocabulary shard). ``markov_w2``'s rows are the head's local shard (``head.vocab_range``,
padding rows included; they get gradient 0). The BCE term is a function of ``[M]`` scalars and goes through
autograd as it is.

Shapes: B batch, S context length, N blocks per row, W block size, H hidden size, r Markov rank,
V vocabulary (local shard ``V / TP``), M = B * N * W predicted slots, c slots per chunk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..plan.batch_plan import DFlashBatchPlan
from ..target.head import OutputHead
from .dflash_loss import (
    DFlashMetrics,
    LossWeighting,
    SlotTargets,
    acceptance_lengths,
    check_block_hidden,
    check_weighting,
    counted_blocks,
    dpace_weights,
    slot_targets,
    teacher_rows,
)
from .head_loss import LocalHead, all_reduce_in_group, check_loss_options, row_amax, row_dot, transformed_logits

__all__ = ["METRIC_POSITIONS", "DSparkMetrics", "DSparkLossOutput", "dspark_slot_targets", "dspark_loss",
           "dspark_metrics", "dspark_row_weights"]

# Block positions the per-position acceptance metrics hold (a record's length is its class's: see
# `AdditiveMetrics.field_widths`); DSpark blocks are 7 in the published recipe.
METRIC_POSITIONS = 32


# --------------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------------


@dataclass
class DSparkMetrics(DFlashMetrics):
    """Additive fp64 statistics of the DSpark objective (sum over micro-batches and data parallelism).

    Fields (the first four as `DFlashMetrics`, over all ``W`` predicting slots; a slot is correct when its
    label's logit, Markov bias included, is the row maximum; acceptance is teacher-forced greedy):
        accept_rate_sums: ``[METRIC_POSITIONS]`` per block position ``k``, the sum over supervised slots of
            ``a = clamp(1 - L1 / 2, 0, 1)``, the speculative-sampling acceptance probability of the slot.
        accept_rate_counts: ``[METRIC_POSITIONS]`` the supervised slots at position ``k``.
        expected_acceptance_sum: sum over counted blocks of ``1 + sum_k prod_{i <= k} a_i``, the expected
            accepted length (the bonus token included); ``valid_blocks`` is its denominator.
        loss_weight_sum: ``sum(w * mask)``, the shared denominator of the three terms.
        ce_loss_sum, l1_loss_sum, bce_loss_sum: the weighted numerators of the three terms.
        confidence_weight_sum: ``sum(w * mask)`` when a confidence head is trained, else 0.
        confidence_abs_error_sum, confidence_bias_sum: ``sum w |sigmoid(c) - a|`` and ``sum w (sigmoid(c) - a)``.
        confidence_cumprod_bias_sum: ``sum w (prod_{i <= k} sigmoid(c_i) - prod_{i <= k} a_i)``: the
            calibration of the prefix products a confidence schedule thresholds.
    """

    accept_rate_sums: torch.Tensor
    accept_rate_counts: torch.Tensor
    expected_acceptance_sum: torch.Tensor
    loss_weight_sum: torch.Tensor
    ce_loss_sum: torch.Tensor
    l1_loss_sum: torch.Tensor
    bce_loss_sum: torch.Tensor
    confidence_weight_sum: torch.Tensor
    confidence_abs_error_sum: torch.Tensor
    confidence_bias_sum: torch.Tensor
    confidence_cumprod_bias_sum: torch.Tensor

    field_widths = {"accept_rate_sums": METRIC_POSITIONS, "accept_rate_counts": METRIC_POSITIONS}
    derived = DFlashMetrics.derived + ("expected_acceptance", "accept_rate", "ce_loss", "l1_loss", "bce_loss",
                                       "confidence_abs_error", "confidence_bias", "confidence_cumprod_bias")
    logged = DFlashMetrics.logged + (("tau", "expected_acceptance"), ("accept rate", "accept_rate"),
                                     ("ce loss", "ce_loss"), ("l1 loss", "l1_loss"))
    confidence_logged = (("bce loss", "bce_loss"), ("confidence error", "confidence_abs_error"),
                         ("confidence bias", "confidence_bias"),
                         ("confidence cumprod bias", "confidence_cumprod_bias"))

    @property
    def expected_acceptance(self) -> torch.Tensor:
        """Expected accepted tokens per block (tau), the bonus token included."""
        return self.expected_acceptance_sum / self.valid_blocks.clamp(min=1)

    @property
    def accept_rate(self) -> torch.Tensor:
        """Mean acceptance probability over every supervised slot."""
        return self.accept_rate_sums.sum() / self.accept_rate_counts.sum().clamp(min=1)

    def accept_rate_at(self, k: int) -> torch.Tensor:
        """Mean acceptance probability of block position ``k`` (the reference's ``accept_rate@k``)."""
        return self.accept_rate_sums[k] / self.accept_rate_counts[k].clamp(min=1)

    def _per_weight(self, value: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return value / weight.clamp(min=1e-12)

    @property
    def ce_loss(self) -> torch.Tensor:
        return self._per_weight(self.ce_loss_sum, self.loss_weight_sum)

    @property
    def l1_loss(self) -> torch.Tensor:
        return self._per_weight(self.l1_loss_sum, self.loss_weight_sum)

    @property
    def bce_loss(self) -> torch.Tensor:
        return self._per_weight(self.bce_loss_sum, self.loss_weight_sum)

    @property
    def confidence_abs_error(self) -> torch.Tensor:
        return self._per_weight(self.confidence_abs_error_sum, self.confidence_weight_sum)

    @property
    def confidence_bias(self) -> torch.Tensor:
        return self._per_weight(self.confidence_bias_sum, self.confidence_weight_sum)

    @property
    def confidence_cumprod_bias(self) -> torch.Tensor:
        return self._per_weight(self.confidence_cumprod_bias_sum, self.confidence_weight_sum)

    def log_values(self) -> dict:
        """`logged`, then ``accept_rate@k`` of each position that has supervised slots, then the confidence
        head's BCE and calibration when one is trained (synchronises with the device)."""
        values = super().log_values()
        counts = self.accept_rate_counts.tolist()
        values.update({f"accept_rate@{k}": float(self.accept_rate_at(k)) for k, n in enumerate(counts) if n > 0})
        if float(self.confidence_weight_sum) > 0:
            values.update({name: float(getattr(self, attribute)) for name, attribute in self.confidence_logged})
        return values

    def to_dict(self) -> dict:
        """Python floats (lists for the per-position sums) for logging (synchronises with the device)."""
        out = {}
        for name in self.field_names() + tuple(self.derived):
            value = getattr(self, name)
            out[name] = value.tolist() if name in self.field_widths else float(value)
        return out


@torch.no_grad()
def dspark_metrics(targets: SlotTargets, l1: torch.Tensor, correct: torch.Tensor, plan: DFlashBatchPlan, *,
                   confidence_logits: Optional[torch.Tensor] = None, ce_sum=0.0, l1_sum=0.0,
                   bce_sum=0.0, weights: Optional[torch.Tensor] = None) -> DSparkMetrics:
    """`DSparkMetrics` of one micro-batch.

    Args:
        targets: `dspark_slot_targets`' output (``supervised``, ``weights`` ``[B, N, W]``).
        l1: ``[M]`` or ``[B, N, W]`` each slot's ``sum_v |p_v - q_v|``.
        correct: ``[M]`` or ``[B, N, W]`` bool, the label is the row's argmax.
        plan: the batch plan.
        confidence_logits: ``[B, N, W]`` the confidence head's logits, or None.
        ce_sum, l1_sum, bce_sum: the weighted sums of the three terms.
        weights: the slot weights the terms used when not ``targets.weights`` (D-PACE's), ``[M]`` or ``[B, N, W]``.
    """
    f64 = torch.float64
    supervised = targets.supervised
    weights = (targets.weights if weights is None else weights.view(supervised.shape)).to(f64)
    W = supervised.shape[-1]
    correct = correct.view(supervised.shape) & supervised
    accept = (1.0 - 0.5 * l1.view(supervised.shape).to(f64)).clamp(0.0, 1.0)
    eval_mask = supervised.to(f64)
    accepted = accept * eval_mask
    counted = counted_blocks(supervised, plan.block_valid)
    tau = accepted.cumprod(dim=-1).sum(dim=-1) + 1.0
    pad = METRIC_POSITIONS - W
    zero = torch.zeros((), dtype=f64, device=supervised.device)
    confidence = [zero, zero, zero, zero]
    if confidence_logits is not None:
        probs = confidence_logits.detach().to(f64).sigmoid()
        error = probs - accept
        prefix_gap = (probs * eval_mask).cumprod(dim=-1) - accepted.cumprod(dim=-1)
        confidence = [weights.sum(), (error.abs() * weights).sum(), (error * weights).sum(), (prefix_gap * weights).sum()]
    return DSparkMetrics(
        supervised_tokens=supervised.sum().to(f64),
        correct_tokens=correct.sum().to(f64),
        acceptance_sum=acceptance_lengths(correct, supervised, plan.block_valid).sum().to(f64),
        valid_blocks=counted.sum().to(f64),
        accept_rate_sums=F.pad(accepted.sum(dim=(0, 1)), (0, pad)),
        accept_rate_counts=F.pad(eval_mask.sum(dim=(0, 1)), (0, pad)),
        expected_acceptance_sum=torch.where(counted, tau, zero).sum(),
        loss_weight_sum=weights.sum(),
        ce_loss_sum=torch.as_tensor(ce_sum, dtype=f64, device=supervised.device),
        l1_loss_sum=torch.as_tensor(l1_sum, dtype=f64, device=supervised.device),
        bce_loss_sum=torch.as_tensor(bce_sum, dtype=f64, device=supervised.device),
        confidence_weight_sum=confidence[0],
        confidence_abs_error_sum=confidence[1],
        confidence_bias_sum=confidence[2],
        confidence_cumprod_bias_sum=confidence[3],
    )


# --------------------------------------------------------------------------------------------------
# The fused kernel
# --------------------------------------------------------------------------------------------------


@dataclass
class _DSparkBuffers:
    """What the kernel allocates once per call: the reused ``[c, V_real]`` fp32 chunk buffers (``draft``: ``z``
    then ``p``; ``target``: ``t``, ``q``, ``p - q``, its sign, then the gradient ``G``; ``tanh``: the soft cap's
    tanh of the draft's logits or None), the fp32 ``w2_real [V_real, r]``, the gradients (``[0, ...]`` rows
    without them), the two loss sums and the per-slot ``l1 [M]`` and ``correct [M]``."""

    draft: torch.Tensor
    target: torch.Tensor
    tanh: Optional[torch.Tensor]
    w2_real: Optional[torch.Tensor]
    grad_hidden: torch.Tensor
    grad_features: Optional[torch.Tensor]
    grad_w2: Optional[torch.Tensor]
    ce_sum: torch.Tensor
    l1_sum: torch.Tensor
    l1: torch.Tensor
    correct: torch.Tensor

    @classmethod
    def allocate(cls, local: LocalHead, hidden, features, w2, rows: int, with_grad: bool) -> "_DSparkBuffers":
        M, device, f32 = hidden.shape[0], hidden.device, torch.float32
        grad_rows = M if with_grad else 0
        draft = torch.empty(rows, local.real, dtype=f32, device=device)
        markov = features is not None
        return cls(
            draft=draft, target=torch.empty_like(draft),
            tanh=torch.empty_like(draft) if local.cap is not None else None,
            w2_real=w2[: local.real].float() if markov else None,
            grad_hidden=torch.empty(grad_rows, hidden.shape[-1], dtype=local.weight.dtype, device=device),
            grad_features=torch.empty(grad_rows, features.shape[-1], dtype=f32, device=device) if markov else None,
            grad_w2=torch.zeros(w2.shape, dtype=f32, device=device) if markov else None,
            ce_sum=torch.zeros((), dtype=f32, device=device), l1_sum=torch.zeros((), dtype=f32, device=device),
            l1=torch.empty(M, dtype=f32, device=device), correct=torch.empty(M, dtype=torch.bool, device=device),
        )


def _chunk_distributions(local: LocalHead, buf: _DSparkBuffers, h, g, f, label, owned):
    """Pass 1 and 2 of a chunk of ``n`` rows: ``(ce [n], correct [n], l1 [n], S [n], p [n, V_real], s [n, V_real])``
    with ``p = softmax(z)`` in ``buf.draft`` and ``s = sign(p - q)`` in ``buf.target``."""
    group, zero, n = local.group, local.zero, h.shape[0]
    t = transformed_logits(local, g, buf.target, None)
    z = transformed_logits(local, h, buf.draft, buf.tanh)
    if f is not None:
        z.addmm_(f.float(), buf.w2_real.t())
    maxima = all_reduce_in_group(torch.stack([row_amax(z), row_amax(t)]), dist.ReduceOp.MAX, group)
    label_shifted = torch.where(owned, z.gather(1, label)[:, 0] - maxima[0], zero) if local.real else zero.expand(n)
    z.sub_(maxima[0][:, None]).exp_()
    t.sub_(maxima[1][:, None]).exp_()
    sums = all_reduce_in_group(torch.stack([z.sum(dim=-1), t.sum(dim=-1), label_shifted]), dist.ReduceOp.SUM, group)
    ce = torch.log(sums[0]) - sums[2]
    p = z.div_(sums[0][:, None])
    d = t.mul_((-1.0 / sums[1])[:, None]).add_(p)  # p - q
    l1_local = torch.linalg.vector_norm(d, ord=1, dim=-1)
    s = d.sign_()
    stats = all_reduce_in_group(torch.stack([l1_local, row_dot(p, s)]), dist.ReduceOp.SUM, group)
    return ce, sums[2] == 0, stats[0], stats[1], p, s


def _chunk_grads(local: LocalHead, buf: _DSparkBuffers, lo: int, hi: int, p, s, S, label, owned, row, f,
                 ce_weight: float, l1_weight: float) -> None:
    """Pass 3: rows ``lo:hi`` of the gradients from ``G = row (ce_weight (p - onehot) + l1_weight p (s - S))``
    (``row [n]``: the slots' weights), formed in ``s``'s buffer."""
    # p (l1_weight row s + row (ce_weight - l1_weight S)): three passes over the buffer.
    G = s.mul_((l1_weight * row)[:, None]).add_((row * (ce_weight - l1_weight * S))[:, None]).mul_(p)
    if local.real:
        G.scatter_add_(1, label, -(owned * row * ce_weight).to(G.dtype)[:, None])
    if f is not None:  # the Markov bias enters z untransformed
        torch.matmul(G, buf.w2_real, out=buf.grad_features[lo:hi])
        buf.grad_w2[: local.real].addmm_(G.t(), f.float())
    if local.multiplier != 1.0:
        G.mul_(local.multiplier)
    if local.cap is not None:
        th = buf.tanh[: hi - lo]
        G.mul_(th.mul_(th).neg_().add_(1.0))
    if local.weight.dtype == torch.float32:
        torch.matmul(G, local.weight, out=buf.grad_hidden[lo:hi])
    else:
        buf.grad_hidden[lo:hi] = G.to(local.weight.dtype) @ local.weight


class _FusedDSparkLoss(torch.autograd.Function):
    """``sum_r w_r (ce_weight CE_r + l1_weight L1_r)`` over ``M`` slots of a frozen vocab-parallel head, the
    gradients w.r.t. the hidden states, the Markov features and ``W2``'s local rows formed in forward (see the
    module docstring).

    Inputs: hidden ``[M, H]``, labels ``[M]`` int64 (any valid id where the weight is 0), weights ``[M]`` fp32,
    teacher ``[M_t, H]`` and teacher_index ``[M]``, features ``[M, r]`` and w2 ``[V_local, r]`` (or None),
    the head, the two term weights, rows per chunk, with_grad, and ``row_weights``: None, or D-PACE's
    ``(lo, hi, ce [hi - lo]) -> weights [hi - lo]`` of rows ``lo:hi`` (whole blocks of ``block`` rows: the chunks
    are then rounded to whole blocks, so a chunk's weights are known after its cross entropy and before its
    gradient pass, and they replace ``weights``).
    Outputs: loss_sum (fp32 scalar), then, non-differentiable, the CE sum, the L1 sum, ``l1 [M]`` per slot,
    ``correct [M]`` bool and the ``[M]`` weights used.
    """

    @staticmethod
    def forward(ctx, hidden, labels, weights, teacher, teacher_index, features, w2, head, ce_weight, l1_weight,
                chunk, with_grad, row_weights, block):
        local = LocalHead.of(head, 1.0, hidden.device)
        M = hidden.shape[0]
        rows = max(1, min(chunk, M))
        if row_weights is not None:  # whole blocks per chunk (M is a multiple of the block)
            rows = max(block, rows - rows % block)
        buf = _DSparkBuffers.allocate(local, hidden, features, w2, rows, with_grad)
        used = weights.clone() if row_weights is None else torch.empty_like(weights)
        for lo in range(0, M, rows):
            hi = min(lo + rows, M)
            label, owned = local.local_labels(labels[lo:hi])
            f = features[lo:hi] if features is not None else None
            g = teacher.index_select(0, teacher_index[lo:hi])
            ce, buf.correct[lo:hi], l1, S, p, s = _chunk_distributions(local, buf, hidden[lo:hi], g, f, label, owned)
            if row_weights is not None:  # from the all-reduced CE: the same weights on every TP rank
                used[lo:hi] = row_weights(lo, hi, ce)
            w = used[lo:hi]
            buf.l1[lo:hi] = l1
            # `where`, not a product: an unsupervised slot's CE may be inf and 0 * inf is NaN.
            buf.ce_sum += torch.where(w != 0, ce * w, local.zero).sum()
            buf.l1_sum += torch.where(w != 0, l1 * w, local.zero).sum()
            if with_grad:
                _chunk_grads(local, buf, lo, hi, p, s, S, label, owned, w, f, ce_weight, l1_weight)
        ctx.save_for_backward(buf.grad_hidden, buf.grad_features, buf.grad_w2)
        ctx.dtypes = (hidden.dtype, None if features is None else features.dtype, None if w2 is None else w2.dtype)
        ctx.group = local.group
        ctx.mark_non_differentiable(buf.ce_sum, buf.l1_sum, buf.l1, buf.correct, used)
        return ce_weight * buf.ce_sum + l1_weight * buf.l1_sum, buf.ce_sum, buf.l1_sum, buf.l1, buf.correct, used

    @staticmethod
    def backward(ctx, grad_loss_sum, grad_ce, grad_l1, grad_rows, grad_correct, grad_used):
        grads = []
        for index, (saved, dtype) in enumerate(zip(ctx.saved_tensors, ctx.dtypes)):
            if saved is None:
                grads.append(None)
                continue
            grad = saved.mul_(grad_loss_sum.to(saved.dtype))  # saved once, used once
            if index < 2:  # hidden states and features are replicated: each rank's part covers its shard
                grad = all_reduce_in_group(grad, dist.ReduceOp.SUM, ctx.group)
            grads.append(grad.to(dtype))
        grad_hidden, grad_features, grad_w2 = grads
        return (grad_hidden, None, None, None, None, grad_features, grad_w2) + (None,) * 7


# --------------------------------------------------------------------------------------------------
# Slot targets and the loss
# --------------------------------------------------------------------------------------------------


def dspark_slot_targets(
    input_ids: torch.Tensor,
    plan: DFlashBatchPlan,
    *,
    decay_gamma: Optional[float] = 4.0,
    loss_mask: Optional[torch.Tensor] = None,
    input_mask: Optional[torch.Tensor] = None,
) -> SlotTargets:
    """The DSpark supervision: `slot_targets` with ``shift_label`` (slot ``k`` labelled ``x_{p+k+1}``, weight
    ``exp(-k / decay_gamma)``), cut at each block's first unsupervised slot.

    ``loss_mask [B, N, W]`` (index ``k`` = slot ``k``) overrides which slots may be supervised before the
    cut; ``input_mask [B, S]`` decides the last slot's label past the block (`shifted_supervision`).
    ``tokens`` of the result are each slot's previous token (slot 0: the anchor), the Markov head's input.
    """
    targets = slot_targets(input_ids, plan, decay_gamma=decay_gamma, loss_mask=loss_mask, shift_label=True,
                           input_mask=input_mask)
    contiguous = torch.cumprod(targets.supervised.to(torch.int32), dim=-1).bool()
    return SlotTargets.from_mask(targets.labels, contiguous, targets.weights, first_slot=0, tokens=targets.tokens)


@dataclass
class DSparkLossOutput:
    """One micro-batch's contribution to the global-batch DSpark objective.

    Attributes:
        loss_sum: differentiable fp32 scalar ``sum w (ce_weight CE + l1_weight L1 + bce_weight BCE)``.
        weight_sum: fp32 scalar without grad, ``sum(w * mask)``, the one denominator of all three terms: the
            training loss is ``sum(loss_sum) / sum(weight_sum)`` over the global batch.
        metrics: `DSparkMetrics`.
    """

    loss_sum: torch.Tensor
    weight_sum: torch.Tensor
    metrics: DSparkMetrics


def _check_dspark_inputs(hidden, plan, input_ids, head, teacher_hidden, markov_features, markov_w2,
                         confidence_logits, term_weights, decay_gamma, chunk_slots) -> None:
    """`dspark_loss`'s argument checks (shapes only: value checks would synchronise with the device)."""
    check_block_hidden(hidden, plan)
    check_loss_options(head, chunk_slots, None)
    if head.requires_grad():
        raise ValueError("dspark_loss needs the target's frozen output head (its fused kernel gives the head no "
                         "gradient); freeze the head.")
    B, N, W, S, H = plan.batch_size, plan.num_blocks, plan.block_size, plan.seq_length, hidden.shape[-1]
    if not isinstance(input_ids, torch.Tensor) or tuple(input_ids.shape) != (B, S):
        raise ValueError(f"input_ids must be [batch, seq_length] = {(B, S)} for this plan.")
    if not isinstance(teacher_hidden, torch.Tensor) or tuple(teacher_hidden.shape) != (B, S, H):
        shape = tuple(teacher_hidden.shape) if isinstance(teacher_hidden, torch.Tensor) else teacher_hidden
        raise ValueError(f"teacher_hidden must be the target's final hidden states [batch, seq_length, hidden] = "
                         f"{(B, S, H)}, got {shape}.")
    if (markov_features is None) != (markov_w2 is None):
        raise ValueError("dspark_loss: pass markov_features and markov_w2 together (a Markov head), or neither.")
    if markov_features is not None:
        r = markov_features.shape[-1]
        if markov_features.dim() != 4 or tuple(markov_features.shape[:3]) != (B, N, W):
            raise ValueError(f"markov_features must be [batch, blocks, block_size, rank] = {(B, N, W, 'r')}, got "
                             f"{tuple(markov_features.shape)}.")
        if tuple(markov_w2.shape) != (head.local_vocab_size, r):
            raise ValueError(f"markov_w2 must be this rank's rows of the Markov projection, [V_local, r] = "
                             f"{(head.local_vocab_size, r)} (the head's vocabulary shard), got {tuple(markov_w2.shape)}.")
    if confidence_logits is not None and tuple(confidence_logits.shape) != (B, N, W):
        raise ValueError(f"confidence_logits must be [batch, blocks, block_size] = {(B, N, W)}, got "
                         f"{tuple(confidence_logits.shape)}.")
    for name, value in term_weights.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name}={value!r} must be a finite number >= 0.")
    if decay_gamma is not None and (isinstance(decay_gamma, bool) or not isinstance(decay_gamma, (int, float))
                                    or not decay_gamma > 0):
        raise ValueError(f"decay_gamma={decay_gamma!r} must be a positive number or None (uniform weights).")
    if W > METRIC_POSITIONS:
        raise ValueError(f"block_size={W} exceeds the {METRIC_POSITIONS} positions DSpark's metrics hold.")


def dspark_loss(
    hidden: torch.Tensor,
    plan: DFlashBatchPlan,
    input_ids: torch.Tensor,
    head: OutputHead,
    *,
    teacher_hidden: torch.Tensor,
    markov_features: Optional[torch.Tensor] = None,
    markov_w2: Optional[torch.Tensor] = None,
    confidence_logits: Optional[torch.Tensor] = None,
    ce_weight: float = 0.1,
    l1_weight: float = 0.9,
    bce_weight: float = 1.0,
    decay_gamma: Optional[float] = 4.0,
    chunk_slots: Optional[int] = 1024,
    loss_mask: Optional[torch.Tensor] = None,
    input_mask: Optional[torch.Tensor] = None,
    weighting: Optional[LossWeighting] = None,
) -> DSparkLossOutput:
    """DSpark objective of one micro-batch, chunked, vocab-parallel and fused (see the module docstring).

    Args:
        hidden: ``[B, N, W, H]`` draft body output; slot ``k`` predicts ``x_{p+k+1}``.
        plan: the batch plan.
        input_ids: ``[B, S]`` context tokens (labels; supervised ones must lie in ``[0, vocab_size)``).
        head: the target's frozen output layer (`OutputHead`), also the teacher's head.
        teacher_hidden: ``[B, S, H]`` the target's final normed hidden states; slot ``k`` of a block at ``p``
            is distilled from position ``p + k``.
        markov_features: ``[B, N, W, r]`` each slot's Markov feature ``m`` (teacher-forced with the block's
            ground-truth previous tokens, `dspark_slot_targets`' ``tokens``), or None without a Markov head.
        markov_w2: ``[V_local, r]`` this rank's rows (``head.vocab_range``) of the Markov projection ``W2``
            (``r -> V``, no bias); it receives its gradient. With ``markov_features`` only.
        confidence_logits: ``[B, N, W]`` the confidence head's logits, or None (no BCE term).
        ce_weight, l1_weight, bce_weight: the three terms' weights (the recipe's 0.1, 0.9, 1.0).
        decay_gamma: slot decay ``exp(-k / decay_gamma)`` from slot 0 (None: uniform; recipe: 4 for blocks of 7).
        chunk_slots: slots per chunk (None: one chunk); peak two (three with a soft cap) ``[chunk_slots, V / TP]``
            fp32 buffers.
        loss_mask: ``[B, N, W]`` bool override of the supervisable slots (the cut still applies).
        input_mask: ``[B, S]`` bool, whether the token past each block (the last slot's label) is supervised.
        weighting: the run's `LossWeighting` (None: the static decay). A D-PACE one (``decay_gamma`` None) forms
            each slot's weight from the cross entropies of its block (`dspark_row_weights`) and weighs the three
            terms with it; its ``normalization`` gives ``weight_sum``.

    Returns:
        `DSparkLossOutput`.
    """
    term_weights = {"ce_weight": ce_weight, "l1_weight": l1_weight, "bce_weight": bce_weight}
    _check_dspark_inputs(hidden, plan, input_ids, head, teacher_hidden, markov_features, markov_w2,
                         confidence_logits, term_weights, decay_gamma, chunk_slots)
    weighting = check_weighting(weighting, decay_gamma, None)
    B, N, W, S = plan.batch_size, plan.num_blocks, plan.block_size, plan.seq_length
    M, device = B * N * W, hidden.device
    plan = plan.to(device)
    targets = dspark_slot_targets(input_ids.to(device), plan, decay_gamma=decay_gamma, loss_mask=loss_mask,
                                  input_mask=input_mask)
    features = markov_features.reshape(M, -1) if markov_features is not None else None
    with_grad = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (hidden, markov_features, markov_w2))
    size = M if chunk_slots is None else chunk_slots
    loss_sum, ce_sum, l1_sum, l1, correct, used = _FusedDSparkLoss.apply(
        targets.flat_hidden(hidden), targets.flat_labels, targets.flat_weights,
        teacher_hidden.to(device).reshape(B * S, -1), teacher_rows(plan, W), features, markov_w2, head,
        float(ce_weight), float(l1_weight), size, with_grad, dspark_row_weights(weighting, targets), W,
    )
    bce_sum = loss_sum.new_zeros(())
    if confidence_logits is not None:
        accept = (1.0 - 0.5 * l1).clamp(0.0, 1.0)  # detached: the kernel's l1 is non-differentiable
        bce = F.binary_cross_entropy_with_logits(confidence_logits.reshape(M).float(), accept, reduction="none")
        bce_sum = torch.where(used != 0, bce * used, loss_sum.new_zeros(())).sum()
        loss_sum = loss_sum + float(bce_weight) * bce_sum
    metrics = dspark_metrics(targets, l1, correct, plan, confidence_logits=confidence_logits, ce_sum=ce_sum,
                             l1_sum=l1_sum, bce_sum=bce_sum.detach(), weights=used)
    weight_sum = weighting.denominator(targets, used if weighting.dynamic else None)
    return DSparkLossOutput(loss_sum=loss_sum, weight_sum=weight_sum, metrics=metrics)


def dspark_row_weights(weighting: LossWeighting, targets: SlotTargets):
    """For `_FusedDSparkLoss`: None for the static decay (``targets.weights``), else D-PACE's
    ``(lo, hi, ce [hi - lo]) -> weights [hi - lo]`` of the whole blocks of flat rows ``lo:hi`` (detached, from
    each slot's cross entropy with its label; 0 on an unsupervised slot, which the cut of
    `dspark_slot_targets` puts only after the block's last supervised slot)."""
    if not weighting.dynamic:
        return None
    supervised = targets.supervised
    W = supervised.shape[-1]
    flat = supervised.reshape(-1)
    alpha, scheme = float(weighting.dpace_alpha), weighting.scheme
    return lambda lo, hi, ce: dpace_weights(ce.view(-1, W), flat[lo:hi].view(-1, W), alpha=alpha,
                                            scheme=scheme).reshape(-1)
