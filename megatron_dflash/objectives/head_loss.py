"""The one loss kernel of every draft objective: chunked, vocab-parallel cross entropy / KL over the
target's frozen output head (docs/design.md §6 Objectives).

`head_loss` takes the flattened predicted slots (``[M, H]`` hidden states, ``[M]`` labels and weights, as
`objectives.dflash_loss.dflash_loss.SlotTargets` builds them) and returns `HeadLossTerms`: the weighted loss sum, its parts, which
slots the logits get right and, on request, each slot's global top-k candidates. DFlash (hard labels),
JetSpec (soft targets: the target's distribution, CE or KL at a temperature), Domino (base and corrected
logits, mixed) and DFlash 2 (the candidates its selector rescores) all go through it.

Two paths, equal to fp32 rounding (tests compare them, and both against dense oracles):

* **fused** (`_FusedHeadLoss`, the default with a frozen head): ``loss_sum`` is a plain weighted sum, so
  the gradient w.r.t. the hidden states is formed in forward, chunk by chunk, in one reused
  ``[chunk, V / TP]`` buffer; backward only scales it. Nothing is recomputed, no logits are kept.
* **per chunk** (`_chunked_head_loss`, a trainable head, or ``fused=False``): each chunk's logits under
  activation recomputation, through the autograd of `OutputHead.local_logits` and
  `_VocabParallelCrossEntropy`; the head's weight gets its gradient.

Either way the peak is one chunk of logits, whatever the number of slots M. Weights that depend on the
losses of other slots (D-PACE, ``row_weights``) are formed once every row's loss is known; being detached,
they scale each row's gradient afterwards (fused: in backward; per chunk: as each chunk's incoming gradient).

Vocab-parallel cross entropy (megatron's ``vocab_parallel_cross_entropy`` scheme, with an explicit group
because megatron's reads ``parallel_state``): local max -> all-reduce MAX; sum of ``exp(z - max)`` and the
target's shifted logit (taken on the shard that owns it) -> one all-reduce SUM; ``nll = log(sum_exp) -
z_target``; the backward is analytical, ``softmax - onehot``. Each rank's gradient w.r.t. the (replicated)
hidden states covers only its vocabulary shard and is summed over the TP group.

Shapes: M predicted slots, H hidden size, V vocabulary (local shard: ``V / TP``), K candidates per slot,
E Domino's ``emb_dim``, c rows per chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..common.parallel import gather_last_dim, is_distributed_group, reduce_grad_over_group, tensor_parallel_group
from ..target.head import OutputHead

__all__ = [
    "SOFT_TARGETS", "HeadLossTerms", "head_loss", "topk_vocab_parallel",
    # The fused kernel's steps, shared by the objectives that fuse their own loss (DSpark's L1 objective).
    "LocalHead", "all_reduce_in_group", "row_amax", "row_dot", "transformed_logits",
]

SOFT_TARGETS = ("none", "ce", "kl")
# Sentinel above any vocabulary index, for the MIN all-reduce that picks the global argmax.
_NO_INDEX = torch.iinfo(torch.int64).max


# --------------------------------------------------------------------------------------------------
# Vocab-parallel cross entropy (hard or soft targets) with global argmax
# --------------------------------------------------------------------------------------------------


def all_reduce_in_group(tensor: torch.Tensor, op, group) -> torch.Tensor:
    """``dist.all_reduce`` in place over ``group``; the tensor as it is on a single rank."""
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
        global_max = all_reduce_in_group(local_max.clone(), dist.ReduceOp.MAX, group)
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
        sums = all_reduce_in_group(torch.stack([exp.sum(dim=-1), picked]), dist.ReduceOp.SUM, group)
        sum_exp, target_logit = sums[0], sums[1]
        loss = torch.log(sum_exp) - target_logit
        # Global argmax: only a shard whose max equals the global max offers its first maximal index.
        candidate = torch.where(
            local_max == global_max,
            local_arg + vocab_start,
            torch.full((), _NO_INDEX, dtype=torch.int64, device=logits.device),
        )
        argmax = all_reduce_in_group(candidate, dist.ReduceOp.MIN, group)
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
    global_max = all_reduce_in_group(logits.max(dim=-1).values.clone(), dist.ReduceOp.MAX, group)
    shifted = logits - global_max[:, None]
    exp = shifted.exp()
    sum_exp = all_reduce_in_group(exp.sum(dim=-1), dist.ReduceOp.SUM, group)
    probs = exp / sum_exp[:, None]
    # sum q log q = sum q * shifted - log(sum_exp); padding columns have q = 0 and shifted = -inf.
    q_shifted = torch.where(probs > 0, probs * shifted, torch.zeros((), device=logits.device)).sum(-1)
    q_shifted = all_reduce_in_group(q_shifted, dist.ReduceOp.SUM, group)
    return probs, q_shifted - torch.log(sum_exp)


# --------------------------------------------------------------------------------------------------
# The fused head loss: gradient w.r.t. the hidden states formed in forward, chunk by chunk
# --------------------------------------------------------------------------------------------------


def row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
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

    Weights known only after the loss (D-PACE, docs/design.md §6 Objectives): ``row_weights`` maps the per-row
    losses ``[M]`` (0 on unsupervised rows) to detached weights ``[M]``. Detached weights make the gradient
    linear in each row's own weight, so the chunks form every row's gradient at its ``weights`` value (the
    mask, 1 or 0), ``row_weights`` is evaluated once after the last chunk, and backward scales row ``r`` of
    ``dH`` by its weight in the same pass that applies the incoming gradient: no second pass over the
    vocabulary, nothing of size ``[M, V]``.

    Inputs: hidden ``[M, H]``, labels ``[M]`` int64 (any valid id on unsupervised rows), weights ``[M]``
    fp32 (0: unsupervised), teacher ``[M_t, H]`` and teacher_index ``[M]`` or None, features ``[M, E]`` and
    shard ``[V_local, E]`` or None, mix (Domino's ``lambda_base``), top_k (K: candidates per row, 0 for none),
    row_weights (a function of the per-row losses, or None).
    Outputs: loss_sum (fp32 scalar), then, non-differentiable, the base loss sum, the final loss sum (0
    without Domino), correct ``[M]`` bool of the base logits and of the final ones (the base's without Domino);
    then the global top-k of the base logits per row, values ``[M, K]`` (differentiable) and ids ``[M, K]``;
    last the weights ``row_weights`` gave ``[M]`` (empty without it).

    Candidates (DFlash 2's selector): the top-k is taken from the same logits buffer before it turns into
    the gradient, so the head runs once per chunk for the loss and the candidates together. The values'
    gradient reaches the hidden states through the K rows of ``W`` they come from (``dz/dh = factor * W[id]``),
    added to ``dH`` in backward; nothing of size ``V`` is kept for it.
    """

    @staticmethod
    def forward(ctx, hidden, labels, weights, teacher, teacher_index, features, shard, head, soft_target,
                temperature, mix, chunk, with_grad, top_k, row_weights):
        local = LocalHead.of(head, temperature, hidden.device)
        soft = soft_target != "none"
        domino = features is not None
        M = hidden.shape[0]
        rows_max = max(1, min(chunk, M))
        out = _FusedBuffers.allocate(local, hidden, features, shard, rows_max, soft, with_grad, top_k)
        row_loss = torch.zeros(M if row_weights is not None else 0, dtype=torch.float32, device=hidden.device)
        scale = temperature * temperature if soft else 1.0
        # d loss_r / d logits after the transform = (softmax - q) * w * T^2 / T (soft: T^2 scales the loss,
        # 1/T comes from z / T). The transform's own factor (multiplier, tanh') follows; without Domino the
        # multiplier is folded into the row factor (one pass less).
        base_factor = (mix if domino else 1.0) * scale / temperature * (1.0 if domino else local.multiplier)
        final_factor = 1.0 - mix
        zero = local.zero
        for lo in range(0, M, rows_max):
            hi = min(lo + rows_max, M)
            n = hi - lo
            w = weights[lo:hi]
            label, owned = local.local_labels(labels[lo:hi])
            q = None
            if soft:
                q, neg_entropy = _teacher_distribution(
                    local, teacher.index_select(0, teacher_index[lo:hi]), out.second, out.logits[:n]
                )
            z = transformed_logits(local, hidden[lo:hi], out.logits, out.tanh)
            if top_k:  # before `z` turns into the gradient
                out.candidate_values[lo:hi], out.candidate_ids[lo:hi] = _global_topk(z, top_k, local.start, local.group)
            if domino:
                final = out.second[:n].copy_(z).addmm_(features[lo:hi].float(), out.shard_real.t())
            loss, out.base_correct[lo:hi] = _cross_entropy_to_grad(local, z, label, owned, q, w * base_factor, with_grad)
            if soft_target == "kl":
                loss = loss + neg_entropy
            # `where`, not a product: an unsupervised slot's loss may be inf and 0 * inf is NaN.
            if row_weights is not None:  # weighted below, once every row's loss is known
                row_loss[lo:hi] = torch.where(w != 0, loss * (w * scale), zero)
            else:
                out.base_sum += torch.where(w != 0, loss * (w * scale), zero).sum()
            if domino:
                loss, out.final_correct[lo:hi] = _cross_entropy_to_grad(
                    local, final, label, owned, None, w * final_factor, with_grad
                )
                out.final_sum += torch.where(w != 0, loss * w, zero).sum()
            if with_grad:
                _chunk_grads(local, out, z, final if domino else None, features, lo, hi)
        ctx.row_scale = None
        if row_weights is not None:  # each row's gradient so far has unit weight: the weights scale it in backward
            ctx.row_scale = row_weights(row_loss)
            out.base_sum = (ctx.row_scale * row_loss).sum()
        if domino:
            loss_sum = mix * out.base_sum + (1.0 - mix) * out.final_sum
            ctx.save_for_backward(out.grad_hidden, out.grad_features, out.grad_shard)
            ctx.dtypes = (hidden.dtype, features.dtype, shard.dtype)
        else:
            loss_sum = out.base_sum.clone()
            ctx.save_for_backward(out.grad_hidden)
            ctx.dtypes = (hidden.dtype,)
        ctx.group = local.group
        ctx.candidates = None
        if top_k and with_grad and local.real > 0:  # a shard of padding only owns no candidate
            ctx.candidates = _candidate_grad_inputs(local, out.candidate_values, out.candidate_ids)
        used_weights = ctx.row_scale.clone() if row_weights is not None else row_loss
        ctx.mark_non_differentiable(out.base_sum, out.final_sum, out.base_correct, out.final_correct, out.candidate_ids,
                                    used_weights)
        return (loss_sum, out.base_sum, out.final_sum, out.base_correct, out.final_correct, out.candidate_values,
                out.candidate_ids, used_weights)

    @staticmethod
    def backward(ctx, grad_loss_sum, grad_base, grad_final, grad_base_correct, grad_final_correct,
                 grad_candidates, grad_candidate_ids, grad_weights):
        grads = []
        for index, (saved, dtype) in enumerate(zip(ctx.saved_tensors, ctx.dtypes)):
            scale = grad_loss_sum if index or ctx.row_scale is None else (ctx.row_scale * grad_loss_sum)[:, None]
            grad = saved.mul_(scale.to(saved.dtype))  # saved once, used once
            if index == 0 and ctx.candidates is not None:
                _add_candidate_grad(grad, grad_candidates, *ctx.candidates)
            if index < 2:  # hidden states and features are replicated: each rank's part covers its shard
                grad = all_reduce_in_group(grad, dist.ReduceOp.SUM, ctx.group)
            grads.append(grad.to(dtype))
        grad_hidden = grads[0]
        grad_features, grad_shard = grads[1:] if len(grads) == 3 else (None, None)
        return (grad_hidden, None, None, None, None, grad_features, grad_shard) + (None,) * 8


def row_amax(logits: torch.Tensor) -> torch.Tensor:
    """Row maximum (``amax``: no indices, several times cheaper than ``max``); -inf for a shard without
    real columns."""
    if logits.shape[-1] == 0:
        return torch.full(logits.shape[:-1], float("-inf"), device=logits.device)
    return logits.amax(dim=-1)


# The steps of `_FusedHeadLoss.forward`. Each works in place on the chunk's reused buffers: no copy and no
# host sync more than the single-function forward had.


@dataclass(frozen=True)
class LocalHead:
    """This rank's shard of a frozen head as the fused loss reads it.

    ``weight [V_real, H]`` and ``bias [V_real]`` fp32 (or None): the rows of this shard's ``V_real`` real
    columns (those below ``vocab_size``; the padding columns are never formed), ``start`` the global id of its
    first column; the output transform ``cap`` (tanh soft cap or None), ``multiplier`` and the temperature;
    ``zero``: a scalar 0 on the device, for the ``where`` of every chunk.
    """

    group: object
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    start: int
    real: int
    cap: Optional[float]
    multiplier: float
    temperature: float
    zero: torch.Tensor

    @classmethod
    def of(cls, head: OutputHead, temperature: float, device) -> "LocalHead":
        weight = head.weight if head.weight is not None else head.layer.weight
        bias = getattr(head.layer, "bias", None)
        start = head.vocab_range[0]
        real = max(0, min(head.local_vocab_size, head.vocab_size - start))  # this shard's real columns
        return cls(
            group=head.tp_group, weight=weight[:real], bias=bias[:real].float() if bias is not None else None,
            start=start, real=real, cap=head.final_logit_softcapping, multiplier=float(head.output_multiplier),
            temperature=temperature, zero=torch.zeros((), device=device),
        )

    def local_labels(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Global ``labels [c]`` -> ``(local column [c, 1] clamped into the shard, owned [c] bool)``."""
        label = labels - self.start
        owned = (label >= 0) & (label < self.real)
        return label.clamp(0, max(self.real - 1, 0))[:, None], owned


@dataclass
class _FusedBuffers:
    """What the fused loss allocates once per call: the reused ``[c, V_real]`` fp32 chunk buffers and the
    outputs filled chunk by chunk.

    ``logits`` (turned into exp, then into the gradient); ``second``: the teacher's logits (soft targets) or
    Domino's final logits; ``tanh``: the soft cap's tanh (for the chain rule). ``grad_hidden [M, H]`` (``[0, H]``
    without gradients), Domino's ``shard_real [V_real, E]`` fp32, ``grad_features [M, E]`` and ``grad_shard
    [V_local, E]``; the loss sums, ``base_correct`` / ``final_correct [M]`` (the same tensor without Domino)
    and the candidates ``[M, K]``.
    """

    logits: torch.Tensor
    second: Optional[torch.Tensor]
    tanh: Optional[torch.Tensor]
    grad_hidden: torch.Tensor
    shard_real: Optional[torch.Tensor]
    grad_features: Optional[torch.Tensor]
    grad_shard: Optional[torch.Tensor]
    base_sum: torch.Tensor
    final_sum: torch.Tensor
    base_correct: torch.Tensor
    final_correct: torch.Tensor
    candidate_values: torch.Tensor
    candidate_ids: torch.Tensor

    @classmethod
    def allocate(cls, local: LocalHead, hidden, features, shard, rows_max: int, soft: bool, with_grad: bool,
                 top_k: int) -> "_FusedBuffers":
        domino = features is not None
        M = hidden.shape[0]
        device = hidden.device
        logits = torch.empty(rows_max, local.real, dtype=torch.float32, device=device)
        grad_rows = M if with_grad else 0
        base_correct = torch.empty(M, dtype=torch.bool, device=device)
        return cls(
            logits=logits,
            second=torch.empty_like(logits) if soft or domino else None,
            tanh=torch.empty_like(logits) if local.cap is not None else None,
            grad_hidden=torch.empty(grad_rows, hidden.shape[-1], dtype=local.weight.dtype, device=device),
            shard_real=shard[: local.real].float() if domino else None,
            grad_features=(torch.empty(grad_rows, features.shape[-1], dtype=torch.float32, device=device)
                           if domino else None),
            grad_shard=torch.zeros(shard.shape, dtype=torch.float32, device=device) if domino else None,
            base_sum=torch.zeros((), dtype=torch.float32, device=device),
            final_sum=torch.zeros((), dtype=torch.float32, device=device),
            base_correct=base_correct,
            final_correct=torch.empty(M, dtype=torch.bool, device=device) if domino else base_correct,
            candidate_values=torch.empty(M, top_k, dtype=torch.float32, device=device),
            candidate_ids=torch.empty(M, top_k, dtype=torch.int64, device=device),
        )


def transformed_logits(local: LocalHead, h: torch.Tensor, out: torch.Tensor, tanh_out) -> torch.Tensor:
    """``out <- transform(h @ W_real^T + b) / T`` in place; returns the view of ``n`` rows.

    ``h [n, H]``, ``out [c >= n, V_real]`` fp32; ``tanh_out`` like ``out`` (keeps the soft cap's tanh) or None.
    """
    weight, cap, multiplier, temperature = local.weight, local.cap, local.multiplier, local.temperature
    n = h.shape[0]
    out = out[:n]
    if weight.dtype == torch.float32:
        torch.matmul(h.to(torch.float32), weight.t(), out=out)
    else:
        out.copy_(F.linear(h.to(weight.dtype), weight))
    if local.bias is not None:
        out.add_(local.bias)
    if cap is not None:
        t = tanh_out[:n] if tanh_out is not None else out
        torch.tanh(out.mul_(multiplier / cap), out=t)
        if t is not out:
            out.copy_(t)
        out.mul_(cap / temperature)
    elif multiplier / temperature != 1.0:
        out.mul_(multiplier / temperature)
    return out


def _teacher_distribution(
    local: LocalHead, teacher_hidden: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The soft target of ``n`` rows: ``(q [n, V_real] = softmax(teacher logits), sum_v q_v log q_v [n])``.

    ``teacher_hidden [n, H]``; ``q`` is formed in ``out`` (a ``[c, V_real]`` buffer); ``scratch [n, V_real]``
    holds ``exp(t - tmax)`` until the draft's logits are formed there.
    """
    # q = softmax(t), and sum_v q_v log q_v = sum_v q_v (t_v - tmax) - log(sum exp).
    t = transformed_logits(local, teacher_hidden, out, None)
    t_max = all_reduce_in_group(row_amax(t), dist.ReduceOp.MAX, local.group)
    t.sub_(t_max[:, None])
    torch.exp(t, out=scratch)
    t_stats = all_reduce_in_group(torch.stack([scratch.sum(dim=-1), row_dot(scratch, t)]), dist.ReduceOp.SUM, local.group)
    neg_entropy = t_stats[1] / t_stats[0] - torch.log(t_stats[0])
    return t.copy_(scratch).div_(t_stats[0][:, None]), neg_entropy


def _cross_entropy_to_grad(local: LocalHead, z, label, owned, q, row, with_grad: bool):
    """Per-row loss ``[n]`` and correctness ``[n]`` bool of logits ``z [n, V_real]``; with ``with_grad`` ``z``
    becomes ``(softmax - q) * row`` in place (``q [n, V_real]``: the soft target, or the one-hot of ``label
    [n, 1]`` when None; ``owned [n]``: the label is this shard's; ``row [n]``: each row's factor)."""
    group, real, zero = local.group, local.real, local.zero
    n = z.shape[0]
    z_max = all_reduce_in_group(row_amax(z), dist.ReduceOp.MAX, group)
    label_shifted = torch.where(owned, z.gather(1, label)[:, 0] - z_max, zero) if real else zero.expand(n)
    if q is not None:
        picked = row_dot(q, z) - z_max * q.sum(dim=-1)
    z.sub_(z_max[:, None]).exp_()
    stats = [z.sum(dim=-1), label_shifted] + ([picked] if q is not None else [])
    stats = all_reduce_in_group(torch.stack(stats), dist.ReduceOp.SUM, group)
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


def _chunk_grads(local: LocalHead, out: _FusedBuffers, z, final, features, lo: int, hi: int) -> None:
    """Rows ``lo:hi`` of ``grad_hidden`` (and Domino's ``grad_features``, ``grad_shard``) from the chunk's
    ``d loss / d z`` in ``z [n, V_real]`` (and ``d loss / d final`` in ``final``, Domino), through the output
    transform's derivative; ``z`` is overwritten."""
    weight = local.weight
    if final is not None:
        # `final` holds d loss / d final logits = d loss / d delta; it joins the base gradient.
        torch.matmul(final, out.shard_real, out=out.grad_features[lo:hi])
        out.grad_shard[: local.real].addmm_(final.t(), features[lo:hi].float())
        z.add_(final)
        if local.multiplier != 1.0:
            z.mul_(local.multiplier)
    if local.cap is not None:
        th = out.tanh[: hi - lo]
        z.mul_(th.mul_(th).neg_().add_(1.0))
    if weight.dtype == torch.float32:
        torch.matmul(z, weight, out=out.grad_hidden[lo:hi])
    else:
        out.grad_hidden[lo:hi] = z.to(weight.dtype) @ weight


def _candidate_grad_inputs(local: LocalHead, candidate_values: torch.Tensor, candidate_ids: torch.Tensor):
    """``(rows [M, K] of W_real, factor [M, K], W_real)`` for `_add_candidate_grad`: ``d z / d hidden`` of a
    candidate is its factor times its row of ``W_real`` (this shard's candidates only, factor 0 elsewhere)."""
    real, temperature, cap = local.real, local.temperature, local.cap
    # The factor is multiplier / T, times 1 - tanh^2 under the soft cap (tanh read back from z).
    ids = candidate_ids - local.start
    owned = (ids >= 0) & (ids < real)
    factor = torch.full_like(candidate_values, local.multiplier / temperature)
    if cap is not None:
        factor.mul_(1.0 - (candidate_values * (temperature / cap)).square())
    return ids.clamp(0, max(real - 1, 0)), torch.where(owned, factor, local.zero), local.weight


# --------------------------------------------------------------------------------------------------
# Vocab-parallel top-k
# --------------------------------------------------------------------------------------------------


def _topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(x, k, dim=-1)`` (values sorted, decreasing), in two passes on long rows.

    A row's top ``k`` lie in the ``k`` groups of consecutive columns with the largest maxima (a group whose
    maximum is below the ``k``-th value holds none of them), so the exact top-k is that of ``k`` groups'
    columns: one ``amax`` pass over the row plus a top-k over ``k * group`` columns, 3-4 times faster than
    ``torch.topk`` over 32k-152k columns on CPU. Ties may pick other ids of equal value, as ``torch.topk``'s
    order among ties is unspecified too. Short rows, rows no group size divides, and non-contiguous inputs
    take ``torch.topk``.
    """
    columns = x.shape[-1]
    group = next((g for g in (128, 64) if columns % g == 0), None)
    if group is None or columns < 8 * k * group or not x.is_contiguous() or x.numel() == 0:
        return torch.topk(x, k, dim=-1)
    rows = x.view(-1, columns)
    best = rows.view(rows.shape[0], columns // group, group).amax(dim=-1).topk(k, dim=-1, sorted=False).indices
    candidates = (best[:, :, None] * group + torch.arange(group, device=x.device)).view(rows.shape[0], k * group)
    values, where = rows.gather(1, candidates).topk(k, dim=-1)
    shape = (*x.shape[:-1], k)
    return values.view(shape), candidates.gather(1, where).view(shape)


def topk_vocab_parallel(
    local_logits: torch.Tensor, k: int, vocab_start: int = 0, group=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global top-k of logits split over the vocabulary, without gathering the vocabulary.

    Each rank takes its local top-k, the `k` candidates of every rank are all-gathered
    (`TP * k` per position), and the top-k of those is the global top-k. Differentiable in
    the values (the gradient reaches each rank's own logits).

    Args:
        local_logits: `[..., V / TP]`, this rank's slice of the vocabulary.
        k: candidates to keep.
        vocab_start: global id of this rank's first vocabulary entry.
        group: the group splitting the vocabulary (megatron's TP group when None and
            initialised, a single rank otherwise).
    Returns:
        `(values [..., k], ids [..., k])`, sorted by decreasing value, ids global; identical on
        every rank.
    """
    group = tensor_parallel_group(group)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k={k!r} must be a positive integer.")
    local_k = min(k, local_logits.shape[-1])
    values, index = _topk(local_logits, local_k)
    ids = index + vocab_start
    if not is_distributed_group(group):
        if local_k < k:
            raise ValueError(f"k={k} exceeds the vocabulary size {local_logits.shape[-1]}.")
        return values, ids
    if local_k * group.size() < k:
        raise ValueError(
            f"k={k} exceeds the vocabulary size {local_logits.shape[-1]} x {group.size()} ranks."
        )
    all_values = gather_last_dim(values, group)  # [..., TP * local_k]
    all_ids = gather_last_dim(ids, group)
    top_values, where = torch.topk(all_values, k, dim=-1)
    return top_values, all_ids.gather(-1, where)


def _global_topk(local: torch.Tensor, k: int, vocab_start: int, group) -> tuple[torch.Tensor, torch.Tensor]:
    """`topk_vocab_parallel` of a shard cropped to its real columns (no gradient): a shard with fewer than
    ``k`` real columns offers ``-inf`` fillers, so every rank gathers ``k`` values per row."""
    local_k = min(k, local.shape[-1])
    values, index = _topk(local, local_k)
    ids = index + vocab_start
    if local_k < k:
        values = F.pad(values, (0, k - local_k), value=float("-inf"))
        ids = F.pad(ids, (0, k - local_k), value=vocab_start)
    if not is_distributed_group(group):
        return values, ids
    values, where = torch.topk(gather_last_dim(values, group), k, dim=-1)
    return values, gather_last_dim(ids, group).gather(-1, where)


def _add_candidate_grad(grad_hidden, grad_values, rows, factor, weight, rows_per_pass: int = 256) -> None:
    """``grad_hidden[r] += sum_k grad_values[r, k] * factor[r, k] * weight[rows[r, k]]`` in place.

    ``[M, K]`` candidates, ``weight [V_real, H]``; a few hundred rows at a time so the gathered
    ``[rows, K, H]`` rows of the weight stay small.
    """
    coefficient = grad_values.float() * factor
    for lo in range(0, rows.shape[0], rows_per_pass):
        hi = lo + rows_per_pass
        picked = weight[rows[lo:hi]].float()  # [r, K, H]
        part = torch.bmm(coefficient[lo:hi].unsqueeze(1), picked).squeeze(1)
        grad_hidden[lo:hi] += part.to(grad_hidden.dtype)


# --------------------------------------------------------------------------------------------------
# The per-chunk path (recomputed in backward; the head may train)
# --------------------------------------------------------------------------------------------------


def _chunk_terms(head: OutputHead, soft_target: str, temperature: float, teacher: Optional[torch.Tensor],
                 mix_features: bool, top_k: int, per_row: bool = False):
    """The per-chunk computation run under activation recomputation.

    ``(h [c, H], labels [c], weights [c], teacher_index [c] or empty, features [c, E] or empty, shard
    [V_local, E] or empty) -> (base weighted loss sum, final weighted loss sum, base argmax [c], final argmax
    [c], candidate values [c, K], candidate ids [c, K])``; the final terms are Domino's corrected logits
    (the base ones without Domino), K may be 0. ``per_row`` (no Domino): the base and final terms are the
    weighted losses of the rows ``[c]``, not their sum (weights that depend on every row's loss follow).
    """
    start = head.vocab_range[0]
    group = head.tp_group

    def run(h, labels, weights, teacher_index, features, shard):
        logits = head.local_logits(h)
        if temperature != 1.0:
            logits = logits / temperature
        probs = neg_entropy = None
        if soft_target != "none":
            with torch.no_grad():
                target_logits = head.local_logits(teacher.index_select(0, teacher_index))
                if temperature != 1.0:
                    target_logits = target_logits / temperature
                probs, neg_entropy = _vocab_parallel_softmax(target_logits, group)
        if top_k:
            values, ids = topk_vocab_parallel(logits, top_k, start, group)
        else:
            values, ids = logits.new_zeros(h.shape[0], 0), labels.new_zeros(h.shape[0], 0)
        zero = torch.zeros((), device=logits.device)
        loss, argmax = _VocabParallelCrossEntropy.apply(logits, labels, probs, start, group)
        if soft_target == "kl":
            loss = loss + neg_entropy  # KL(q || p) = CE(q, p) - H(q)
        if soft_target != "none" and temperature != 1.0:
            loss = loss * (temperature * temperature)
        # `where`, not a product: an unsupervised slot's loss may be inf and 0 * inf is NaN.
        base = torch.where(weights != 0, loss * weights, zero)
        base = base if per_row else base.sum()
        if not mix_features:
            return base, base, argmax, argmax, values, ids
        # Domino: the delta of this shard (each rank's gradient w.r.t. the features covers its shard).
        delta = F.linear(reduce_grad_over_group(features, group).to(shard.dtype), shard).float()
        loss, final_argmax = _VocabParallelCrossEntropy.apply(logits + delta, labels, None, start, group)
        final = torch.where(weights != 0, loss * weights, zero).sum()
        return base, final, argmax, final_argmax, values, ids

    return run


def _chunked_head_loss(hidden, labels, weights, teacher, teacher_index, features, shard, head, soft_target,
                       temperature, mix, size, top_k, *, recompute, row_weights=None):
    """The per-chunk path of `head_loss`; returns its `HeadLossTerms`.

    With ``row_weights`` each chunk returns its rows' losses (at their ``weights``, the mask); the weights
    they give multiply them once all are known, and autograd hands each chunk's recomputation its rows'
    weights as the incoming gradient: the same weighted sum and gradient as the fused path.
    """
    M = hidden.shape[0]
    domino = features is not None
    per_row = row_weights is not None
    run = _chunk_terms(head, soft_target, temperature, teacher, domino, top_k, per_row)
    empty = hidden.new_zeros(M, 0)
    pieces = zip(
        hidden.split(size), labels.split(size), weights.split(size),
        (teacher_index if teacher_index is not None else empty).split(size),
        (features if domino else empty).split(size),
    )
    shard = shard if domino else empty
    base_sum = final_sum = hidden.new_zeros((), dtype=torch.float32)
    rows = []
    parts = []
    for h, lab, w, t, f in pieces:
        if recompute:
            out = checkpoint(run, h, lab, w, t, f, shard, use_reentrant=False)
        else:
            out = run(h, lab, w, t, f, shard)
        if per_row:
            rows.append(out[0])
        else:
            base_sum = base_sum + out[0]
            final_sum = final_sum + out[1]
        parts.append(out[2:])
    if per_row:
        base_sum = torch.cat(rows)
    base_arg, final_arg, values, ids = (torch.cat(p) for p in zip(*parts))
    used_weights = None
    if per_row:  # `base_sum` is the concatenation of the rows' losses here
        row_loss = base_sum
        with torch.no_grad():
            used_weights = row_weights(row_loss.detach())
        base_sum = final_sum = (used_weights * row_loss).sum()
    loss_sum = (1.0 - mix) * final_sum + mix * base_sum if domino else base_sum
    return HeadLossTerms(
        loss_sum=loss_sum, base_sum=base_sum.detach(), final_sum=final_sum.detach() if domino else final_sum.new_zeros(()),
        base_correct=base_arg == labels, final_correct=final_arg == labels,
        candidate_values=values if top_k else None, candidate_ids=ids if top_k else None, weights=used_weights,
    )


# --------------------------------------------------------------------------------------------------
# The entry point
# --------------------------------------------------------------------------------------------------


@dataclass
class HeadLossTerms:
    """What `head_loss` computes for ``M`` flattened slots.

    Attributes:
        loss_sum: differentiable fp32 scalar: ``base_sum``, or with Domino's features
            ``(1 - mix) * final_sum + mix * base_sum``.
        base_sum: no grad, ``sum_r w_r * loss_r`` of the head's own logits (soft targets: scaled by T^2).
        final_sum: no grad, the same for Domino's corrected logits (0 without Domino).
        base_correct: ``[M]`` bool, the label's logit is the row's global maximum (base logits).
        final_correct: ``[M]`` bool, the same for the corrected logits (the base's without Domino).
        candidate_values: ``[M, K]`` fp32 global top-k of the base logits, differentiable w.r.t. the hidden
            states (None without ``top_k``).
        candidate_ids: ``[M, K]`` int64 their global token ids (None without ``top_k``).
        weights: ``[M]`` fp32 (no grad) the weights ``row_weights`` gave each row (None without it).
    """

    loss_sum: torch.Tensor
    base_sum: torch.Tensor
    final_sum: torch.Tensor
    base_correct: torch.Tensor
    final_correct: torch.Tensor
    candidate_values: Optional[torch.Tensor] = None
    candidate_ids: Optional[torch.Tensor] = None
    weights: Optional[torch.Tensor] = None


def check_loss_options(head, chunk_slots, fused) -> None:
    """The options every objective shares: the head, ``chunk_slots`` and ``fused`` (see `head_loss`)."""
    if not isinstance(head, OutputHead):
        raise ValueError(f"head must be an OutputHead, got {type(head).__name__}; wrap the output layer in OutputHead.")
    if chunk_slots is not None and (isinstance(chunk_slots, bool) or not isinstance(chunk_slots, int) or chunk_slots < 1):
        raise ValueError(f"chunk_slots={chunk_slots!r} must be a positive int or None (one chunk).")
    if fused not in (None, True, False):
        raise ValueError(f"fused={fused!r} must be None (automatic), True or False.")
    if fused and head.requires_grad():
        raise ValueError(
            "fused=True needs a frozen output head (the fused loss gives the head's weight no gradient); "
            "freeze the head or pass fused=None / False."
        )


def head_loss(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    head: OutputHead,
    *,
    chunk_slots: Optional[int] = 1024,
    fused: Optional[bool] = None,
    teacher: Optional[torch.Tensor] = None,
    teacher_index: Optional[torch.Tensor] = None,
    soft_target: str = "none",
    temperature: float = 1.0,
    features: Optional[torch.Tensor] = None,
    shard: Optional[torch.Tensor] = None,
    mix: float = 0.0,
    top_k: int = 0,
    row_weights: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
) -> HeadLossTerms:
    """Weighted CE / KL of ``M`` slots over the target's head, chunked and vocab-parallel.

    Args:
        hidden: ``[M, H]`` draft hidden states of the predicted slots.
        labels: ``[M]`` int64 labels, any valid id where the weight is 0 (not checked: it would synchronise).
        weights: ``[M]`` fp32 per-slot weights ``w * mask`` (0: unsupervised; computed with weight 0).
        head: the target's output layer.
        chunk_slots: rows per chunk (None: one chunk); peak ``chunk_slots x V / TP`` fp32 logits (a few such
            buffers for soft targets, Domino and the soft cap).
        fused: None uses `_FusedHeadLoss` whenever the head is frozen, else the per-chunk path; True requires
            a frozen head; False forces the per-chunk path.
        teacher, teacher_index: soft targets only: ``[M_t, H]`` the target's final hidden states and ``[M]``
            the row of ``teacher`` that distils each slot.
        soft_target: "none" (hard labels), "ce" or "kl" (against ``softmax(teacher / T)``, times ``T^2``).
        temperature: T of soft targets.
        features, shard: Domino only, ``[M, E]`` and ``[V_local, E]``: the corrected logits are the base
            logits plus ``features @ shard^T``.
        mix: Domino's ``lambda_base``, the base term's share of ``loss_sum``.
        top_k: candidates per slot to return (DFlash 2's selector), 0 for none.
        row_weights: weights that depend on the losses (D-PACE): a function of the per-row losses ``[M]``
            fp32 (0 where ``weights`` is 0) returning detached weights ``[M]``, called once, after every row's
            loss is known. ``weights`` is then each row's unit weight (the mask) and ``loss_sum`` is
            ``sum_r row_weights_r * loss_r``; `HeadLossTerms.weights` holds them. Not with Domino's features.
    """
    check_loss_options(head, chunk_slots, fused)
    if row_weights is not None and features is not None:
        raise ValueError("head_loss: row_weights (D-PACE) does not apply to Domino's mixed loss.")
    if soft_target not in SOFT_TARGETS:
        raise ValueError(f"soft_target={soft_target!r} must be one of {SOFT_TARGETS}.")
    if (soft_target != "none") != (teacher is not None):
        raise ValueError("head_loss: pass teacher and teacher_index exactly for soft targets.")
    if features is not None and (soft_target != "none" or top_k):
        raise ValueError("head_loss: Domino's corrected logits take hard labels and no candidates.")
    if head.draft_vocab is not None:
        if features is not None:
            raise ValueError("head_loss: Domino's corrected logits span the whole target vocabulary; they do not "
                             "take a reduced draft vocabulary.")
        return _draft_vocab_loss(hidden, labels, weights, head, chunk_slots=chunk_slots, fused=fused, teacher=teacher,
                                 teacher_index=teacher_index, soft_target=soft_target, temperature=temperature,
                                 top_k=top_k, row_weights=row_weights)
    M = hidden.shape[0]
    size = max(1, M if chunk_slots is None else min(chunk_slots, M))
    if fused is None:
        fused = not head.requires_grad()
    if fused:
        with_grad = torch.is_grad_enabled() and (
            hidden.requires_grad or (features is not None and (features.requires_grad or shard.requires_grad))
        )
        out = _FusedHeadLoss.apply(
            hidden, labels, weights, teacher, teacher_index, features, shard, head, soft_target,
            float(temperature), float(mix), size, with_grad, int(top_k), row_weights,
        )
        loss_sum, base_sum, final_sum, base_correct, final_correct, values, ids, used = out
        return HeadLossTerms(loss_sum, base_sum, final_sum, base_correct, final_correct,
                             values if top_k else None, ids if top_k else None,
                             used if row_weights is not None else None)
    recompute = torch.is_grad_enabled() and (
        hidden.requires_grad or head.requires_grad() or (features is not None and features.requires_grad)
    )
    return _chunked_head_loss(hidden, labels, weights, teacher, teacher_index, features, shard, head, soft_target,
                              float(temperature), float(mix), size, int(top_k), recompute=recompute,
                              row_weights=row_weights)


def _draft_vocab_loss(hidden, labels, weights, head: OutputHead, *, row_weights, top_k, **options) -> HeadLossTerms:
    """`head_loss` over a reduced draft vocabulary (docs/design.md §20 Reduced draft vocabulary): the kernel runs
    over the draft head's K columns with the labels mapped to draft ids. A slot whose label lies outside the draft
    vocabulary is excluded from the loss (weight 0, as the published trainers mask it) and counted wrong (the
    draft cannot propose it); candidate ids come back as target ids."""
    columns, inside = head.to_draft(labels)
    zero = torch.zeros((), dtype=weights.dtype, device=weights.device)
    weights = torch.where(inside, weights, zero)
    if row_weights is not None:
        given = row_weights
        row_weights = lambda nll: torch.where(inside, given(nll), zero)  # noqa: E731
    plain = replace(head, draft_vocab=None)
    terms = head_loss(hidden, columns, weights, plain, row_weights=row_weights, top_k=top_k, **options)
    terms.base_correct = terms.base_correct & inside
    terms.final_correct = terms.final_correct & inside
    if terms.candidate_ids is not None:
        terms.candidate_ids = head.to_target(terms.candidate_ids)
    return terms
