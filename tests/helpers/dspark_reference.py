"""The DSpark objective's dense reference and its test case (tests/objectives): full-vocabulary fp32 logits of
every slot, plain torch softmax / cross entropy / abs / BCE, autograd for the gradients, the supervision built by
a Python loop over blocks and slots."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_dflash.objectives.dspark_loss import dspark_loss
from megatron_dflash.plan.batch_plan import DFlashBatchPlan
from megatron_dflash.target.head import OutputHead


V, PADDED, H, R = 97, 100, 16, 6
B, S, N, W = 2, 30, 4, 7
TERMS = ("ce", "l1", "bce")


def make_case(seed=0, *, bias=False):
    """Two rows of four blocks of 7: gaps in the input mask inside blocks (row 0 at 9, row 1 at 20), a block
    whose last label lies past the sequence (anchor 23), a block whose last label past the block is
    unsupervised (row 1, anchor 10: position 17 is the next block's anchor, masked), an invalid block."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[0, 9] = False
    mask[1, [1, 17 + 3, 17]] = False
    anchors = torch.tensor([[0, 5, 12, 23], [2, 10, 17, 0]])
    valid = torch.tensor([[True] * 4, [True, True, True, False]])
    plan = DFlashBatchPlan.from_anchors(anchors, block_size=W, block_valid=valid, input_mask=mask)
    layer = nn.Linear(H, PADDED, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(PADDED, H, generator=gen) * 0.5)
        if bias:
            layer.bias.copy_(torch.randn(PADDED, generator=gen) * 0.3)
    layer.requires_grad_(False)
    return dict(
        plan=plan, mask=mask, layer=layer,
        ids=torch.randint(0, V, (B, S), generator=gen),
        hidden=torch.randn(B, N, W, H, generator=gen),
        teacher=torch.randn(B, S, H, generator=gen),
        features=torch.randn(B, N, W, R, generator=gen),
        w2=torch.randn(PADDED, R, generator=gen) * 0.7,
        confidence=torch.randn(B, N, W, generator=gen),
    )


def naive_supervision(plan, mask):
    """``(supervised [B, N, W], labels positions [B, N, W])`` by a loop: slot k of a block at p is labelled
    by position p + k + 1 and supervised while every label up to it exists and is in the input mask."""
    supervised = torch.zeros(B, N, W, dtype=torch.bool)
    for b in range(B):
        for n in range(N):
            if not plan.block_valid[b, n]:
                continue
            p = int(plan.anchor_positions[b, n])
            for k in range(W):
                if p + k + 1 >= S or not mask[b, p + k + 1]:
                    break
                supervised[b, n, k] = True
    positions = plan.anchor_positions[:, :, None] + 1 + torch.arange(W)
    return supervised, positions


def dense_reference(case, *, multiplier=1.0, cap=None, markov=True, confidence=True, gamma=4.0,
                    weights=(0.1, 0.9, 1.0), slot_weights=None):
    """The objective from its formulas on full fp32 logits; returns the terms and the gradients.
    ``slot_weights``: ``(ce [B, N, W], supervised [B, N, W]) -> [B, N, W]`` detached weights that replace the
    decay (D-PACE's, `test_dspark_loss_dpace`)."""
    plan, ids, layer = case["plan"], case["ids"], case["layer"]
    supervised, positions = naive_supervision(plan, case["mask"])
    labels = torch.gather(ids, 1, positions.clamp(max=S - 1).view(B, -1)).view(B, N, W)
    decay = torch.exp(-torch.arange(W, dtype=torch.float32) / gamma) if gamma else torch.ones(W)
    w = decay * supervised
    hidden = case["hidden"].clone().requires_grad_()
    features = case["features"].clone().requires_grad_()
    w2 = case["w2"].clone().requires_grad_()
    conf = case["confidence"].clone().requires_grad_()

    def logits(x):
        raw = F.linear(x, layer.weight, layer.bias) * multiplier
        if cap is not None:
            raw = cap * torch.tanh(raw / cap)
        return raw.masked_fill(torch.arange(PADDED) >= V, float("-inf"))

    z = logits(hidden) + (features @ w2.t() if markov else 0.0)
    teacher_pos = (positions - 1).clamp(max=S - 1)
    g = torch.stack([case["teacher"][b, teacher_pos[b]] for b in range(B)])  # [B, N, W, H]
    t = logits(g)
    p, q = z.softmax(-1), t.softmax(-1)
    ce = F.cross_entropy(z.view(-1, PADDED), labels.view(-1), reduction="none").view(B, N, W)
    if slot_weights is not None:
        w = slot_weights(ce.detach(), supervised)
    l1 = (p - q).abs().sum(-1)
    accept = (1.0 - l1 / 2).clamp(0.0, 1.0).detach()
    bce = F.binary_cross_entropy_with_logits(conf, accept, reduction="none")
    sums = {name: (w * x).sum() for name, x in zip(TERMS, (ce, l1, bce))}
    if not confidence:
        sums["bce"] = torch.zeros(())
    loss = sum(a * sums[name] for a, name in zip(weights, TERMS))
    loss.backward()
    correct = (z.argmax(-1) == labels) & supervised
    return dict(loss=loss.detach(), sums={k: v.detach() for k, v in sums.items()}, weight_sum=w.sum(),
                hidden=hidden.grad, features=features.grad, w2=w2.grad, confidence=conf.grad, l1=l1.detach(),
                accept=accept, supervised=supervised, correct=correct, z=z.detach(), t=t.detach(), labels=labels)


def run_loss(case, *, multiplier=1.0, cap=None, markov=True, confidence=True, chunk=1024, gamma=4.0,
             weights=(0.1, 0.9, 1.0), layer=None, w2=None, weighting=None):
    layer = case["layer"] if layer is None else layer
    head = OutputHead(layer, V, output_multiplier=multiplier, final_logit_softcapping=cap)
    hidden = case["hidden"].clone().requires_grad_()
    features = case["features"].clone().requires_grad_() if markov else None
    w2 = (case["w2"] if w2 is None else w2).clone().requires_grad_() if markov else None
    conf = case["confidence"].clone().requires_grad_() if confidence else None
    out = dspark_loss(hidden, case["plan"], case["ids"], head, teacher_hidden=case["teacher"], markov_features=features,
                      markov_w2=w2, confidence_logits=conf, ce_weight=weights[0], l1_weight=weights[1],
                      bce_weight=weights[2], decay_gamma=gamma, chunk_slots=chunk, input_mask=case["mask"],
                      weighting=weighting)
    out.loss_sum.backward()
    grads = dict(hidden=hidden.grad, features=None if features is None else features.grad,
                 w2=None if w2 is None else w2.grad, confidence=None if conf is None else conf.grad)
    return out, grads


def close(got, want):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max().clamp(min=1e-30)))


# --------------------------------------------------------------------------------------------------------
# Supervision
# --------------------------------------------------------------------------------------------------------
