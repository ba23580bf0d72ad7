"""The DFlash loss over a reduced draft vocabulary (docs/design.md §20) against an independent dense reference.

The reference forms the full logits ``hidden @ W^T``, keeps the K columns of the draft vocabulary, and takes
the cross entropy of each supervised slot whose label is inside it (log-softmax over the K columns); a slot
whose label is outside adds nothing to the loss nor to its denominator and counts as wrong in the metrics.
The kernel runs over the draft head's K rows only (fused with a frozen head, per chunk with a trainable one),
and at TP=2 (K odd: an uneven split of the head's rows) equals TP=1.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megatron_dflash.draft.draft_vocab import DraftLMHead, DraftVocabulary
from megatron_dflash.objectives.dflash_loss import acceptance_lengths, dflash_loss
from megatron_dflash.plan.batch_plan import build_dflash_batch_plan
from megatron_dflash.target.head import OutputHead

V, H, K = 41, 16, 15


def _case(seed: int = 0, vocab: int = V, size: int = K):
    gen = torch.Generator().manual_seed(seed)
    B, S, N, W = 2, 30, 4, 5
    ids = torch.randint(0, vocab, (B, S), generator=gen)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[0, ::3] = False
    plan = build_dflash_batch_plan(mask, torch.tensor([7, 8]), anchors_per_sample=N, block_size=W,
                                   optimizer_step=1, seed=seed)
    weight = torch.randn(vocab, H, generator=gen) * 0.5
    # about half the slots point at their label's row, so that some predictions are right
    at = (plan.anchor_positions[:, :, None] + torch.arange(W)).clamp(max=S - 1)
    labels = torch.gather(ids, 1, at.reshape(B, -1)).view(B, N, W)
    aim = (torch.rand(B, N, W, 1, generator=gen) < 0.5).float()
    hidden = torch.randn(B, N, W, H, generator=gen) + 4.0 * aim * weight[labels]
    chosen = torch.sort(torch.randperm(vocab, generator=gen)[:size]).values
    return plan, ids, hidden, weight, DraftVocabulary(chosen, vocab)


def _dense_reference(plan, ids, hidden, weight, vocab: DraftVocabulary, decay_gamma: float, trainable: bool):
    """(loss_sum, weight_sum, supervised, correct, acceptance_sum, grad_hidden, grad_rows) written plainly."""
    hidden = hidden.clone().requires_grad_()
    rows = weight[vocab.ids].clone().requires_grad_(trainable)
    B, N, W = plan.batch_size, plan.num_blocks, plan.block_size
    loss_sum = torch.zeros(())
    weight_sum = supervised = correct = 0.0
    correct_grid = torch.zeros(B, N, W - 1, dtype=torch.bool)
    supervised_grid = torch.zeros(B, N, W - 1, dtype=torch.bool)
    position = {int(t): i for i, t in enumerate(vocab.ids)}
    for b in range(B):
        for n in range(N):
            if not plan.block_valid[b, n]:
                continue
            p = int(plan.anchor_positions[b, n])
            for k in range(1, W):
                if not plan.loss_mask[b, n, k]:
                    continue
                label = int(ids[b, p + k])
                logits = (hidden[b, n, k] @ (weight @ torch.eye(H)).t())[vocab.ids]  # the full logits, restricted
                logits = hidden[b, n, k] @ rows.t() if trainable else logits
                supervised += 1
                supervised_grid[b, n, k - 1] = True
                if label not in position:  # outside: no loss, counted wrong
                    continue
                w = torch.exp(torch.tensor(-(k - 1) / decay_gamma))
                loss_sum = loss_sum - w * F.log_softmax(logits, dim=-1)[position[label]]
                weight_sum += float(w)
                ok = int(logits.argmax()) == position[label]
                correct += ok
                correct_grid[b, n, k - 1] = ok
    loss_sum.backward()
    acceptance = acceptance_lengths(correct_grid, supervised_grid, plan.block_valid).sum()
    return (loss_sum.detach(), weight_sum, supervised, correct, float(acceptance), hidden.grad,
            rows.grad if trainable else None)


def _draft_head(weight, vocab: DraftVocabulary, trainable: bool, tp_group=None) -> OutputHead:
    layer = DraftLMHead(vocab.size, H, tp_group=tp_group)
    layer.copy_target_rows(weight[vocab.ids])
    layer.weight.requires_grad_(trainable)
    body = types.SimpleNamespace(lm_head=layer, d2t=vocab.d2t)
    return OutputHead.of_draft(body, OutputHead(nn.Linear(H, vocab.target_vocab_size, bias=False), V))


@pytest.mark.parametrize("trainable", [False, True], ids=["frozen-fused", "trainable-chunked"])
@pytest.mark.parametrize("chunk", [None, 7])
def test_loss_over_the_draft_rows_equals_the_dense_reference(trainable, chunk):
    plan, ids, hidden0, weight, vocab = _case()
    ref = _dense_reference(plan, ids, hidden0, weight, vocab, 2.0, trainable)
    head = _draft_head(weight, vocab, trainable)
    assert head.vocab_size == K and head.local_vocab_size == K
    hidden = hidden0.clone().requires_grad_()
    out = dflash_loss(hidden, plan, ids, head, decay_gamma=2.0, chunk_slots=chunk)
    out.loss_sum.backward()
    ref_loss, ref_wsum, ref_sup, ref_correct, ref_accept, ref_gh, ref_gw = ref
    assert 0 < ref_correct < ref_sup and ref_wsum > 0
    torch.testing.assert_close(out.loss_sum.detach(), ref_loss, rtol=1e-5, atol=1e-5)
    assert abs(float(out.weight_sum) - ref_wsum) < 1e-5
    assert float(out.metrics.supervised_tokens) == ref_sup
    assert float(out.metrics.correct_tokens) == ref_correct
    assert float(out.metrics.acceptance_sum) == ref_accept
    torch.testing.assert_close(hidden.grad, ref_gh, rtol=1e-5, atol=1e-5)
    if trainable:
        torch.testing.assert_close(head.layer.weight.grad, ref_gw, rtol=1e-5, atol=1e-5)
    else:
        assert head.layer.weight.grad is None


def test_some_labels_fall_outside_and_none_reach_the_loss():
    """The case has supervised labels outside the draft vocabulary. They add nothing to the loss, its gradient
    or its denominator: the loss equals the loss with those slots unsupervised (an explicit ``loss_mask``), while
    the metrics count them as supervised and wrong. Moving them inside changes the loss (they were excluded, not
    silently mapped to another id)."""
    plan, ids, hidden, weight, vocab = _case()
    head = _draft_head(weight, vocab, False)
    _, inside = head.to_draft(ids)
    assert 0 < int((~inside).sum()) < ids.numel()
    B, N, W = plan.batch_size, plan.num_blocks, plan.block_size
    at = (plan.anchor_positions[:, :, None] + torch.arange(W)).clamp(max=ids.shape[1] - 1)
    label_inside = torch.gather(inside, 1, at.reshape(B, -1)).view(B, N, W)
    outside = plan.loss_mask & plan.block_valid[:, :, None] & ~label_inside
    outside[:, :, 0] = False  # the anchor slot is never predicted
    assert int(outside.sum()) > 0

    def run(loss_mask):
        h = hidden.clone().requires_grad_()
        out = dflash_loss(h, plan, ids, head, decay_gamma=2.0, loss_mask=loss_mask)
        out.loss_sum.backward()
        return out, h.grad

    (base, base_grad), (masked, masked_grad) = run(None), run(plan.loss_mask & ~outside)
    # exact: an excluded slot enters the sums as a weight-0 term, an exact zero
    torch.testing.assert_close(base.loss_sum.detach(), masked.loss_sum.detach(), rtol=0, atol=0)
    assert float(base.weight_sum) == float(masked.weight_sum)
    torch.testing.assert_close(base_grad, masked_grad, rtol=0, atol=0)
    assert float(base.metrics.supervised_tokens) == float(masked.metrics.supervised_tokens) + int(outside.sum())
    assert float(base.metrics.correct_tokens) == float(masked.metrics.correct_tokens)
    moved = torch.where(inside, ids, vocab.ids[0])
    other = dflash_loss(hidden, plan, moved, head, decay_gamma=2.0)
    assert float(other.weight_sum) > float(base.weight_sum)


def _tp_draft_vocab(rank: int, world_size: int) -> dict:
    from megatron.core import parallel_state

    from megatron_dflash.common.parallel import SingleRankGroup

    group = parallel_state.get_tensor_model_parallel_group()
    plan, ids, hidden0, weight, vocab = _case(seed=4)
    out = {}
    for trainable in (False, True):
        got = []
        for tp_group in (SingleRankGroup(), group):
            head = _draft_head(weight, vocab, trainable, tp_group=tp_group)
            hidden = hidden0.clone().requires_grad_()
            loss = dflash_loss(hidden, plan, ids, head, decay_gamma=2.0, chunk_slots=5)
            loss.loss_sum.backward()
            metrics = torch.stack([getattr(loss.metrics, f) for f in loss.metrics.field_names()])
            got.append((loss.loss_sum.detach(), loss.weight_sum, metrics, hidden.grad, head.layer.weight.shape[0]))
        (l1, w1, m1, g1, rows1), (l2, w2, m2, g2, rows2) = got
        out[trainable] = {"loss": float((l1 - l2).abs()), "weight_sum": float((w1 - w2).abs()),
                          "metrics": float((m1 - m2).abs().max()), "grad": float((g1 - g2).abs().max()),
                          "rows": (rows1, rows2)}
    return out


def test_tensor_parallel_draft_head_equals_single_rank(tp_pool):
    """K = 15 rows over 2 ranks: 8 and 7 (the last rank's shard padded with a -inf column)."""
    for rank, report in enumerate(tp_pool(2).run(_tp_draft_vocab)):
        for trainable, d in report.items():
            assert d["rows"] == (K, 8 if rank == 0 else 7), d
            assert d["loss"] <= 1e-5 and d["weight_sum"] == 0.0 and d["metrics"] == 0.0, (rank, trainable, d)
            assert d["grad"] <= 1e-5, (rank, trainable, d)
