"""Tensor parallelism of the objective: TP=2 with a vocab-parallel megatron head equals TP=1.

One call on a pool of 2 gloo ranks. Each rank builds the same data from a fixed seed, computes the TP=1
reference with a plain `nn.Linear` holding the whole vocabulary (no collectives), then the TP=2 loss with a
megatron `ColumnParallelLinear` that holds its half of the same weight (the padded vocabulary puts one
padding column on rank 1). Loss, weight sum, metrics, the gradient w.r.t. the hidden states and the
gradient of each rank's head-weight shard must match the reference, for the unchunked and the chunked
path, with the output transform, soft targets and variable prefixes; with the head frozen, the fused loss
(gradient w.r.t. the hidden states formed in forward) must match it as well. Block embeddings through megatron's
`VocabParallelEmbedding` must equal the lookup in the full table.
"""

from __future__ import annotations

import torch

VOCAB, PADDED, HIDDEN = 97, 98, 16


def _tp_vs_single(rank: int, world_size: int) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from torch import nn

    from megatron_dflash.draft.body import default_parallel_config
    from megatron_dflash.draft.layers import column_parallel
    from megatron_dflash.objectives.dflash_loss import OutputHead, dflash_loss, embed_blocks
    from megatron_dflash.plan.batch_plan import build_dflash_batch_plan
    from megatron_dflash.objectives.variable_prefix import sample_prefix_lengths

    group = parallel_state.get_tensor_model_parallel_group()
    assert group.size() == world_size == 2

    gen = torch.Generator().manual_seed(0)
    B, S, N, W = 2, 32, 4, 5
    ids = torch.randint(0, VOCAB, (B, S), generator=gen)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[0, ::4] = False
    mask[1, : S - 7] = False
    mask[1, S - 6] = False  # row 1: 3 eligible anchors for N = 4, so one invalid block
    plan = build_dflash_batch_plan(mask, torch.tensor([5, 6]), anchors_per_sample=N, block_size=W, optimizer_step=1, seed=2)
    hidden0 = torch.randn(B, N, W, HIDDEN, generator=gen)
    teacher = torch.randn(B, S, HIDDEN, generator=gen)
    full_weight = torch.randn(PADDED, HIDDEN, generator=gen) * 0.5
    prefix = sample_prefix_lengths(plan, seed=0, optimizer_step=0, base=0.8, sample_ids=torch.tensor([5, 6]))

    reference = nn.Linear(HIDDEN, PADDED, bias=False)
    layer = column_parallel(HIDDEN, PADDED, bias=False, parallel_config=default_parallel_config(), tp_group=group, std=0.02)
    shard = PADDED // world_size
    with torch.no_grad():
        reference.weight.copy_(full_weight)
        layer.weight.copy_(full_weight[rank * shard : (rank + 1) * shard])

    cases = {
        "plain": dict(decay_gamma=2.0),
        "transform": dict(decay_gamma=2.0, output=(0.7, 2.5)),
        "kl": dict(decay_gamma=2.0, teacher_hidden=teacher, soft_target="kl", temperature=1.5),
        "prefix": dict(decay_gamma=1.0, prefix_lengths=prefix),
    }
    diffs = {}
    for name, kwargs in cases.items():
        multiplier, softcap = kwargs.pop("output", (1.0, None))
        for chunk in (None, 3):
            results = []
            # The reference and the TP head train (the per-chunk path); the frozen TP head takes the fused path.
            for tp_layer, frozen in ((reference, False), (layer, False), (layer, True)):
                tp_layer.weight.grad = None
                tp_layer.weight.requires_grad_(not frozen)
                head = OutputHead(tp_layer, VOCAB, output_multiplier=multiplier, final_logit_softcapping=softcap)
                hidden = hidden0.clone().requires_grad_()
                out = dflash_loss(hidden, plan, ids, head, chunk_slots=chunk, fused=frozen, **kwargs)
                out.loss_sum.backward()
                metrics = torch.stack([getattr(out.metrics, f) for f in out.metrics.field_names()])
                grad_weight = None if frozen else tp_layer.weight.grad.clone()
                results.append((out.loss_sum.detach(), out.weight_sum, metrics, hidden.grad, grad_weight))
                tp_layer.weight.requires_grad_(True)
            (ref_loss, ref_wsum, ref_m, ref_gh, ref_gw), *tp_results = results
            ref_gw_shard = ref_gw[rank * shard : (rank + 1) * shard]
            for path, (loss, wsum, m, gh, gw) in zip(("chunked", "fused"), tp_results):
                diffs[f"{name}/{chunk}/{path}"] = {
                    "loss": float((loss - ref_loss).abs()),
                    "loss_scale": float(ref_loss.abs()),
                    "weight_sum": float((wsum - ref_wsum).abs()),
                    "metrics": float((m - ref_m).abs().max()),
                    "grad_hidden": float((gh - ref_gh).abs().max()),
                    "grad_weight": 0.0 if gw is None else float((gw - ref_gw_shard).abs().max()),
                    "grad_weight_absent": gw is None,
                    "grad_scale": float(ref_gw_shard.abs().max()),
                }

    # Block embedding through a vocab-parallel embedding module equals the full table's lookup.
    from megatron.core.tensor_parallel.layers import VocabParallelEmbedding

    table = torch.randn(PADDED, HIDDEN, generator=gen)
    embedding = VocabParallelEmbedding(
        PADDED, HIDDEN, init_method=torch.nn.init.zeros_, config=default_parallel_config(), tp_group=group
    )
    with torch.no_grad():
        embedding.weight.copy_(table[rank * shard : (rank + 1) * shard])
    got = embed_blocks(ids, plan, embedding, mask_token_id=VOCAB - 1, input_embedding_scale=1.5, prefix_lengths=prefix)
    want = embed_blocks(ids, plan, nn.Embedding.from_pretrained(table), mask_token_id=VOCAB - 1,
                        input_embedding_scale=1.5, prefix_lengths=prefix)
    diffs["embedding"] = float((got - want).abs().max())

    # The data-parallel reduction of metrics sums over ranks.
    summed = out.metrics.all_reduce(dist.group.WORLD)
    diffs["all_reduce"] = float((summed.supervised_tokens - 2 * out.metrics.supervised_tokens).abs())
    return diffs


def test_tensor_parallel_loss_equals_single_rank(tp_pool):
    per_rank = tp_pool(2).run(_tp_vs_single)
    for rank, diffs in enumerate(per_rank):
        assert diffs.pop("all_reduce") == 0.0
        assert diffs.pop("embedding") <= 1e-6
        for case, d in diffs.items():
            where = f"rank {rank}, case {case}: {d}"
            assert d["loss_scale"] > 0 and d["grad_scale"] > 0, where
            assert d["loss"] <= 1e-5 * max(1.0, d["loss_scale"]), where
            assert d["weight_sum"] == 0.0 and d["metrics"] == 0.0, where
            assert d["grad_hidden"] <= 1e-5 and d["grad_weight"] <= 1e-5, where
            # The fused loss gives the frozen head no gradient.
            assert d["grad_weight_absent"] == case.endswith("/fused"), where
        assert sum(case.endswith("/fused") for case in diffs) == 8


def _tp_candidates(rank: int, world_size: int) -> dict:
    """The kernel's candidates (DFlash 2's top-k) at TP=2 against TP=1, fused and per chunk: values, ids, the
    loss, and the gradient w.r.t. the hidden states through the loss and the candidate values together."""
    from megatron.core import parallel_state
    from torch import nn

    from megatron_dflash.draft.body import default_parallel_config
    from megatron_dflash.target.head import OutputHead
    from megatron_dflash.objectives.head_loss import head_loss
    from megatron_dflash.draft.layers import column_parallel

    group = parallel_state.get_tensor_model_parallel_group()
    gen = torch.Generator().manual_seed(3)
    M, K = 11, 5
    full_weight = torch.randn(PADDED, HIDDEN, generator=gen) * 0.5
    hidden0 = torch.randn(M, HIDDEN, generator=gen)
    pull = torch.randn(M, K, generator=gen)  # an arbitrary use of the candidate values
    reference = nn.Linear(HIDDEN, PADDED, bias=False)
    layer = column_parallel(HIDDEN, PADDED, bias=False, parallel_config=default_parallel_config(), tp_group=group, std=0.02)
    shard = PADDED // world_size
    with torch.no_grad():
        reference.weight.copy_(full_weight)
        layer.weight.copy_(full_weight[rank * shard : (rank + 1) * shard])
    reference.requires_grad_(False)
    layer.requires_grad_(False)
    diffs = {}
    # 52: rank 1 holds 3 real columns, fewer than K (its top-k offers fillers that are never picked).
    for vocab in (VOCAB, 52):
        labels = torch.randint(0, vocab, (M,), generator=gen)
        weights = torch.rand(M, generator=gen) * (torch.arange(M) % 4 != 0)
        results = []
        for tp_layer, fused in ((reference, True), (layer, True), (layer, False)):
            head = OutputHead(tp_layer, vocab, output_multiplier=1.2, final_logit_softcapping=3.0)
            hidden = hidden0.clone().requires_grad_()
            terms = head_loss(hidden, labels, weights, head, chunk_slots=4, fused=fused, top_k=K)
            (terms.loss_sum + (terms.candidate_values * pull).sum()).backward()
            results.append((terms.loss_sum.detach(), terms.candidate_values.detach(), terms.candidate_ids, hidden.grad))
        (ref_loss, ref_values, ref_ids, ref_grad), *tp_results = results
        for path, (loss, values, ids, grad) in zip(("fused", "chunked"), tp_results):
            diffs[f"{vocab}/{path}"] = {
                "ids_equal": bool(torch.equal(ids, ref_ids)),
                "ids_in_vocab": bool((ids < vocab).all()),
                "loss": float((loss - ref_loss).abs()),
                "values": float((values - ref_values).abs().max()),
                "grad_hidden": float((grad - ref_grad).abs().max()),
                "grad_scale": float(ref_grad.abs().max()),
            }
    return diffs


def test_tensor_parallel_candidates_equal_single_rank(tp_pool):
    for rank, diffs in enumerate(tp_pool(2).run(_tp_candidates)):
        assert len(diffs) == 4
        for case, d in diffs.items():
            where = f"rank {rank}, case {case}: {d}"
            assert d["ids_equal"] and d["ids_in_vocab"] and d["grad_scale"] > 0, where
            assert d["loss"] <= 1e-4 and d["values"] <= 1e-5 and d["grad_hidden"] <= 1e-5, where


def _metrics_reduce_together(rank: int, world_size: int) -> dict:
    """Records of different types summed over the group in one all-reduce."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_dflash.objectives.dflash_loss import DFlashMetrics, all_reduce_together
    from megatron_dflash.variants.domino import DominoMetrics

    group = parallel_state.get_tensor_model_parallel_group()
    first = DFlashMetrics(*(torch.tensor(float(rank + i), dtype=torch.float64) for i in range(4)))
    second = DominoMetrics(*(torch.tensor(float(10 * rank + i), dtype=torch.float64) for i in range(9)))
    calls = []
    real = dist.all_reduce
    dist.all_reduce = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    try:
        summed = all_reduce_together([first, second], group)
    finally:
        dist.all_reduce = real
    return {"calls": len(calls), "types": [type(r).__name__ for r in summed],
            "first": summed[0]._stack().tolist(), "second": summed[1]._stack().tolist()}


def test_metric_records_reduce_together_in_one_collective(tp_pool):
    for result in tp_pool(2).run(_metrics_reduce_together):
        assert result["calls"] == 1
        assert result["types"] == ["DFlashMetrics", "DominoMetrics"]
        assert result["first"] == [float(2 * i + 1) for i in range(4)]  # (0 + i) + (1 + i)
        assert result["second"] == [float(2 * i + 10) for i in range(9)]  # (0 + i) + (10 + i)
