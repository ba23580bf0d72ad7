"""Tensor parallelism of the DSpark objective: TP=2 with a vocab-parallel megatron head equals TP=1.

One call on a pool of 2 gloo ranks. Each rank builds the same data from a fixed seed, computes the TP=1
reference with a plain `nn.Linear` holding the whole vocabulary, then the TP=2 loss with a megatron
`ColumnParallelLinear` holding its half of the same weight (the padded vocabulary puts padding columns on
rank 1) and its half of the Markov projection ``W2``. Loss, weight sum, metrics and the gradients w.r.t. the
hidden states, the Markov features, the confidence logits and each rank's rows of ``W2`` must match, with
and without the output transform, unchunked and in chunks that do not divide the slots. The metrics record,
per-position vectors included, sums over the ranks in one all-reduce.
"""

from __future__ import annotations

import torch

VOCAB, PADDED, HIDDEN, RANK = 97, 100, 16, 5


def _tp_vs_single(rank: int, world_size: int) -> dict:
    from megatron.core import parallel_state
    from torch import nn

    from megatron_dflash.draft.body import default_parallel_config
    from megatron_dflash.draft.layers import column_parallel
    from megatron_dflash.objectives.dspark_loss import dspark_loss
    from megatron_dflash.plan.batch_plan import build_dflash_batch_plan
    from megatron_dflash.target.head import OutputHead

    group = parallel_state.get_tensor_model_parallel_group()
    assert group.size() == world_size == 2
    gen = torch.Generator().manual_seed(0)
    B, S, N, W = 2, 32, 3, 7
    ids = torch.randint(0, VOCAB, (B, S), generator=gen)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[0, ::5] = False
    mask[1, : S - 10] = False
    plan = build_dflash_batch_plan(mask, torch.tensor([5, 6]), anchors_per_sample=N, block_size=W, optimizer_step=1,
                                   seed=2)
    hidden0 = torch.randn(B, N, W, HIDDEN, generator=gen)
    teacher = torch.randn(B, S, HIDDEN, generator=gen)
    features0 = torch.randn(B, N, W, RANK, generator=gen)
    confidence0 = torch.randn(B, N, W, generator=gen)
    full_weight = torch.randn(PADDED, HIDDEN, generator=gen) * 0.5
    full_w2 = torch.randn(PADDED, RANK, generator=gen) * 0.7

    reference = nn.Linear(HIDDEN, PADDED, bias=False)
    layer = column_parallel(HIDDEN, PADDED, bias=False, parallel_config=default_parallel_config(), tp_group=group,
                            std=0.02)
    shard = PADDED // world_size
    rows = slice(rank * shard, (rank + 1) * shard)
    with torch.no_grad():
        reference.weight.copy_(full_weight)
        layer.weight.copy_(full_weight[rows])
    reference.requires_grad_(False)
    layer.requires_grad_(False)

    diffs = {}
    for name, (multiplier, cap) in {"plain": (1.0, None), "transform": (0.7, 2.5)}.items():
        for chunk in (None, 4):
            results = []
            for tp_layer, w2_rows in ((reference, slice(None)), (layer, rows)):
                head = OutputHead(tp_layer, VOCAB, output_multiplier=multiplier, final_logit_softcapping=cap)
                hidden = hidden0.clone().requires_grad_()
                features = features0.clone().requires_grad_()
                confidence = confidence0.clone().requires_grad_()
                w2 = full_w2[w2_rows].clone().requires_grad_()
                out = dspark_loss(hidden, plan, ids, head, teacher_hidden=teacher, markov_features=features,
                                  markov_w2=w2, confidence_logits=confidence, chunk_slots=chunk, input_mask=mask)
                out.loss_sum.backward()
                results.append((out.loss_sum.detach(), out.weight_sum, out.metrics._stack(), hidden.grad,
                                features.grad, confidence.grad, w2.grad))
            (ref_loss, ref_wsum, ref_m, *ref_grads), (loss, wsum, m, *grads) = results
            ref_grads[-1] = ref_grads[-1][rows]  # this rank's rows of W2's gradient
            diffs[f"{name}/{chunk}"] = {
                "loss": float((loss - ref_loss).abs() / ref_loss.abs()),
                "weight_sum": float((wsum - ref_wsum).abs()),
                "metrics": float(((m - ref_m).abs() / ref_m.abs().clamp(min=1)).max()),
                "grads": [float((g - r).abs().max() / r.abs().max()) for g, r in zip(grads, ref_grads)],
                "grad_scales": [float(r.abs().max()) for r in ref_grads],
            }
    # The data-parallel reduction sums the records over ranks, vector fields included, in one collective.
    import torch.distributed as dist

    summed = out.metrics.all_reduce(dist.group.WORLD)
    diffs["all_reduce"] = float((summed._stack() - 2 * out.metrics._stack()).abs().max())
    diffs["all_reduce_shape"] = tuple(summed.accept_rate_sums.shape)
    return diffs


def test_tensor_parallel_dspark_loss_equals_single_rank(tp_pool):
    per_rank = tp_pool(2).run(_tp_vs_single)
    for rank, diffs in enumerate(per_rank):
        assert diffs.pop("all_reduce") == 0.0 and diffs.pop("all_reduce_shape") == (32,)
        assert len(diffs) == 4
        for case, d in diffs.items():
            where = f"rank {rank}, case {case}: {d}"
            assert all(scale > 0 for scale in d["grad_scales"]), where
            assert d["loss"] <= 1e-5 and d["weight_sum"] == 0.0 and d["metrics"] <= 1e-5, where
            assert max(d["grads"]) <= 1e-5, where
