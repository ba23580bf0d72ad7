"""DSpark (the Qwen3-style and the Kimi K3 draft) under tensor parallelism, on simulated gloo ranks (TP = world size = 2).

The vocabulary (300) pads to 512 at TP=2, so the target head's shards are rows [0, 256) and [256, 512)
and ``markov_w2`` is split unevenly (256 real rows, then 44): TP=2 equals TP=1 with the same full weights
in the hidden states, the Markov-corrected logits of each shard, the confidence logits, and every
parameter gradient (``W2``'s rows of each rank; the replicated ``W1``, ``gate_proj`` / ``joint_proj`` and
confidence head whole on every rank), also of the whole objective through the registry's loss adapter, with the
decay and with D-PACE; initial weights do not depend on the TP size; HF and torch_dist
files move between TP=1 and TP=2 tensor for tensor, the converter's output included.
"""

from __future__ import annotations

import pytest
import torch

from megatron_dflash.common.parallel import SingleRankGroup
from megatron_dflash.draft.body import default_parallel_config
from megatron_dflash.variants.dspark import (
    DSparkBody,
    DSparkConfig,
    KimiK3DSparkBody,
    KimiK3DSparkConfig,
    dspark_prev_tokens,
)

from builders import tiny_draft_kwargs
from tp_checks import RTOL, check_checkpoints_move_between_tp_sizes, relative_error, tp_plan
from kimi_k3_configs import DRAFT as K3_DRAFT, target_dict as k3_target_dict

VOCAB, PADDED = 300, 512


def config(form: str):
    """A Qwen3-style DSpark config of Markov head `form`, or (``k3_<form>``) a Kimi K3 one."""
    if form.startswith("k3_"):
        target = {**k3_target_dict("lora_gated"), "model_type": "kimi_linear", "vocab_size": VOCAB}
        return KimiK3DSparkConfig.from_target_config(target, **K3_DRAFT, markov_rank=8, markov_head_type=form[3:],
                                                     enable_confidence_head=True, confidence_head_with_markov=True)
    return DSparkConfig(**tiny_draft_kwargs(vocab_size=VOCAB, markov_rank=8, markov_head_type=form,
                                            confidence_head_with_markov=form != "vanilla"))


def body_class(form: str):
    return KimiK3DSparkBody if form.startswith("k3_") else DSparkBody


def _full_index(param, rank: int, world_size: int):
    """The slice of the full tensor this rank's `param` holds (None: replicated)."""
    if not getattr(param, "tensor_model_parallel", False):
        return None
    dim, size = param.partition_dim, param.shape[param.partition_dim]
    uneven = getattr(param, "uneven_split", None)
    start = min(uneven[0], rank * uneven[1]) if uneven is not None else rank * size
    return dim, start, size


def _piece(full: torch.Tensor, index) -> torch.Tensor:
    return full if index is None else full.narrow(index[0], index[1], index[2])


def _forward(body, head, taps, blocks, plan, ids, probes):
    """(hidden, corrected logits of the head's shard, confidence) and the backward of a probe loss."""
    hidden = body(taps, blocks, plan)
    prev = dspark_prev_tokens(ids, plan)
    logits = body.markov_logits(hidden, prev, head)
    confidence = body.confidence_logits(hidden, prev)
    start, end = head.vocab_range
    real = min(end, VOCAB) - start
    ((logits[..., :real] * probes[0][..., start:start + real]).sum() + (hidden * probes[1]).sum()
     + (confidence * probes[2]).sum()).backward()
    return hidden.detach(), logits.detach()[..., :real], confidence.detach()


def _on_ranks_parity(rank: int, world_size: int, forms) -> dict:
    from megatron_dflash.draft.layers import column_parallel
    from megatron_dflash.target.head import OutputHead
    from torch import nn

    report = {}
    plan = tp_plan("unpacked")
    gen = torch.Generator().manual_seed(3)
    B, N, W, S = plan.batch_size, plan.num_blocks, plan.block_size, plan.seq_length
    full_head = torch.randn(PADDED, 64, generator=gen) * 0.3
    for form in forms:
        cfg = config(form)
        torch.manual_seed(11)
        cls = body_class(form)
        reference = cls(cfg, default_parallel_config(), tp_group=SingleRankGroup(), attention_backend="dense")
        torch.manual_seed(11)
        body = cls(cfg, default_parallel_config(), attention_backend="dense")
        full = dict(reference.named_parameters())
        init_same = [n for n, p in body.named_parameters()
                     if not torch.equal(p, _piece(full[n], _full_index(p, rank, world_size)))]
        with torch.no_grad():  # non-trivial weights: a wrong slice shows up
            for name, p in reference.named_parameters():
                p.copy_((1.0 + 0.2 * torch.randn(p.shape, generator=gen)) if p.dim() == 1 and "norm" in name
                        else 0.15 * torch.randn(p.shape, generator=gen))
            for name, p in body.named_parameters():
                p.copy_(_piece(full[name], _full_index(p, rank, world_size)))
        ref_head = nn.Linear(64, VOCAB, bias=False)
        layer = column_parallel(64, PADDED, bias=False, parallel_config=default_parallel_config(),
                                tp_group=body.tp_group, std=0.02)
        with torch.no_grad():
            ref_head.weight.copy_(full_head[:VOCAB])
            layer.weight.copy_(full_head.chunk(world_size)[rank])
        taps = torch.randn(B, S, cfg.num_taps * 64, generator=gen)
        blocks = torch.randn(B, N, W, 64, generator=gen)
        ids = torch.randint(0, VOCAB, (B, S), generator=gen)
        probes = (torch.randn(B, N, W, PADDED, generator=gen), torch.randn(B, N, W, 64, generator=gen),
                  torch.randn(B, N, W, generator=gen))
        expected = _forward(reference, OutputHead(ref_head, VOCAB), taps, blocks, plan, ids, probes)
        head = OutputHead(layer, VOCAB)
        got = _forward(body, head, taps, blocks, plan, ids, probes)
        start = head.vocab_range[0]
        expected = (expected[0], expected[1][..., start:start + got[1].shape[-1]], expected[2])
        errors = {name: relative_error(a, b) for name, a, b in zip(("hidden", "logits", "confidence"), got, expected)}
        for name, p in body.named_parameters():
            ref_grad = _piece(full[name].grad, _full_index(p, rank, world_size))
            errors[f"grad {name}"] = float("inf") if p.grad is None else relative_error(p.grad, ref_grad)
        report[form] = {"errors": errors, "init_same": init_same,
                        "w2_rows": tuple(body.markov_head.w2_rows), "nontrivial": bool(expected[1].abs().max() > 0.1)}
    return report


def _on_ranks_loss(rank: int, world_size: int, cases) -> dict:
    """The full DSpark loss through the registry's adapter (the training step's call, the loss mask as the input
    mask) at TP=1 and TP = world size from the same full weights: ``loss_sum``, ``weight_sum`` and every
    gradient after ``backward(loss_sum / weight_sum)``, for each (form, weighting) of `cases`."""
    from megatron_dflash.draft.layers import column_parallel
    from megatron_dflash.objectives.dflash_loss import LossWeighting
    from megatron_dflash.target.head import OutputHead
    from megatron_dflash.variants.options import DSPARK_OPTIONS
    from megatron_dflash.variants.registry import get_variant
    from torch import nn

    report = {}
    plan = tp_plan("unpacked")
    input_mask = torch.ones(plan.batch_size, plan.seq_length, dtype=torch.bool)
    input_mask[0, 15:] = False  # as `tp_plan`'s
    input_mask[1, :3] = False
    gen = torch.Generator().manual_seed(5)
    B, N, W, S = plan.batch_size, plan.num_blocks, plan.block_size, plan.seq_length
    full_head = torch.randn(PADDED, 64, generator=gen) * 0.3
    for form, scheme in cases:
        cfg = config(form)
        cls = body_class(form)
        torch.manual_seed(11)
        reference = cls(cfg, default_parallel_config(), tp_group=SingleRankGroup(), attention_backend="dense")
        torch.manual_seed(11)
        body = cls(cfg, default_parallel_config(), attention_backend="dense")
        full = dict(reference.named_parameters())
        with torch.no_grad():
            for name, p in reference.named_parameters():
                p.copy_((1.0 + 0.2 * torch.randn(p.shape, generator=gen)) if p.dim() == 1 and "norm" in name
                        else 0.15 * torch.randn(p.shape, generator=gen))
            for name, p in body.named_parameters():
                p.copy_(_piece(full[name], _full_index(p, rank, world_size)))
        ref_head = nn.Linear(64, VOCAB, bias=False).requires_grad_(False)
        layer = column_parallel(64, PADDED, bias=False, parallel_config=default_parallel_config(),
                                tp_group=body.tp_group, std=0.02).requires_grad_(False)
        with torch.no_grad():
            ref_head.weight.copy_(full_head[:VOCAB])
            layer.weight.copy_(full_head.chunk(world_size)[rank])
        taps = torch.randn(B, S, cfg.num_taps * 64, generator=gen)
        blocks = torch.randn(B, N, W, 64, generator=gen)
        ids = torch.randint(0, VOCAB, (B, S), generator=gen)
        final = torch.randn(B, S, 64, generator=gen)
        weighting = LossWeighting(scheme, dpace_alpha=0.3)
        results = []
        for model, head in ((reference, OutputHead(ref_head, VOCAB)), (body, OutputHead(layer, VOCAB))):
            out = get_variant("dspark").loss(
                model, model(taps, blocks, plan), plan, ids, head, decay_gamma=None if weighting.dynamic else 4.0,
                weighting=weighting, chunk_slots=5, final_hidden=final, options=DSPARK_OPTIONS.options_cls(),
                input_mask=input_mask)
            (out.loss_sum / out.weight_sum).backward()
            results.append((out.loss_sum.detach(), out.weight_sum))
        errors = {"loss_sum": relative_error(results[1][0], results[0][0]),
                  "weight_sum": relative_error(results[1][1], results[0][1])}
        for name, p in body.named_parameters():
            ref_grad = _piece(full[name].grad, _full_index(p, rank, world_size))
            errors[f"grad {name}"] = float("inf") if p.grad is None else relative_error(p.grad, ref_grad)
        report[(form, scheme)] = errors
    return report


@pytest.mark.parametrize("world_size", [2])
def test_tp_matches_tp1_outputs_and_every_gradient(tp_pool, world_size):
    reports = tp_pool(world_size).run(_on_ranks_parity, ["vanilla", "gated", "rnn", "k3_rnn"], timeout=300)
    failures = []
    for rank, report in enumerate(reports):
        for form, result in report.items():
            assert result["nontrivial"], form
            assert result["w2_rows"] == ((0, 256), (256, 300))[rank], result["w2_rows"]
            if result["init_same"]:
                failures.append(f"rank {rank} {form}: initial weights differ from TP=1's: {result['init_same']}")
            for check, err in result["errors"].items():
                if not err <= RTOL:
                    failures.append(f"rank {rank} {form} {check}: relative error {err:.3g}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world_size", [2])
def test_tp_matches_tp1_full_loss_and_every_gradient(tp_pool, world_size):
    """The whole objective (CE, L1, BCE over the Markov-corrected logits, ``W2`` split unevenly), with the
    decay and with D-PACE (its weights from the all-reduced cross entropies, the same on every rank)."""
    cases = [("vanilla", "decay"), ("gated", "decay"), ("rnn", "decay"), ("k3_rnn", "decay"),
             ("rnn", "dpace"), ("k3_rnn", "dpace")]
    reports = tp_pool(world_size).run(_on_ranks_loss, cases, timeout=300)
    print({case: max(errors.values()) for case, errors in reports[0].items()})
    failures = [f"rank {rank} {case} {check}: relative error {err:.3g}"
                for rank, report in enumerate(reports) for case, errors in report.items()
                for check, err in errors.items() if not err <= RTOL]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world_size", [2])
def test_checkpoints_and_the_converter_move_between_tp_sizes(tp_pool, tmp_path, world_size):
    """HF and torch_dist files written at TP=1 (the converter's output among them) load at TP=2, and the
    files written at TP=2 load at TP=1, tensor for tensor."""
    check_checkpoints_move_between_tp_sizes(tp_pool(world_size), tmp_path, world_size, DSparkBody, config("rnn"))