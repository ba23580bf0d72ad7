"""D-PACE under tensor and data parallelism (docs/design.md §6 Objectives, §13 Parallelism), on 2 gloo ranks.

TP=2: each rank holds half of the head's vocabulary (megatron's `ColumnParallelLinear`, one padding column on
rank 1). A slot's cross entropy is all-reduced over the vocabulary before the weights are formed, so both
ranks form the same D-PACE weights; the loss, the denominator and the gradients (hidden states; each rank's
head-weight shard when it trains) must equal a one-rank reference holding the whole vocabulary, fused and per
chunk, with and without variable prefixes. DP=2: each rank takes its rows of a batch; the summed loss and
denominator, and the summed gradient divided by the summed denominator, must equal the whole batch on one rank.
"""

from __future__ import annotations

import torch

VOCAB, PADDED, HIDDEN = 97, 98, 16


def _data():
    gen = torch.Generator().manual_seed(0)
    B, S, N, W = 2, 32, 4, 5
    ids = torch.randint(0, VOCAB, (B, S), generator=gen)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[0, ::4] = False
    mask[1, : S - 7] = False
    hidden = torch.randn(B, N, W, HIDDEN, generator=gen)
    weight = torch.randn(PADDED, HIDDEN, generator=gen) * 0.5
    return ids, mask, torch.tensor([5, 6]), hidden, weight, (N, W)


def _tensor_parallel(rank: int, world_size: int) -> dict:
    from megatron.core import parallel_state
    from torch import nn

    from megatron_dflash.draft.body import default_parallel_config
    from megatron_dflash.draft.layers import column_parallel
    from megatron_dflash.objectives.dflash_loss import LossWeighting, OutputHead, dflash_loss
    from megatron_dflash.objectives.variable_prefix import sample_prefix_lengths
    from megatron_dflash.plan.batch_plan import build_dflash_batch_plan

    group = parallel_state.get_tensor_model_parallel_group()
    ids, mask, sample_ids, hidden0, full_weight, (N, W) = _data()
    plan = build_dflash_batch_plan(mask, sample_ids, anchors_per_sample=N, block_size=W, optimizer_step=1, seed=2)
    prefix = sample_prefix_lengths(plan, seed=0, optimizer_step=0, base=0.8, sample_ids=sample_ids)
    reference = nn.Linear(HIDDEN, PADDED, bias=False)
    layer = column_parallel(HIDDEN, PADDED, bias=False, parallel_config=default_parallel_config(), tp_group=group,
                            std=0.02)
    shard = PADDED // world_size
    with torch.no_grad():
        reference.weight.copy_(full_weight)
        layer.weight.copy_(full_weight[rank * shard : (rank + 1) * shard])
    diffs = {}
    for scheme in ("dpace", "dpace-continuation-value-only"):
        for name, kwargs in (("plain", {}), ("prefix", {"prefix_lengths": prefix})):
            for chunk in (None, 3):
                results = []
                for tp_layer, frozen in ((reference, False), (layer, False), (layer, True)):
                    tp_layer.weight.grad = None
                    tp_layer.weight.requires_grad_(not frozen)
                    head = OutputHead(tp_layer, VOCAB, output_multiplier=0.8, final_logit_softcapping=3.0)
                    hidden = hidden0.clone().requires_grad_()
                    out = dflash_loss(hidden, plan, ids, head, chunk_slots=chunk, fused=frozen,
                                      weighting=LossWeighting(scheme, 0.3), **kwargs)
                    out.loss_sum.backward()
                    grad_weight = None if frozen else tp_layer.weight.grad.clone()
                    results.append((out.loss_sum.detach(), out.weight_sum, hidden.grad, grad_weight))
                    tp_layer.weight.requires_grad_(True)
                (ref_loss, ref_wsum, ref_gh, ref_gw), *tp_results = results
                ref_gw_shard = ref_gw[rank * shard : (rank + 1) * shard]
                for path, (loss, wsum, gh, gw) in zip(("chunked", "fused"), tp_results):
                    diffs[f"{scheme}/{name}/{chunk}/{path}"] = {
                        "loss": float((loss - ref_loss).abs()), "loss_scale": float(ref_loss.abs()),
                        "weight_sum": float((wsum - ref_wsum).abs()), "weight_scale": float(ref_wsum),
                        "grad_hidden": float((gh - ref_gh).abs().max()), "grad_scale": float(ref_gh.abs().max()),
                        "grad_weight": 0.0 if gw is None else float((gw - ref_gw_shard).abs().max()),
                        "grad_weight_absent": gw is None,
                    }
    return diffs


def test_tensor_parallel_dpace_equals_single_rank(tp_pool):
    for rank, diffs in enumerate(tp_pool(2).run(_tensor_parallel)):
        assert len(diffs) == 16
        for case, d in diffs.items():
            where = f"rank {rank}, case {case}: {d}"
            assert d["loss_scale"] > 0 and d["weight_scale"] > 0 and d["grad_scale"] > 0, where
            assert d["loss"] <= 1e-5 * max(1.0, d["loss_scale"]), where
            assert d["weight_sum"] <= 1e-5 * max(1.0, d["weight_scale"]), where
            assert d["grad_hidden"] <= 1e-5 and d["grad_weight"] <= 1e-5, where
            assert d["grad_weight_absent"] == case.endswith("/fused"), where


def _data_parallel(rank: int, world_size: int) -> dict:
    import torch.distributed as dist
    from torch import nn

    from megatron_dflash.objectives.dflash_loss import LossWeighting, OutputHead, dflash_loss
    from megatron_dflash.plan.batch_plan import build_dflash_batch_plan

    ids, mask, sample_ids, hidden0, full_weight, (N, W) = _data()
    lin = nn.Linear(HIDDEN, PADDED, bias=False).requires_grad_(False)
    with torch.no_grad():
        lin.weight.copy_(full_weight)
    head = OutputHead(lin, VOCAB)  # no vocabulary split: the ranks split the rows

    def plan_for(rows):
        return build_dflash_batch_plan(mask[rows], sample_ids[rows], anchors_per_sample=N, block_size=W,
                                       optimizer_step=1, seed=2)

    diffs = {}
    for normalization in ("weight_sum", "supervised", "sequences"):
        weighting = LossWeighting("dpace", 0.5, normalization)
        whole_hidden = hidden0.clone().requires_grad_()
        whole = dflash_loss(whole_hidden, plan_for(slice(0, 2)), ids, head, chunk_slots=4, weighting=weighting)
        (whole.loss_sum / whole.weight_sum).backward()
        rows = slice(rank, rank + 1)
        mine_hidden = hidden0[rows].clone().requires_grad_()
        mine = dflash_loss(mine_hidden, plan_for(rows), ids[rows], head, chunk_slots=4, weighting=weighting)
        mine.loss_sum.backward()
        sums = torch.stack([mine.loss_sum.detach(), mine.weight_sum])
        dist.all_reduce(sums)
        grad = torch.zeros_like(hidden0)
        grad[rows] = mine_hidden.grad
        dist.all_reduce(grad)
        diffs[normalization] = {
            "loss": float((sums[0] / sums[1] - whole.loss_sum / whole.weight_sum).abs()),
            "weight_sum": float((sums[1] - whole.weight_sum).abs()),
            "grad": float((grad / sums[1] - whole_hidden.grad).abs().max()),
            "grad_scale": float(whole_hidden.grad.abs().max()),
            "own_share": float((mine.loss_sum / mine.weight_sum - whole.loss_sum / whole.weight_sum).abs()),
        }
    return diffs


def test_data_parallel_dpace_equals_the_whole_batch(tp_pool):
    for rank, diffs in enumerate(tp_pool(2).run(_data_parallel)):
        assert set(diffs) == {"weight_sum", "supervised", "sequences"}
        for normalization, d in diffs.items():
            where = f"rank {rank}, {normalization}: {d}"
            assert d["grad_scale"] > 0 and d["own_share"] > 1e-4, where  # the ranks' halves really differ
            assert d["loss"] <= 1e-5 and d["weight_sum"] <= 1e-5 and d["grad"] <= 1e-6, where
