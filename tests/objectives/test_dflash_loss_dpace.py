"""D-PACE slot weighting of the DFlash objective (docs/design.md §6 Objectives), single process, fp32.

The oracle is a dense reference in plain torch: the full logits of every predicted slot at once, its
`log_softmax`, and the D-PACE formula written as loops over each block's slots under `torch.no_grad`. The
production paths (the fused kernel, which scales each row's gradient once the weights are known, and the
per-chunk path under activation recomputation, with a frozen or a trainable head) must equal it in the loss,
the denominator and the gradient w.r.t. the hidden states (and the head's weight when it trains), with and
without unsupervised slots, for the full weighting and its two ablations, for every normalisation, for
variable prefixes and for DFlash 2's backbone; two micro-batches must add up to one batch.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megatron_dflash.objectives.dflash_loss import (
    DPACE_NORMALIZATIONS,
    DPACE_SCHEMES,
    LossWeighting,
    OutputHead,
    dflash_loss,
    dpace_weights,
)
from megatron_dflash.objectives.head_loss import head_loss
from megatron_dflash.objectives.variable_prefix import sample_prefix_lengths, variable_prefix_loss
from megatron_dflash.plan.batch_plan import build_dflash_batch_plan
from megatron_dflash.variants.dflash2 import CandidateSelector, dflash2_loss
from largest_tensor import LargestNewTensor
from dpace_reference import reference_block_weights

V, H = 97, 32


def make_case(seed=0, B=3, S=40, N=5, W=5, gaps=True, head_grad=False, vocab=V, hidden_size=H):
    """A batch; with ``gaps`` it has unsupervised slots inside blocks, an invalid block and an empty row."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (B, S), generator=gen)
    mask = torch.ones(B, S, dtype=torch.bool)
    if gaps:
        mask[0, ::3] = False
        mask[1, : S - 7] = False
        mask[2:] = False
    plan = build_dflash_batch_plan(mask, torch.arange(B) + 100, anchors_per_sample=N, block_size=W,
                                   optimizer_step=3, seed=seed)
    hidden = torch.randn(B, N, W, hidden_size, generator=gen).requires_grad_()
    lin = nn.Linear(hidden_size, vocab, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen) * 0.4)
    lin.weight.requires_grad_(head_grad)
    return plan, input_ids, hidden, lin



def dense_reference(hidden, plan, input_ids, weight, *, alpha=0.5, scheme="dpace", normalization="weight_sum",
                    prefix_lengths=None, multiplier=1.0, softcap=None):
    """(loss_sum, denominator, supervised [B, N, W-1]): every slot's full logits at once, plain autograd."""
    B, N, W = plan.loss_mask.shape
    S = input_ids.shape[1]
    slots = torch.arange(1, W)
    supervised = plan.loss_mask[:, :, 1:] & plan.block_valid[:, :, None]
    if prefix_lengths is not None:
        supervised = supervised & (slots[None, None, :] >= prefix_lengths[:, :, None])
    positions = (plan.anchor_positions[:, :, None] + slots[None, None, :]).clamp(max=S - 1)
    labels = torch.gather(input_ids, 1, positions.reshape(B, -1)).view(B, N, W - 1)
    logits = (hidden[:, :, 1:, :] @ weight.t()) * multiplier
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    nll = -F.log_softmax(logits, dim=-1).gather(-1, labels[..., None])[..., 0]  # [B, N, W-1]
    with torch.no_grad():
        q = torch.exp(-nll)
        w = torch.zeros_like(nll)
        for b in range(B):
            for n in range(N):
                w[b, n] = torch.tensor(reference_block_weights(q[b, n].tolist(), supervised[b, n].tolist(), alpha, scheme))
    loss_sum = torch.where(supervised, w * nll, torch.zeros(())).sum()
    denominator = {"weight_sum": w.sum(), "supervised": supervised.sum().float(),
                   "sequences": torch.tensor(float(sum(bool(supervised[b].any()) for b in range(B))))}[normalization]
    return loss_sum, denominator, supervised


def grad_of(loss, tensor):
    (grad,) = torch.autograd.grad(loss, [tensor])
    return grad


def assert_close(a, b, rtol=1e-5, atol=1e-5):
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64),
                               rtol=rtol, atol=atol)


# --------------------------------------------------------------------------------------------------------
# The weights in closed form
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("supervised, weights, numerator", [
    ([True, True, True], [1.98, 1.08, 0.405], 1.8422455),
    ([True, False, True], [1.44, 0.0, 0.54], 1.1904232),
])
def test_closed_form(supervised, weights, numerator):
    q = torch.tensor([[0.8, 0.5, 0.2]])
    nll = -torch.log(q)
    mask = torch.tensor([supervised])
    w = dpace_weights(nll, mask, alpha=0.5)
    assert_close(w[0], weights, rtol=0, atol=1e-6)
    assert_close((w * nll)[mask].sum(), numerator, rtol=0, atol=1e-6)
    assert not w.requires_grad


def test_ablations_closed_form():
    """q~ = [0.9, 0.75, 0.6]: C = [0.9, 0.675, 0.405]; the continuation value is the suffix sum over C_j."""
    nll = -torch.log(torch.tensor([0.8, 0.5, 0.2]))
    every = torch.ones(3, dtype=torch.bool)
    assert_close(dpace_weights(nll, every, scheme="dpace-cumulative-confidence-only"), [0.9, 0.675, 0.405], atol=1e-6)
    assert_close(dpace_weights(nll, every, scheme="dpace-continuation-value-only"), [2.2, 1.6, 1.0], atol=1e-6)
    # alpha = 1 is uniform confidence: the continuation value counts the supervised slots left.
    assert_close(dpace_weights(nll, every, alpha=1.0), [3.0, 2.0, 1.0], atol=1e-6)
    # An unsupervised slot's loss (inf or NaN) never reaches the weights.
    odd = torch.tensor([float("nan"), 0.5, float("inf")])
    w = dpace_weights(odd, torch.tensor([False, True, False]))
    assert torch.isfinite(w).all() and w[0] == 0 and w[2] == 0


# --------------------------------------------------------------------------------------------------------
# The loss against the dense reference
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", DPACE_SCHEMES)
@pytest.mark.parametrize("gaps", [True, False], ids=["unsupervised-slots", "all-supervised"])
def test_matches_the_dense_reference(scheme, gaps):
    plan, ids, hidden, lin = make_case(seed=4, gaps=gaps)
    head = OutputHead(lin, V)
    ref_loss, _, supervised = dense_reference(hidden, plan, ids, lin.weight, scheme=scheme, alpha=0.3)
    assert bool(supervised.all()) != gaps  # the case is what its name says
    ref_grad = grad_of(ref_loss, hidden)
    assert float(ref_grad.abs().max()) > 0
    for fused, chunk in ((True, 7), (True, None), (False, 7), (False, None)):
        for normalization in DPACE_NORMALIZATIONS:
            weighting = LossWeighting(scheme, 0.3, normalization)
            out = dflash_loss(hidden, plan, ids, head, chunk_slots=chunk, fused=fused, weighting=weighting)
            _, ref_denominator, _ = dense_reference(hidden, plan, ids, lin.weight, scheme=scheme, alpha=0.3,
                                                    normalization=normalization)
            assert_close(out.loss_sum, ref_loss)
            assert_close(out.weight_sum, ref_denominator)
        assert_close(grad_of(out.loss_sum, hidden), ref_grad, rtol=1e-4, atol=1e-6)


def test_output_transform_and_a_trainable_head():
    """The multiplier and soft cap enter the confidences and the gradient; a trainable head (the per-chunk path)
    gets the D-PACE-weighted gradient of its weight too."""
    plan, ids, hidden, lin = make_case(seed=5, head_grad=True)
    head = OutputHead(lin, V, output_multiplier=0.7, final_logit_softcapping=2.5)
    ref_loss, ref_denominator, _ = dense_reference(hidden, plan, ids, lin.weight, multiplier=0.7, softcap=2.5)
    ref_grads = torch.autograd.grad(ref_loss, [hidden, lin.weight])
    out = dflash_loss(hidden, plan, ids, head, chunk_slots=6, weighting=LossWeighting("dpace"))
    assert_close(out.loss_sum, ref_loss)
    assert_close(out.weight_sum, ref_denominator)
    for got, want in zip(torch.autograd.grad(out.loss_sum, [hidden, lin.weight]), ref_grads):
        assert_close(got, want, rtol=1e-4, atol=1e-6)
    lin.weight.requires_grad_(False)
    fused = dflash_loss(hidden, plan, ids, head, chunk_slots=6, weighting=LossWeighting("dpace"))
    assert_close(grad_of(fused.loss_sum, hidden), ref_grads[0], rtol=1e-4, atol=1e-6)


def test_the_fused_gradient_follows_the_incoming_gradient_and_skips_it_without_grad():
    plan, ids, hidden, lin = make_case(seed=6)
    head = OutputHead(lin, V)
    weighting = LossWeighting("dpace")
    out = dflash_loss(hidden, plan, ids, head, weighting=weighting)
    g1 = grad_of(out.loss_sum, hidden)
    g2 = grad_of(-1.5 * dflash_loss(hidden, plan, ids, head, weighting=weighting).loss_sum, hidden)
    assert_close(g2, -1.5 * g1)
    with torch.no_grad():
        again = dflash_loss(hidden, plan, ids, head, weighting=weighting)
    assert_close(again.loss_sum, out.loss_sum, rtol=0, atol=0)
    assert_close(again.weight_sum, out.weight_sum, rtol=0, atol=0)


@pytest.mark.parametrize("normalization", DPACE_NORMALIZATIONS)
def test_a_micro_batch_without_supervision_has_a_zero_denominator(normalization):
    """So that the loop counts it as empty and a global batch of such skips its optimizer step (§9)."""
    plan, ids, hidden, lin = make_case(seed=13, B=3, gaps=True)
    rows = slice(2, 3)  # the row without any supervised slot
    empty_plan = build_dflash_batch_plan(plan.loss_mask.new_zeros(1, ids.shape[1]), torch.tensor([102]),
                                         anchors_per_sample=5, block_size=5, optimizer_step=3, seed=13)
    out = dflash_loss(hidden[rows], empty_plan, ids[rows], OutputHead(lin, V),
                      weighting=LossWeighting("dpace", 0.5, normalization))
    assert float(out.weight_sum) == 0.0 and float(out.loss_sum) == 0.0


def test_differs_from_the_static_decay():
    """A check that the weighting really runs: the same batch under uniform weights gives another loss."""
    plan, ids, hidden, lin = make_case(seed=7)
    head = OutputHead(lin, V)
    uniform = dflash_loss(hidden, plan, ids, head)
    dpace = dflash_loss(hidden, plan, ids, head, weighting=LossWeighting("dpace"))
    assert not torch.allclose(uniform.loss_sum / uniform.weight_sum, dpace.loss_sum / dpace.weight_sum)


def test_no_more_than_one_chunk_of_logits():
    B, S, N, W, vocab, hidden_size, chunk = 2, 48, 4, 5, 1000, 8, 4
    plan, ids, hidden, lin = make_case(seed=8, B=B, S=S, N=N, W=W, vocab=vocab, hidden_size=hidden_size)
    head = OutputHead(lin, vocab)
    assert B * N * (W - 1) * hidden_size < chunk * vocab  # so that the bound below is about logits
    for fused in (True, False):
        hidden.grad = None
        with LargestNewTensor() as tracker:
            out = dflash_loss(hidden, plan, ids, head, chunk_slots=chunk, fused=fused, weighting=LossWeighting("dpace"))
            out.loss_sum.backward()
        assert tracker.largest <= chunk * vocab, (fused, tracker.largest, tracker.op)


# --------------------------------------------------------------------------------------------------------
# Accumulation, variable prefixes, DFlash 2
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("normalization", DPACE_NORMALIZATIONS)
def test_two_micro_batches_add_up_to_one_batch(normalization):
    """Every normalisation is a global sum over rows, so splitting the batch changes nothing."""
    B, S, N, W = 4, 40, 5, 5
    gen = torch.Generator().manual_seed(9)
    ids = torch.randint(0, V, (B, S), generator=gen)
    mask = torch.rand(B, S, generator=gen) > 0.3
    mask[3, :30] = False  # rows with very different numbers of supervised slots
    sample_ids = torch.arange(B) * 7 + 1

    def plan_for(rows):
        return build_dflash_batch_plan(mask[rows], sample_ids[rows], anchors_per_sample=N, block_size=W,
                                       optimizer_step=0, seed=1)

    hidden = torch.randn(B, N, W, H, generator=gen).requires_grad_()
    head = OutputHead(nn.Linear(H, V, bias=False).requires_grad_(False), V)
    weighting = LossWeighting("dpace", 0.5, normalization)
    full = dflash_loss(hidden, plan_for(slice(0, 4)), ids, head, chunk_slots=6, weighting=weighting)
    parts = [dflash_loss(hidden[rows], plan_for(rows), ids[rows], head, chunk_slots=6, weighting=weighting)
             for rows in (slice(0, 1), slice(1, 4))]
    assert_close(parts[0].loss_sum + parts[1].loss_sum, full.loss_sum)
    assert_close(parts[0].weight_sum + parts[1].weight_sum, full.weight_sum)
    split = (parts[0].loss_sum + parts[1].loss_sum) / (parts[0].weight_sum + parts[1].weight_sum)
    assert_close(grad_of(split, hidden), grad_of(full.loss_sum / full.weight_sum, hidden))
    # The mean of the micro-batches' own ratios (what a per-micro-batch normalisation does) differs.
    means = [p.loss_sum / p.weight_sum for p in parts]
    assert not torch.allclose((means[0] + means[1]) / 2, full.loss_sum / full.weight_sum)


@pytest.mark.parametrize("fused", [True, False])
def test_variable_prefix(fused):
    """Visible prefix slots are inputs: they leave the block's product alone and get no weight."""
    plan, ids, hidden, lin = make_case(seed=10)
    prefix = sample_prefix_lengths(plan, seed=0, optimizer_step=0, base=0.7, sample_ids=torch.arange(3))
    assert bool((prefix > 1).any())
    head = OutputHead(lin, V)
    ref_loss, ref_denominator, _ = dense_reference(hidden, plan, ids, lin.weight, prefix_lengths=prefix)
    out = variable_prefix_loss(hidden, plan, ids, head, prefix_lengths=prefix, chunk_slots=5, fused=fused,
                               weighting=LossWeighting("dpace"))
    assert_close(out.loss_sum, ref_loss)
    assert_close(out.weight_sum, ref_denominator)
    assert_close(grad_of(out.loss_sum, hidden), grad_of(ref_loss, hidden), rtol=1e-4, atol=1e-6)


def test_dflash2_backbone_takes_the_weights():
    """DFlash 2 with the selector term off is the D-PACE backbone CE; with it on, the backbone part and the
    denominator are unchanged and the selector adds its own term."""
    vocab, hidden_size = 48, 64
    plan, ids, hidden, lin = make_case(seed=11, vocab=vocab, hidden_size=hidden_size)
    selector = CandidateSelector(vocab, hidden_size, 8, 6)
    with torch.no_grad():
        for param in selector.parameters():
            param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(1)) * 0.3)
    head = OutputHead(lin, vocab)
    weighting = LossWeighting("dpace", 0.4, "supervised")
    plain = dflash_loss(hidden, plan, ids, head, chunk_slots=7, weighting=weighting)
    plain_grad = grad_of(plain.loss_sum, hidden)
    for fused in (True, False):
        off = dflash2_loss(hidden, plan, ids, head, selector, selector_weight=0.0, chunk_slots=7, fused=fused,
                           weighting=weighting)
        assert_close(off.loss_sum, plain.loss_sum)
        assert_close(off.weight_sum, plain.weight_sum)
        assert_close(grad_of(off.loss_sum, hidden), plain_grad, rtol=1e-4, atol=1e-6)
        on = dflash2_loss(hidden, plan, ids, head, selector, selector_weight=0.5, chunk_slots=7, fused=fused,
                          weighting=weighting)
        assert_close(on.weight_sum, plain.weight_sum)
        assert_close(on.metrics.base_loss_sum, plain.loss_sum)
        assert_close(on.metrics.loss_weight_sum, plain.weight_sum)
        assert float(on.loss_sum) > float(plain.loss_sum)


# --------------------------------------------------------------------------------------------------------
# Refusals
# --------------------------------------------------------------------------------------------------------


def test_errors_say_what_is_wrong():
    plan, ids, hidden, lin = make_case(seed=12)
    head = OutputHead(lin, V)
    for bad, message in ((dict(dpace_alpha=1.5), "dpace_alpha=1.5 must be in [0, 1]"),
                         (dict(dpace_alpha=-0.1), "must be in [0, 1]"),
                         (dict(scheme="focal"), "loss weighting 'focal' must be one of"),
                         (dict(normalization="tokens"), "normalization 'tokens' must be one of")):
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
            LossWeighting(**bad)
    dpace = LossWeighting("dpace")
    with pytest.raises(ValueError, match="leave decay_gamma and weights None"):
        dflash_loss(hidden, plan, ids, head, decay_gamma=2.0, weighting=dpace)
    with pytest.raises(ValueError, match="does not apply to soft_target='kl'"):
        dflash_loss(hidden, plan, ids, head, weighting=dpace, soft_target="kl",
                    teacher_hidden=torch.zeros(plan.batch_size, plan.seq_length, H))
    with pytest.raises(ValueError, match="Domino"):
        head_loss(hidden[:, :, 1].reshape(-1, H), torch.zeros(15, dtype=torch.long), torch.ones(15), head,
                  features=torch.zeros(15, 4), shard=torch.zeros(V, 4), row_weights=lambda nll: nll)
    assert math.isclose(LossWeighting().dpace_alpha, 0.5) and not LossWeighting().dynamic
    assert LossWeighting("dpace").describe() == "dpace (alpha 0.5, / weight_sum)"
