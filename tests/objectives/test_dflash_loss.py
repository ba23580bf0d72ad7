"""Tests for megatron_dflash.objectives.dflash_loss and megatron_dflash.objectives.variable_prefix (single process, fp32).

Every loss is checked against a naive reference written straight from the conventions: a Python loop over
blocks and slots that computes the full-vocabulary logits of one slot at a time and calls
`F.cross_entropy` / `F.kl_div`. The chunked production path must equal it in value and in every gradient,
whatever the chunk size, and must never create a tensor larger than one chunk of logits.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megatron_dflash.objectives.dflash_loss import (
    DFlashMetrics,
    OutputHead,
    acceptance_lengths,
    block_labels,
    block_tokens,
    decay_weights,
    dflash_loss,
    embed_blocks,
)
from megatron_dflash.plan.batch_plan import DFlashBatchPlan, build_dflash_batch_plan
from megatron_dflash.objectives.variable_prefix import (
    prefix_length_prior,
    sample_prefix_lengths,
    variable_prefix_loss,
)
from largest_tensor import LargestNewTensor

V, H = 97, 32
MASK_ID = 3


# --------------------------------------------------------------------------------------------------------
# Fixtures and the naive reference
# --------------------------------------------------------------------------------------------------------


def make_case(seed=0, B=3, S=40, N=5, W=5, hidden_size=H, vocab=V, padded_vocab=None, head_grad=True):
    """A batch with unsupervised gaps, invalid blocks and a row without any valid block.

    row 0: every third token unsupervised (gaps inside blocks); row 1: 4 eligible anchors for N = 5 (an
    invalid block); row 2: nothing supervised (no valid block).
    """
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (B, S), generator=gen)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[0, ::3] = False
    if B > 1:
        mask[1, : S - 7] = False
    if B > 2:
        mask[2] = False
    plan = build_dflash_batch_plan(
        mask, torch.arange(B) + 100, anchors_per_sample=N, block_size=W, optimizer_step=3, seed=seed
    )
    hidden = torch.randn(B, N, W, hidden_size, generator=gen, dtype=torch.float64).float().requires_grad_()
    lin = nn.Linear(hidden_size, padded_vocab or vocab, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen) * 0.3)
    lin.weight.requires_grad_(head_grad)
    return plan, input_ids, hidden, lin


def naive_loss(
    hidden,
    plan,
    input_ids,
    weight,
    *,
    vocab=V,
    decay_gamma=None,
    multiplier=1.0,
    softcap=None,
    prefix_lengths=None,
    teacher_hidden=None,
    soft_target="none",
    temperature=1.0,
):
    """(loss_sum, weight_sum, metrics dict) by a loop over every block and slot."""

    def logits_of(h):
        z = (h @ weight.t()).float()[:vocab] * multiplier
        if softcap is not None:
            z = torch.tanh(z / softcap) * softcap
        return z

    B, N, W = plan.loss_mask.shape
    loss = hidden.sum() * 0.0
    weight_sum = 0.0
    supervised_tokens = correct_tokens = acceptance_sum = valid_blocks = 0
    for b in range(B):
        for n in range(N):
            valid = bool(plan.block_valid[b, n])
            p = int(plan.anchor_positions[b, n])
            start = 1 if prefix_lengths is None else int(prefix_lengths[b, n])
            run, running, first_supervised = 0, True, None
            for k in range(1, W):
                supervised = valid and bool(plan.loss_mask[b, n, k]) and k >= start
                if k == start:
                    first_supervised = supervised
                if not supervised:
                    if k >= start:
                        running = False
                    continue
                w = 1.0 if decay_gamma is None else math.exp(-(k - start) / decay_gamma)
                label = int(input_ids[b, p + k])
                z = logits_of(hidden[b, n, k])
                if soft_target == "none":
                    slot_loss = F.cross_entropy(z[None], torch.tensor([label]))
                else:
                    t = logits_of(teacher_hidden[b, p + k - 1]).detach()
                    q = F.softmax(t / temperature, dim=-1)
                    logp = F.log_softmax(z / temperature, dim=-1)
                    if soft_target == "ce":
                        slot_loss = -(q * logp).sum()
                    else:
                        slot_loss = F.kl_div(logp, q, reduction="sum")
                    slot_loss = slot_loss * temperature**2
                loss = loss + w * slot_loss
                weight_sum += w
                supervised_tokens += 1
                correct = int(z.argmax()) == label
                correct_tokens += int(correct)
                if running and correct:
                    run += 1
                else:
                    running = False
            if valid and first_supervised:
                valid_blocks += 1
                acceptance_sum += run + 1
    metrics = dict(
        supervised_tokens=supervised_tokens,
        correct_tokens=correct_tokens,
        acceptance_sum=acceptance_sum,
        valid_blocks=valid_blocks,
    )
    return loss, weight_sum, metrics


def grads_of(loss, tensors):
    for t in tensors:
        t.grad = None
    loss.backward()
    return [t.grad.clone() for t in tensors]


def metrics_dict(metrics: DFlashMetrics) -> dict:
    return {k: float(v) for k, v in metrics.to_dict().items() if k in DFlashMetrics.field_names()}


def assert_close(a, b, **kw):
    kw.setdefault("rtol", 1e-5)
    kw.setdefault("atol", 1e-5)
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64), **kw)


# --------------------------------------------------------------------------------------------------------
# The hard-label loss against the naive reference
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("decay_gamma", [None, 2.0])
def test_loss_matches_naive_reference(decay_gamma):
    plan, ids, hidden, lin = make_case()
    out = dflash_loss(hidden, plan, ids, OutputHead(lin, V), decay_gamma=decay_gamma, chunk_slots=7)
    ref_loss, ref_wsum, ref_metrics = naive_loss(hidden, plan, ids, lin.weight, decay_gamma=decay_gamma)
    assert ref_wsum > 0 and ref_metrics["supervised_tokens"] < plan.block_valid.sum() * (plan.block_size - 1)
    assert_close(out.loss_sum, ref_loss)
    assert_close(out.weight_sum, ref_wsum)
    assert out.weight_sum.requires_grad is False
    assert metrics_dict(out.metrics) == {k: float(v) for k, v in ref_metrics.items()}
    got = grads_of(out.loss_sum, [hidden, lin.weight])
    want = grads_of(ref_loss, [hidden, lin.weight])
    for g, w in zip(got, want):
        assert_close(g, w)
    # Slot 0, unsupervised slots and invalid blocks get no gradient.
    assert torch.all(got[0][:, :, 0] == 0)
    assert torch.all(got[0][~plan.loss_mask] == 0)


@pytest.mark.parametrize("chunk_slots", [1, 7, None])
def test_chunked_equals_unchunked(chunk_slots):
    plan, ids, hidden, lin = make_case(seed=1)
    head = OutputHead(lin, V)
    full = dflash_loss(hidden, plan, ids, head, decay_gamma=3.0, chunk_slots=None)
    full_grads = grads_of(full.loss_sum, [hidden, lin.weight])
    out = dflash_loss(hidden, plan, ids, head, decay_gamma=3.0, chunk_slots=chunk_slots)
    grads = grads_of(out.loss_sum, [hidden, lin.weight])
    assert_close(out.loss_sum, full.loss_sum)
    assert_close(out.weight_sum, full.weight_sum)
    assert metrics_dict(out.metrics) == metrics_dict(full.metrics)
    for g, w in zip(grads, full_grads):
        assert_close(g, w)


def test_frozen_head_and_no_grad():
    plan, ids, hidden, lin = make_case(seed=2, head_grad=False)
    out = dflash_loss(hidden, plan, ids, OutputHead(lin, V), chunk_slots=4)
    out.loss_sum.backward()
    assert lin.weight.grad is None and hidden.grad is not None
    with torch.no_grad():
        again = dflash_loss(hidden, plan, ids, OutputHead(lin, V), chunk_slots=4)
    assert_close(again.loss_sum, out.loss_sum)


def test_softcap_multiplier_and_padded_vocab():
    # The layer is wider than the vocabulary (megatron pads it): the extra columns are not part of softmax.
    plan, ids, hidden, lin = make_case(seed=3, padded_vocab=V + 7)
    with torch.no_grad():
        lin.weight[V:] = 5.0  # large logits in the padding would dominate if they were not excluded
    head = OutputHead(lin, V, output_multiplier=0.5, final_logit_softcapping=3.0)
    out = dflash_loss(hidden, plan, ids, head, decay_gamma=2.0, chunk_slots=5)
    ref_loss, ref_wsum, ref_metrics = naive_loss(
        hidden, plan, ids, lin.weight, decay_gamma=2.0, multiplier=0.5, softcap=3.0
    )
    assert_close(out.loss_sum, ref_loss)
    assert metrics_dict(out.metrics) == {k: float(v) for k, v in ref_metrics.items()}
    for g, w in zip(grads_of(out.loss_sum, [hidden, lin.weight]), grads_of(ref_loss, [hidden, lin.weight])):
        assert_close(g, w)
    # Without the transform the value differs: the transform is really applied.
    plain = dflash_loss(hidden, plan, ids, OutputHead(lin, V), decay_gamma=2.0)
    assert not torch.allclose(plain.loss_sum, out.loss_sum)
    logits = head.local_logits(hidden[0, 0, 1])
    assert logits.dtype == torch.float32 and torch.all(logits[V:] == float("-inf"))
    assert float(logits[:V].abs().max()) <= 3.0


def test_megatron_column_head_on_one_rank_with_tied_weight():
    """A megatron output layer built without a weight (tied embeddings) takes the weight from OutputHead."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    from megatron_dflash.draft.body import default_parallel_config
    from megatron_dflash.common.parallel import SingleRankGroup

    plan, ids, hidden, lin = make_case(seed=10, padded_vocab=V + 3)
    layer = ColumnParallelLinear(
        H, V + 3, config=default_parallel_config(), init_method=nn.init.zeros_, bias=False,
        gather_output=True, skip_weight_param_allocation=True, tp_group=SingleRankGroup(),
    )
    with pytest.raises(ValueError, match="weight"):
        OutputHead(layer, V).local_logits(hidden[0, 0])
    head = OutputHead(layer, V, tp_group=SingleRankGroup(), weight=lin.weight)
    assert head.vocab_range == (0, V + 3) and head.local_vocab_size == V + 3
    out = dflash_loss(hidden, plan, ids, head, decay_gamma=2.0, chunk_slots=5)
    grads = grads_of(out.loss_sum, [hidden, lin.weight])
    ref = dflash_loss(hidden, plan, ids, OutputHead(lin, V), decay_gamma=2.0, chunk_slots=None)
    assert_close(out.loss_sum, ref.loss_sum)
    for g, w in zip(grads, grads_of(ref.loss_sum, [hidden, lin.weight])):
        assert_close(g, w)


def test_bf16_hidden_runs_in_fp32():
    plan, ids, hidden, lin = make_case(seed=4)
    out32 = dflash_loss(hidden, plan, ids, OutputHead(lin, V))
    h16 = hidden.detach().bfloat16().requires_grad_()
    out16 = dflash_loss(h16, plan, ids, OutputHead(lin, V))
    out16.loss_sum.backward()
    assert out16.loss_sum.dtype == torch.float32 and h16.grad.dtype == torch.bfloat16
    assert_close(out16.loss_sum, out32.loss_sum, rtol=2e-2, atol=1e-1)


# --------------------------------------------------------------------------------------------------------
# The fused loss (frozen head: gradient w.r.t. the hidden states formed in forward)
# --------------------------------------------------------------------------------------------------------

FUSED_CASES = {
    "hard": dict(decay_gamma=2.0),
    "hard-one-chunk": dict(decay_gamma=None, chunk_slots=None),
    "transform-padded": dict(decay_gamma=2.0, multiplier=0.5, softcap=3.0, padded=7),
    "ce-T2-softcap": dict(decay_gamma=2.0, softcap=4.0, soft_target="ce", temperature=2.0),
    "kl-T0.7": dict(decay_gamma=2.0, soft_target="kl", temperature=0.7, multiplier=1.3),
    "kl-prefix": dict(decay_gamma=1.0, soft_target="kl", prefix=True),
}


@pytest.mark.parametrize("case", list(FUSED_CASES))
def test_fused_matches_naive_and_the_chunked_path(case):
    kw = dict(FUSED_CASES[case])
    multiplier, softcap, padded = kw.pop("multiplier", 1.0), kw.pop("softcap", None), kw.pop("padded", 0)
    chunk_slots = kw.pop("chunk_slots", 6)
    plan, ids, hidden, lin = make_case(seed=11, padded_vocab=V + padded, head_grad=False)
    if padded:
        with torch.no_grad():
            lin.weight[V:] = 5.0  # padding columns would dominate softmax and argmax if they were formed
    if kw.pop("prefix", False):
        kw["prefix_lengths"] = sample_prefix_lengths(plan, seed=0, optimizer_step=0, base=0.8, sample_ids=torch.arange(3))
    if kw.get("soft_target"):
        kw["teacher_hidden"] = torch.randn(plan.batch_size, plan.seq_length, H, generator=torch.Generator().manual_seed(2))
    head = OutputHead(lin, V, output_multiplier=multiplier, final_logit_softcapping=softcap)

    fused = dflash_loss(hidden, plan, ids, head, chunk_slots=chunk_slots, **kw)
    (fused_grad,) = grads_of(fused.loss_sum, [hidden])
    assert lin.weight.grad is None
    chunked = dflash_loss(hidden, plan, ids, head, chunk_slots=chunk_slots, fused=False, **kw)
    (chunked_grad,) = grads_of(chunked.loss_sum, [hidden])
    ref_loss, ref_wsum, ref_metrics = naive_loss(hidden, plan, ids, lin.weight, multiplier=multiplier, softcap=softcap, **kw)
    (ref_grad,) = grads_of(ref_loss, [hidden])

    assert ref_wsum > 0 and float(ref_grad.abs().max()) > 0
    for other, other_grad in ((ref_loss, ref_grad), (chunked.loss_sum, chunked_grad)):
        assert_close(fused.loss_sum, other, rtol=1e-5, atol=1e-4)
        assert_close(fused_grad, other_grad, rtol=1e-4, atol=1e-6)
    assert_close(fused.weight_sum, ref_wsum)
    assert metrics_dict(fused.metrics) == {k: float(v) for k, v in ref_metrics.items()} == metrics_dict(chunked.metrics)
    assert torch.all(fused_grad[:, :, 0] == 0) and torch.all(fused_grad[~plan.loss_mask] == 0)

    # Without grad (evaluation) the fused path skips the gradient and returns the same loss and metrics.
    with torch.no_grad():
        again = dflash_loss(hidden, plan, ids, head, chunk_slots=chunk_slots, **kw)
    assert_close(again.loss_sum, fused.loss_sum, rtol=0, atol=0)
    assert metrics_dict(again.metrics) == metrics_dict(fused.metrics)


def test_fused_scales_by_the_incoming_gradient_and_casts_to_bf16():
    plan, ids, hidden, lin = make_case(seed=12, head_grad=False)
    head = OutputHead(lin, V)
    (g1,) = torch.autograd.grad(dflash_loss(hidden, plan, ids, head, decay_gamma=2.0).loss_sum, [hidden])
    (g3,) = torch.autograd.grad(-2.5 * dflash_loss(hidden, plan, ids, head, decay_gamma=2.0).loss_sum, [hidden])
    assert_close(g3, -2.5 * g1)
    h16 = hidden.detach().bfloat16().requires_grad_()
    out16 = dflash_loss(h16, plan, ids, head, decay_gamma=2.0)
    out16.loss_sum.backward()
    ref16 = dflash_loss(h16.detach().float().requires_grad_(), plan, ids, head, decay_gamma=2.0)
    assert h16.grad.dtype == torch.bfloat16
    assert_close(out16.loss_sum, ref16.loss_sum)


def test_fused_requires_a_frozen_head():
    plan, ids, hidden, lin = make_case(seed=13, head_grad=True)
    with pytest.raises(ValueError, match="frozen"):
        dflash_loss(hidden, plan, ids, OutputHead(lin, V), fused=True)
    with pytest.raises(ValueError, match="fused"):
        dflash_loss(hidden, plan, ids, OutputHead(lin, V), fused="yes")


# --------------------------------------------------------------------------------------------------------
# Memory honesty
# --------------------------------------------------------------------------------------------------------


def test_never_materialises_more_than_one_chunk_of_logits():
    B, S, N, W, vocab, hidden_size, chunk = 2, 48, 4, 5, 1000, 8, 4
    plan, ids, hidden, lin = make_case(seed=5, B=B, S=S, N=N, W=W, vocab=vocab, hidden_size=hidden_size, head_grad=False)
    head = OutputHead(lin, vocab, final_logit_softcapping=20.0)
    M = B * N * (W - 1)
    assert M * hidden_size < chunk * vocab  # so that the bound below is about logits
    with LargestNewTensor() as tracker:
        out = dflash_loss(hidden, plan, ids, head, decay_gamma=2.0, chunk_slots=chunk)
        out.loss_sum.backward()
    assert tracker.largest <= chunk * vocab, (tracker.largest, tracker.op)
    # The tracker does see logits: the unchunked path allocates all-slot logits.
    hidden.grad = None
    with LargestNewTensor() as tracker_all:
        dflash_loss(hidden, plan, ids, head, decay_gamma=2.0, chunk_slots=None).loss_sum.backward()
    assert tracker_all.largest >= M * vocab
    # Soft targets are chunked too (teacher logits included).
    teacher = torch.randn(B, S, hidden_size)
    hidden.grad = None
    with LargestNewTensor() as tracker_soft:
        dflash_loss(
            hidden, plan, ids, head, teacher_hidden=teacher, soft_target="kl", temperature=2.0, chunk_slots=chunk
        ).loss_sum.backward()
    assert tracker_soft.largest <= chunk * vocab, (tracker_soft.largest, tracker_soft.op)


# --------------------------------------------------------------------------------------------------------
# Global-batch normalisation
# --------------------------------------------------------------------------------------------------------


def test_normalisation_is_independent_of_the_split():
    B, S, N, W = 4, 40, 5, 5
    gen = torch.Generator().manual_seed(6)
    ids = torch.randint(0, V, (B, S), generator=gen)
    mask = torch.rand(B, S, generator=gen) > 0.3
    mask[3, :30] = False  # rows with very different numbers of supervised tokens
    sample_ids = torch.arange(B) * 7 + 1

    def plan_for(rows):
        return build_dflash_batch_plan(
            mask[rows], sample_ids[rows], anchors_per_sample=N, block_size=W, optimizer_step=0, seed=1
        )

    hidden = torch.randn(B, N, W, H, generator=gen).requires_grad_()
    lin = nn.Linear(H, V, bias=False)
    head = OutputHead(lin, V)

    full = dflash_loss(hidden, plan_for(slice(0, 4)), ids, head, decay_gamma=2.0, chunk_slots=6)
    full_grad = grads_of(full.loss_sum / full.weight_sum, [hidden, lin.weight])

    halves = [(slice(0, 1), slice(0, 1)), (slice(1, 4), slice(1, 4))]
    outs = [
        dflash_loss(hidden[rows], plan_for(rows), ids[rows], head, decay_gamma=2.0, chunk_slots=6)
        for rows, _ in halves
    ]
    assert not torch.allclose(outs[0].loss_sum / outs[0].weight_sum, outs[1].loss_sum / outs[1].weight_sum)
    global_weight = outs[0].weight_sum + outs[1].weight_sum
    split_loss = (outs[0].loss_sum + outs[1].loss_sum) / global_weight
    assert_close(split_loss, full.loss_sum / full.weight_sum)
    split_grad = grads_of(split_loss, [hidden, lin.weight])
    for g, w in zip(split_grad, full_grad):
        assert_close(g, w)
    summed = outs[0].metrics + outs[1].metrics
    assert metrics_dict(summed) == metrics_dict(full.metrics)
    # The per-micro-batch mean (what must not be done) differs.
    mean_of_means = (outs[0].loss_sum / outs[0].weight_sum + outs[1].loss_sum / outs[1].weight_sum) / 2
    assert not torch.allclose(mean_of_means, full.loss_sum / full.weight_sum)


# --------------------------------------------------------------------------------------------------------
# Weights, labels, block inputs
# --------------------------------------------------------------------------------------------------------


def test_decay_weights_values():
    e = math.exp
    assert_close(decay_weights((1, 1, 5), decay_gamma=2.0)[0, 0], [0, 1, e(-0.5), e(-1), e(-1.5)])
    assert_close(decay_weights((1, 1), block_size=5)[0, 0], [0, 1, 1, 1, 1])
    prefix = torch.tensor([[3, 1]])
    w = decay_weights((1, 2, 5), decay_gamma=2.0, prefix_lengths=prefix)
    assert_close(w[0, 0], [0, 0, 0, 1, e(-0.5)])
    assert_close(w[0, 1], [0, 1, e(-0.5), e(-1), e(-1.5)])
    plan, *_ = make_case()
    assert decay_weights(plan, decay_gamma=1.0).shape == plan.loss_mask.shape
    with pytest.raises(ValueError, match="decay_gamma"):
        decay_weights((1, 1, 5), decay_gamma=0.0)
    with pytest.raises(ValueError, match="block_size"):
        decay_weights((1, 1))


def test_labels_and_block_tokens():
    ids = torch.arange(100, 120)[None].repeat(2, 1)
    plan = DFlashBatchPlan.from_anchors(
        torch.tensor([[2, 10], [5, 0]]), block_size=4, seq_length=20, block_valid=torch.tensor([[True, True], [True, False]])
    )
    labels = block_labels(ids, plan)
    assert labels[0, 0].tolist() == [102, 103, 104, 105]  # slot k holds the token AT p + k
    assert labels[1, 0].tolist() == [105, 106, 107, 108]
    tokens = block_tokens(ids, plan, mask_token_id=MASK_ID)
    assert tokens[0, 1].tolist() == [110, MASK_ID, MASK_ID, MASK_ID]
    assert tokens[1, 1].tolist() == [MASK_ID] * 4  # invalid block: all MASK
    tokens = block_tokens(ids, plan, mask_token_id=MASK_ID, prefix_lengths=torch.tensor([[3, 1], [2, 2]]))
    assert tokens[0, 0].tolist() == [102, 103, 104, MASK_ID]
    assert tokens[0, 1].tolist() == [110, MASK_ID, MASK_ID, MASK_ID]
    assert tokens[1, 0].tolist() == [105, 106, MASK_ID, MASK_ID]
    assert tokens[1, 1].tolist() == [MASK_ID] * 4
    with pytest.raises(ValueError, match="input_ids"):
        block_labels(ids[:, :10], plan)


class CountingEmbedding(nn.Embedding):
    calls = 0

    def forward(self, tokens):
        CountingEmbedding.calls += 1
        return super().forward(tokens)


def test_embed_blocks_calls_the_embedding_module_and_scales():
    ids = torch.randint(0, 50, (2, 20), generator=torch.Generator().manual_seed(0))
    plan = DFlashBatchPlan.from_anchors(torch.tensor([[2, 10], [5, 7]]), block_size=4, seq_length=20)
    embedding = CountingEmbedding(50, 6)
    CountingEmbedding.calls = 0
    out = embed_blocks(ids, plan, embedding, mask_token_id=MASK_ID, input_embedding_scale=2.5)
    assert CountingEmbedding.calls == 1
    tokens = block_tokens(ids, plan, mask_token_id=MASK_ID)
    assert out.shape == (2, 2, 4, 6)
    assert_close(out, embedding.weight[tokens] * 2.5)
    assert_close(out[0, 0, 1], embedding.weight[MASK_ID] * 2.5)
    prefix = torch.tensor([[3, 2], [2, 3]])
    out = embed_blocks(ids, plan, embedding, mask_token_id=MASK_ID, prefix_lengths=prefix)
    assert_close(out[0, 0, 2], embedding.weight[ids[0, 4]])
    assert_close(out[0, 0, 3], embedding.weight[MASK_ID])


# --------------------------------------------------------------------------------------------------------
# Acceptance and metrics
# --------------------------------------------------------------------------------------------------------


def test_acceptance_hand_cases():
    T, X = True, False
    correct = torch.tensor([[[T, T, T, T], [X, T, T, T], [T, T, T, T], [T, T, X, T], [T, T, T, T]]])
    supervised = torch.tensor([[[T, T, T, T], [T, T, T, T], [T, T, X, T], [T, T, T, T], [T, T, T, T]]])
    valid = torch.tensor([[T, T, T, T, X]])
    got = acceptance_lengths(correct, supervised, valid)
    # all correct -> W = 5; wrong at slot 1 -> 1; unsupervised gap at slot 3 ends the prefix -> 3;
    # wrong at slot 3 -> 3; invalid block -> 0.
    assert got.tolist() == [[5.0, 1.0, 3.0, 3.0, 0.0]]
    # Counting from a later slot (variable prefix): slots before it do not matter.
    first = torch.tensor([[3, 2, 4, 4, 1]])
    got = acceptance_lengths(correct, supervised, valid, first_slot=first)
    assert got.tolist() == [[3.0, 4.0, 2.0, 2.0, 0.0]]
    # A block whose first counted slot is unsupervised measures nothing.
    got = acceptance_lengths(correct, supervised, valid, first_slot=torch.tensor([[1, 1, 3, 1, 1]]))
    assert got.tolist() == [[5.0, 1.0, 0.0, 3.0, 0.0]]


def test_metrics_from_controlled_predictions():
    """A head whose argmax is the hidden state's one-hot: correctness chosen per slot by hand."""
    vocab, W = 16, 5
    ids = (torch.arange(30) % vocab)[None]
    plan = DFlashBatchPlan.from_anchors(torch.tensor([[0, 8, 16, 24]]), block_size=W, seq_length=30,
                                        block_valid=torch.tensor([[True, True, True, False]]))
    labels = block_labels(ids, plan)
    wrong = torch.zeros(1, 4, W, dtype=torch.bool)
    wrong[0, 1, 1] = True  # block 1: wrong at slot 1 -> acceptance 1
    wrong[0, 2, 3] = True  # block 2: wrong at slot 3 -> acceptance 3
    predicted = torch.where(wrong, (labels + 1) % vocab, labels)
    hidden = F.one_hot(predicted, vocab).float() * 10
    lin = nn.Linear(vocab, vocab, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.eye(vocab))
    out = dflash_loss(hidden, plan, ids, OutputHead(lin, vocab), chunk_slots=3)
    m = out.metrics
    assert float(m.supervised_tokens) == 12 and float(m.correct_tokens) == 10
    assert float(m.valid_blocks) == 3 and float(m.acceptance_sum) == 5 + 1 + 3
    assert_close(m.accuracy, 10 / 12)
    assert_close(m.acceptance_length, 3.0)
    assert (m + m).to_dict()["acceptance_sum"] == 18
    assert m.all_reduce(None) is m  # no process group: nothing to reduce
    zero = DFlashMetrics.zeros()
    assert float(zero.accuracy) == 0.0 and float(zero.acceptance_length) == 0.0
    # Variable prefix: with l = 2 block 1's wrong slot 1 is an input, so its acceptance is 4.
    vp = variable_prefix_loss(hidden, plan, ids, OutputHead(lin, vocab), prefix_lengths=torch.full((1, 4), 2))
    assert float(vp.metrics.acceptance_sum) == 4 + 4 + 2
    assert float(vp.metrics.supervised_tokens) == 9


# --------------------------------------------------------------------------------------------------------
# Soft targets
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("soft_target,temperature", [("ce", 2.0), ("kl", 1.0), ("kl", 0.7)])
def test_soft_targets_match_naive(soft_target, temperature):
    plan, ids, hidden, lin = make_case(seed=7)
    teacher = torch.randn(plan.batch_size, plan.seq_length, H, generator=torch.Generator().manual_seed(1))
    head = OutputHead(lin, V, final_logit_softcapping=4.0)
    kwargs = dict(decay_gamma=2.0, teacher_hidden=teacher, soft_target=soft_target, temperature=temperature)
    out = dflash_loss(hidden, plan, ids, head, chunk_slots=6, **kwargs)
    ref_loss, ref_wsum, ref_metrics = naive_loss(hidden, plan, ids, lin.weight, softcap=4.0, **kwargs)
    assert_close(out.loss_sum, ref_loss, rtol=1e-5, atol=1e-4)
    assert_close(out.weight_sum, ref_wsum)
    assert metrics_dict(out.metrics) == {k: float(v) for k, v in ref_metrics.items()}
    for g, w in zip(grads_of(out.loss_sum, [hidden, lin.weight]), grads_of(ref_loss, [hidden, lin.weight])):
        assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_soft_target_uses_teacher_at_previous_position():
    # A teacher that is one-hot (sharp) on the label at p + k when read at p + k - 1 gives the same loss
    # as hard CE; read at the wrong position it would not.
    plan, ids, hidden, lin = make_case(seed=8)
    head_lin = nn.Linear(V, V, bias=False)
    with torch.no_grad():
        head_lin.weight.copy_(torch.eye(V) * 50)
    head = OutputHead(head_lin, V)
    hidden_v = (torch.randn(*hidden.shape[:3], V, generator=torch.Generator().manual_seed(0)) * 0.02).requires_grad_()
    teacher = torch.zeros(plan.batch_size, plan.seq_length, V)
    teacher[:, :-1] = F.one_hot(ids[:, 1:], V).float()  # the target's state at t predicts x_{t+1}
    hard = dflash_loss(hidden_v, plan, ids, head)
    soft = dflash_loss(hidden_v, plan, ids, head, teacher_hidden=teacher, soft_target="ce")
    assert_close(soft.loss_sum, hard.loss_sum, rtol=1e-5, atol=1e-4)
    # A teacher aligned one position late (its state at t "predicting" x_t) is a different objective.
    late = F.one_hot(ids, V).float()
    shifted = dflash_loss(hidden_v, plan, ids, head, teacher_hidden=late, soft_target="ce")
    assert not torch.allclose(shifted.loss_sum, hard.loss_sum, rtol=1e-3)


# --------------------------------------------------------------------------------------------------------
# Variable prefix (D2SD)
# --------------------------------------------------------------------------------------------------------


def big_plan(B=64, N=64, S=200, W=6):
    mask = torch.ones(B, S, dtype=torch.bool)
    return build_dflash_batch_plan(mask, torch.arange(B), anchors_per_sample=N, block_size=W, optimizer_step=0, seed=0)


def test_prefix_length_distribution_matches_prior():
    W, base = 6, 0.7
    plan = big_plan(W=W)
    counts = {}
    for step in range(3):
        lengths = sample_prefix_lengths(plan, seed=11, optimizer_step=step, base=base, sample_ids=torch.arange(64))
        for l, c in zip(*torch.unique(lengths[plan.block_valid], return_counts=True)):
            counts[int(l)] = counts.get(int(l), 0) + int(c)
    prior = prefix_length_prior(W, base)
    assert sorted(prior) == [2, 3, 4, 5] and set(counts) <= set(prior)
    total = sum(counts.values())
    chi2 = sum((counts.get(l, 0) - total * p) ** 2 / (total * p) for l, p in prior.items())
    # 3 degrees of freedom: P(chi2 > 16.27) = 0.001.
    assert chi2 < 16.27, (counts, prior, chi2)
    ratios = [prior[l + 1] / prior[l] for l in range(2, 5)]
    assert_close(ratios, [base] * 3)
    # base = 1: uniform; base > 1 favours long prefixes.
    assert_close(list(prefix_length_prior(W, 1.0).values()), [0.25] * 4)
    assert prefix_length_prior(W, 2.0)[5] > prefix_length_prior(W, 2.0)[2]


def test_prefix_lengths_deterministic_and_in_range():
    plan = big_plan(B=8, N=16, S=60, W=5)
    ids = torch.arange(8) + 1000
    a = sample_prefix_lengths(plan, seed=1, optimizer_step=5, base=0.8, sample_ids=ids)
    b = sample_prefix_lengths(plan, seed=1, optimizer_step=5, base=0.8, sample_ids=ids)
    assert torch.equal(a, b) and a.dtype == torch.int64 and a.shape == (8, 16)
    assert int(a.min()) >= 2 and int(a.max()) <= 4
    assert not torch.equal(a, sample_prefix_lengths(plan, seed=1, optimizer_step=6, base=0.8, sample_ids=ids))
    assert not torch.equal(a, sample_prefix_lengths(plan, seed=2, optimizer_step=5, base=0.8, sample_ids=ids))
    # Row order and batch composition do not matter: a row's lengths depend on its sample id and anchors.
    perm = torch.tensor([3, 0, 7, 1])
    sub = DFlashBatchPlan.from_anchors(plan.anchor_positions[perm], block_size=5, seq_length=60)
    assert torch.equal(sample_prefix_lengths(sub, seed=1, optimizer_step=5, base=0.8, sample_ids=ids[perm]), a[perm])
    # W = 2 leaves only l = 1 (plain DFlash); invalid blocks get 1.
    tiny = DFlashBatchPlan.from_anchors(torch.tensor([[0, 3]]), block_size=2, seq_length=8,
                                        block_valid=torch.tensor([[True, False]]))
    assert sample_prefix_lengths(tiny, seed=0, optimizer_step=0, base=0.5).tolist() == [[1, 1]]
    with pytest.raises(ValueError, match="base"):
        sample_prefix_lengths(plan, seed=0, optimizer_step=0, base=0.0)


@pytest.mark.parametrize("decay_gamma", [None, 1.5])
def test_variable_prefix_loss_matches_naive(decay_gamma):
    plan, ids, hidden, lin = make_case(seed=9, W=6)
    lengths = sample_prefix_lengths(plan, seed=3, optimizer_step=0, base=0.9, sample_ids=torch.arange(3))
    assert len(set(lengths[plan.block_valid].tolist())) > 1
    head = OutputHead(lin, V)
    out = variable_prefix_loss(hidden, plan, ids, head, prefix_lengths=lengths, decay_gamma=decay_gamma, chunk_slots=4)
    ref_loss, ref_wsum, ref_metrics = naive_loss(
        hidden, plan, ids, lin.weight, decay_gamma=decay_gamma, prefix_lengths=lengths
    )
    assert_close(out.loss_sum, ref_loss)
    assert_close(out.weight_sum, ref_wsum)
    assert metrics_dict(out.metrics) == {k: float(v) for k, v in ref_metrics.items()}
    grads = grads_of(out.loss_sum, [hidden, lin.weight])
    for g, w in zip(grads, grads_of(ref_loss, [hidden, lin.weight])):
        assert_close(g, w)
    # Visible prefix slots get no gradient.
    slots = torch.arange(6)
    prefix = slots[None, None, :] < lengths[:, :, None]
    assert torch.all(grads[0][prefix] == 0)
    with pytest.raises(ValueError, match="prefix_lengths"):
        variable_prefix_loss(hidden, plan, ids, head, prefix_lengths=lengths, weights=torch.ones(3, 5, 6))


# --------------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------------


def test_errors_say_what_is_wrong():
    plan, ids, hidden, lin = make_case()
    head = OutputHead(lin, V)
    with pytest.raises(ValueError, match="hidden must be"):
        dflash_loss(hidden[:, :2], plan, ids, head)
    with pytest.raises(ValueError, match="teacher_hidden"):
        dflash_loss(hidden, plan, ids, head, soft_target="kl")
    with pytest.raises(ValueError, match="soft_target"):
        dflash_loss(hidden, plan, ids, head, soft_target="js")
    with pytest.raises(ValueError, match="temperature"):
        dflash_loss(hidden, plan, ids, head, temperature=2.0)
    with pytest.raises(ValueError, match="chunk_slots"):
        dflash_loss(hidden, plan, ids, head, chunk_slots=0)
    with pytest.raises(ValueError, match="loss_mask"):
        dflash_loss(hidden, plan, ids, head, loss_mask=torch.ones(3, 5, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="vocab_size"):
        OutputHead(lin, V + 1)
    with pytest.raises(ValueError, match="nn.Linear"):
        OutputHead(nn.Identity(), V)
    with pytest.raises(ValueError, match="softcapping"):
        OutputHead(lin, V, final_logit_softcapping=0.0)


def test_logged_ratios_of_every_metrics_record():
    """The names and ratios the training log shows, derived after summing (the loop logs `log_values`)."""
    from megatron_dflash.variants.dflash2 import DFlash2Metrics
    from megatron_dflash.variants.domino import DominoMetrics

    def f64(*values):
        return [torch.tensor(float(v), dtype=torch.float64) for v in values]

    plain = DFlashMetrics(*f64(8, 6, 9, 3))
    assert plain.log_values() == {"accuracy": 6 / 8, "acceptance": 9 / 3}
    empty = DFlashMetrics.zeros()
    assert empty.log_values() == {"accuracy": 0.0, "acceptance": 0.0}  # nothing supervised: 0, not NaN
    dflash2 = DFlash2Metrics(*f64(8, 6, 9, 3, 5, 7, 4, 2, 1.5, 0.25, 2.0, 0.5))
    assert dflash2.log_values() == {
        "accuracy": 6 / 8, "acceptance": 9 / 3, "base accuracy": 5 / 8, "base acceptance": 7 / 3,
        "candidate recall": 4 / 8, "base loss": 1.5 / 2.0, "selector loss": 0.25 / 0.5,
    }
    domino = DominoMetrics(*f64(8, 6, 9, 3, 5, 7, 1.0, 1.5, 2.0))
    assert domino.log_values() == {
        "accuracy": 6 / 8, "acceptance": 9 / 3, "base accuracy": 5 / 8, "base acceptance": 7 / 3,
        "final loss": 1.0 / 2.0, "base loss": 1.5 / 2.0,
    }
    # Ratios of sums, not sums of ratios.
    assert (plain + DFlashMetrics(*f64(2, 0, 1, 1))).log_values() == {"accuracy": 6 / 10, "acceptance": 10 / 4}
