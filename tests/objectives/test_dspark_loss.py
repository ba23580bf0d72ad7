"""Tests for megatron_dflash.objectives.dspark_loss (single process, fp32).

Oracles: a dense reference written from the objective's formulas (full-vocabulary fp32 logits of every
slot, plain torch softmax / cross entropy / abs / BCE, autograd for the gradients, the supervision built by
a Python loop over blocks and slots), and NeMo AutoModel's reference `compute_dspark_loss` fed the same
dense logits and the supervision mask its own `build_eval_mask` builds.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from megatron_dflash.objectives.dflash_loss import shifted_supervision, slot_targets
from megatron_dflash.objectives.dspark_loss import (
    METRIC_POSITIONS,
    DSparkMetrics,
    dspark_loss,
    dspark_slot_targets,
)
from megatron_dflash.plan.batch_plan import DFlashBatchPlan
from megatron_dflash.target.head import OutputHead
from largest_tensor import LargestNewTensor
from dspark_reference import B, H, N, PADDED, S, TERMS, V, W, close, dense_reference, make_case, naive_supervision, run_loss

pytestmark = pytest.mark.usefixtures("one_thread")

def test_supervision_is_shifted_and_cut_at_the_first_gap():
    case = make_case()
    targets = dspark_slot_targets(case["ids"], case["plan"], input_mask=case["mask"])
    want, positions = naive_supervision(case["plan"], case["mask"])
    assert torch.equal(targets.supervised, want)
    assert want.any(-1).sum() >= 6 and (~want).sum() > 8  # the case has cuts of every kind
    labels = torch.gather(case["ids"], 1, positions.clamp(max=S - 1).view(B, -1)).view(B, N, W)
    assert torch.equal(targets.labels[want], labels[want]) and targets.first_slot == 0
    decay = torch.exp(-torch.arange(W, dtype=torch.float32) / 4.0)
    assert torch.equal(targets.weights, decay * want)
    # Each slot's previous token (the Markov head's input): the block's own tokens, anchor first.
    block = case["plan"].anchor_positions[:, :, None] + torch.arange(W)
    assert torch.equal(targets.tokens, torch.gather(case["ids"], 1, block.view(B, -1)).view(B, N, W))


def test_supervision_equals_the_reference_eval_mask():
    from nemo_automodel.components.speculative.dspark.common import build_eval_mask

    case = make_case()
    plan = case["plan"]
    label_indices = plan.anchor_positions[:, :, None] + torch.arange(1, W + 1)
    safe = torch.where(plan.block_valid[:, :, None], label_indices.clamp(max=S - 1), 0)
    want = build_eval_mask(seq_len=S, loss_mask=case["mask"].float(), label_indices=label_indices,
                           safe_label_indices=safe, block_keep_mask=plan.block_valid)
    assert torch.equal(dspark_slot_targets(case["ids"], plan, input_mask=case["mask"]).supervised, want)


def test_shifted_supervision_stops_at_a_packed_document_boundary():
    documents = torch.tensor([[0] * 10 + [1] * 10])
    plan = DFlashBatchPlan.from_anchors(torch.tensor([[3, 2, 12]]), block_size=7, seq_length=20,
                                        document_ids=documents)
    sup = shifted_supervision(plan)
    # anchor 3: label of the last slot is 10, the next document; anchor 2: label 9, its own; anchor 12: label
    # 19 is its own document's last token.
    assert sup[0, 0].tolist() == [True] * 6 + [False]
    assert sup[0, 1].all() and sup[0, 2].all()
    shifted = slot_targets(torch.zeros(1, 20, dtype=torch.long), plan, shift_label=True, decay_gamma=2.0)
    assert torch.equal(shifted.supervised, sup)
    with pytest.raises(ValueError, match="prefix_lengths"):
        slot_targets(torch.zeros(1, 20, dtype=torch.long), plan, shift_label=True,
                     prefix_lengths=torch.ones(1, 3, dtype=torch.long))


# --------------------------------------------------------------------------------------------------------
# The loss against the dense reference
# --------------------------------------------------------------------------------------------------------


CONFIGS = {
    "full": dict(),
    "transform": dict(multiplier=0.8, cap=3.0, bias=True),
    "no_markov": dict(markov=False),
    "no_confidence": dict(confidence=False),
    "bare": dict(markov=False, confidence=False, gamma=None, weights=(1.0, 0.5, 0.0)),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("chunk", [None, 5, 1])
def test_equals_dense_reference(name, chunk):
    options = dict(CONFIGS[name])
    case = make_case(seed=1, bias=options.pop("bias", False))
    want = dense_reference(case, **options)
    out, grads = run_loss(case, chunk=chunk, **options)
    close(out.loss_sum.detach(), want["loss"])
    assert torch.equal(out.weight_sum, want["weight_sum"])
    m = out.metrics
    for term in TERMS:
        close(getattr(m, f"{term}_loss_sum").float(), want["sums"][term])
    assert float(m.ce_loss_sum) > 0 and float(m.l1_loss_sum) > 0
    markov, confidence = options.get("markov", True), options.get("confidence", True)
    absent = {"hidden": False, "features": not markov, "w2": not markov, "confidence": not confidence}
    for key in ("hidden", "features", "w2", "confidence"):
        assert (grads[key] is None) == absent[key], key
        if absent[key]:
            continue
        assert float(want[key].abs().max()) > 0, key
        close(grads[key], want[key])
    if grads["w2"] is not None:
        assert float(grads["w2"][V:].abs().max()) == 0.0  # padding rows of the vocabulary


def test_metrics_equal_dense_reference():
    case = make_case(seed=2)
    want = dense_reference(case)
    out, _ = run_loss(case, chunk=4)
    m = out.metrics
    sup, accept = want["supervised"], want["accept"].double()
    assert float(m.supervised_tokens) == sup.sum() and float(m.correct_tokens) == want["correct"].sum()
    torch.testing.assert_close(m.accept_rate_sums[:W], (accept * sup).sum((0, 1)), rtol=1e-5, atol=1e-6)
    assert torch.equal(m.accept_rate_counts[:W], sup.sum((0, 1)).double())
    assert float(m.accept_rate_sums[W:].abs().sum()) == 0 and m.accept_rate_sums.shape == (METRIC_POSITIONS,)
    # Expected acceptance: 1 + the sum of the running products of the acceptance probabilities.
    counted = sup[:, :, 0]
    tau = ((accept * sup).cumprod(-1).sum(-1) + 1)[counted].sum()
    torch.testing.assert_close(m.expected_acceptance_sum, tau, rtol=1e-5, atol=1e-6)
    # Greedy acceptance: 1 + the consecutive correct slots from slot 0.
    run = (want["correct"] & sup).int().cumprod(-1).sum(-1)
    assert float(m.acceptance_sum) == float((run + 1)[counted].sum()) and float(m.valid_blocks) == counted.sum()
    probs = case["confidence"].double().sigmoid()
    weights = dspark_slot_targets(case["ids"], case["plan"], input_mask=case["mask"]).weights.double()
    torch.testing.assert_close(m.confidence_abs_error_sum, ((probs - accept).abs() * weights).sum(), rtol=1e-5, atol=1e-6)
    assert float(m.confidence_weight_sum) == pytest.approx(float(weights.sum()))
    logged = m.log_values()
    assert {f"accept_rate@{k}" for k in range(W)} <= set(logged) and f"accept_rate@{W}" not in logged
    assert {"tau", "accept rate", "ce loss", "l1 loss", "bce loss", "confidence error"} <= set(logged)
    assert logged["tau"] == pytest.approx(float(tau / counted.sum()), rel=1e-5)
    assert "confidence error" not in run_loss(case, confidence=False)[0].metrics.log_values()


def test_equals_nemo_reference():
    """NeMo AutoModel's `compute_dspark_loss` on the dense logits (draft with the Markov bias, target) and its
    own eval mask: the loss, its three terms and the acceptance / calibration diagnostics."""
    from nemo_automodel.components.speculative.dspark.common import DSparkForwardOutput, build_eval_mask
    from nemo_automodel.components.speculative.dspark.loss import compute_dspark_loss

    case = make_case(seed=3)
    want = dense_reference(case)
    out, _ = run_loss(case, chunk=3)
    plan = case["plan"]
    label_indices = plan.anchor_positions[:, :, None] + torch.arange(1, W + 1)
    safe = torch.where(plan.block_valid[:, :, None], label_indices.clamp(max=S - 1), 0)
    eval_mask = build_eval_mask(seq_len=S, loss_mask=case["mask"].float(), label_indices=label_indices,
                                safe_label_indices=safe, block_keep_mask=plan.block_valid)
    outputs = DSparkForwardOutput(
        draft_logits=want["z"], target_ids=torch.gather(case["ids"], 1, safe.view(B, -1)).view(B, N, W),
        eval_mask=eval_mask, block_keep_mask=plan.block_valid, confidence_pred=case["confidence"],
        aligned_target_logits=want["t"],
    )
    loss, terms = compute_dspark_loss(outputs=outputs, loss_decay_gamma=4.0, ce_loss_alpha=0.1, l1_loss_alpha=0.9,
                                      confidence_head_alpha=1.0, return_terms=True)
    m = out.metrics
    ours = float(out.loss_sum) / float(out.weight_sum)
    assert ours == pytest.approx(float(loss), rel=1e-5)
    for term, key in zip(TERMS, ("ce_loss", "l1_loss", "confidence_loss")):
        assert float(getattr(m, f"{term}_loss")) == pytest.approx(float(terms[key]), rel=1e-5)
    torch.testing.assert_close(m.accept_rate_sums[:W], terms["accept_rate_per_pos_num"].double(), rtol=1e-5, atol=1e-6)
    assert torch.equal(m.accept_rate_counts[:W], terms["accept_rate_per_pos_den"].double())
    assert float(m.expected_acceptance_sum) == pytest.approx(float(terms["tau_num"]), rel=1e-5)
    assert float(m.valid_blocks) == float(terms["tau_den"])
    for ours_name, key in (("abs_error", "confidence_abs_error_num"), ("bias", "confidence_bias_num"),
                           ("cumprod_bias", "confidence_cumprod_bias_num")):
        assert float(getattr(m, f"confidence_{ours_name}_sum")) == pytest.approx(float(terms[key]), rel=1e-5, abs=1e-6)
    assert float(m.confidence_weight_sum) == pytest.approx(float(terms["confidence_diag_den"]), rel=1e-6)


def test_two_micro_batches_equal_one_batch():
    """The global division makes the objective independent of how the batch is split."""
    case = make_case(seed=4)
    whole, grads = run_loss(case, chunk=6)
    parts, part_grads = [], []
    for row in range(B):
        sub = dict(case)
        rows = slice(row, row + 1)
        plan = case["plan"]
        sub["plan"] = DFlashBatchPlan.from_anchors(plan.anchor_positions[rows], block_size=W,
                                                   block_valid=plan.block_valid[rows], input_mask=case["mask"][rows])
        for key in ("ids", "mask", "hidden", "teacher", "features", "confidence"):
            sub[key] = case[key][rows]
        out, g = run_loss(sub, chunk=6)
        parts.append(out)
        part_grads.append(g)
    total_weight = sum(p.weight_sum for p in parts)
    assert torch.equal(total_weight, whole.weight_sum)
    close(sum(p.loss_sum.detach() for p in parts) / total_weight, whole.loss_sum.detach() / whole.weight_sum)
    for key in ("hidden", "features", "confidence"):
        close(torch.cat([g[key] for g in part_grads]), grads[key])
    close(part_grads[0]["w2"] + part_grads[1]["w2"], grads["w2"])
    summed = parts[0].metrics + parts[1].metrics
    torch.testing.assert_close(summed._stack(), whole.metrics._stack(), rtol=1e-6, atol=1e-6)
    assert isinstance(summed, DSparkMetrics) and summed.accept_rate_sums.shape == (METRIC_POSITIONS,)
    zeros = DSparkMetrics.zeros()
    assert zeros.size() == summed.size() == 2 * METRIC_POSITIONS + 13


def test_no_grad_and_bfloat16():
    case = make_case(seed=5)
    head = OutputHead(case["layer"], V)
    kwargs = dict(teacher_hidden=case["teacher"], markov_features=case["features"], markov_w2=case["w2"],
                  confidence_logits=case["confidence"], input_mask=case["mask"], chunk_slots=4)
    with torch.no_grad():
        out = dspark_loss(case["hidden"], case["plan"], case["ids"], head, **kwargs)
    want = dense_reference(case)
    close(out.loss_sum, want["loss"])
    # bf16 hidden states and head: fp32 logits, gradients in the inputs' dtypes.
    layer = nn.Linear(H, PADDED, bias=False).to(torch.bfloat16).requires_grad_(False)
    with torch.no_grad():
        layer.weight.copy_(case["layer"].weight)
    hidden = case["hidden"].to(torch.bfloat16).requires_grad_()
    w2 = case["w2"].clone().requires_grad_()
    kwargs["markov_w2"] = w2
    out16 = dspark_loss(hidden, case["plan"], case["ids"], OutputHead(layer, V), **kwargs)
    out16.loss_sum.backward()
    assert hidden.grad.dtype == torch.bfloat16 and w2.grad.dtype == torch.float32
    assert float(out16.loss_sum) == pytest.approx(float(want["loss"]), rel=2e-2)


def test_never_materialises_more_than_one_chunk_of_logits():
    case = make_case(seed=6)
    chunk = 4
    tracker = LargestNewTensor()
    with tracker:
        out, _ = run_loss(case, cap=5.0, chunk=chunk)
    # The inputs and their gradients (hidden [M, H], teacher [B, S, H]) aside, nothing beyond one chunk.
    bound = max(chunk * PADDED, B * N * W * H, B * S * H)
    assert tracker.largest <= bound, (tracker.largest, tracker.op)
    assert B * N * W * PADDED > 5 * bound and math.isfinite(float(out.loss_sum))


def test_rejects_bad_inputs():
    case = make_case()
    head = OutputHead(case["layer"], V)
    base = dict(teacher_hidden=case["teacher"])
    call = lambda **kw: dspark_loss(case["hidden"], case["plan"], case["ids"], head, **{**base, **kw})  # noqa: E731
    with pytest.raises(ValueError, match="together"):
        call(markov_features=case["features"])
    with pytest.raises(ValueError, match="V_local"):
        call(markov_features=case["features"], markov_w2=case["w2"][:V])
    with pytest.raises(ValueError, match="teacher_hidden"):
        call(teacher_hidden=case["teacher"][:, :-1])
    with pytest.raises(ValueError, match="confidence_logits"):
        call(confidence_logits=case["confidence"][..., :-1])
    with pytest.raises(ValueError, match="l1_weight"):
        call(l1_weight=-1.0)
    with pytest.raises(ValueError, match="decay_gamma"):
        call(decay_gamma=0.0)
    trainable = OutputHead(nn.Linear(H, PADDED), V)
    with pytest.raises(ValueError, match="frozen"):
        dspark_loss(case["hidden"], case["plan"], case["ids"], trainable, **base)
