"""The Kimi K3 draft under tensor parallelism, on simulated gloo ranks (TP = world size = 2, 4).

As for the Qwen3-style body (`test_body_tp.py`): TP=N equals TP=1 with the same full weights in
outputs, input gradients and every parameter gradient (the matching shard of it), including the
replicated low-rank A projections whose gradients only come out whole if the head-shared key
slice and the column-parallel inputs are reduced over the group; initial weights do not depend
on the TP size; layouts the body cannot run are refused on every rank; one rank with bad input
makes every rank raise the same error.
"""

from __future__ import annotations

import pytest
import torch

from megatron_dflash.draft.body import default_parallel_config
from megatron_dflash.draft.kimi_k3 import KimiK3Body, KimiK3DraftConfig
from megatron_dflash.common.parallel import SingleRankGroup

from kimi_k3_configs import DRAFT, our_config, target_dict
from tp_checks import RTOL, bad_inputs, check_checkpoints_move_between_tp_sizes, error_of, relative_error, shard, tp_plan

WORLD_SIZES = (2, 4)
COLUMN_PARALLEL = ("q_b_proj", "q_proj", "kv_b_proj", "g_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")
REPLICATED = ("q_a_proj", "kv_a_proj_with_mqa", "fc")  # plus every norm

CASES = {
    # name: (config case of kimi_k3_configs, plan of tp_checks.tp_plan, attention backend)
    "lora_gated_unpacked": ("lora_gated", "unpacked", "auto"),
    "wide_values_documents": ("wide_values_no_gate_full_q", "documents", "auto"),
    "lora_gated_documents_dense": ("lora_gated", "documents", "dense"),
}


def _shard_dim(name: str):
    module = name.split(".")[-2]
    if module in COLUMN_PARALLEL:
        return 0
    if module in ROW_PARALLEL:
        return 1
    return None


def _inputs(cfg, plan, seed: int):
    gen = torch.Generator().manual_seed(seed)
    B, N, W, H = plan.batch_size, plan.num_blocks, cfg.block_size, cfg.hidden_size
    return (
        torch.randn(B, plan.seq_length, cfg.num_taps * H, generator=gen),
        torch.randn(B, N, W, H, generator=gen),
        torch.randn(B, N, W, H, generator=gen),
    )


# --------------------------------------------------------------------------------------
# Functions run on the ranks
# --------------------------------------------------------------------------------------


def _on_ranks_parity(rank: int, world_size: int, case_names) -> dict:
    report = {}
    for case_name in case_names:
        config_case, plan_name, backend = CASES[case_name]
        cfg, plan = our_config(config_case), tp_plan(plan_name)
        torch.manual_seed(1234)
        reference = KimiK3Body(cfg, default_parallel_config(), tp_group=SingleRankGroup(), attention_backend=backend)
        gen = torch.Generator().manual_seed(99)
        with torch.no_grad():  # non-trivial norms and larger weights: a wrong slice shows up
            for name, p in reference.named_parameters():
                if p.dim() == 1:
                    p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
                else:
                    p.copy_(0.15 * torch.randn(p.shape, generator=gen))
        body = KimiK3Body(cfg, default_parallel_config(), attention_backend=backend)
        assert body.tp_group.size() == world_size
        full = dict(reference.named_parameters())
        assert [n for n, _ in body.named_parameters()] == list(full)
        with torch.no_grad():
            for name, p in body.named_parameters():
                dim = _shard_dim(name)
                if dim is not None:
                    assert getattr(p, "tensor_model_parallel", False), name
                    assert p.partition_dim == dim, (name, p.partition_dim)
                else:
                    assert not getattr(p, "tensor_model_parallel", False), name
                p.copy_(shard(full[name], dim, rank, world_size))

        th, be, probe = _inputs(cfg, plan, seed=7)
        results = {}
        for label, model in (("ref", reference), ("tp", body)):
            th_ = th.clone().requires_grad_(True)
            be_ = be.clone().requires_grad_(True)
            out = model(th_, be_, plan)
            (out * probe).sum().backward()
            results[label] = (out.detach(), th_.grad, be_.grad)
        ref_out, ref_th_grad, ref_be_grad = results["ref"]
        out, th_grad, be_grad = results["tp"]
        errors = {
            "output": relative_error(out, ref_out),
            "grad target_hidden": relative_error(th_grad, ref_th_grad),
            "grad block_embeddings": relative_error(be_grad, ref_be_grad),
        }
        for name, p in body.named_parameters():
            expected = shard(full[name].grad, _shard_dim(name), rank, world_size)
            errors[f"grad {name}"] = float("inf") if p.grad is None else relative_error(p.grad, expected)
        invalid = ~plan.block_valid
        report[case_name] = {
            "errors": errors,
            "zero_at_invalid": bool((out[invalid] == 0).all()),
            "reference_nontrivial": bool(ref_out.abs().max() > 0)
            and all(bool(p.grad.abs().max() > 0) for p in reference.parameters()),
        }
    return report


def _on_ranks_init(rank: int, world_size: int, seed: int) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state

    cfg = our_config("lora_gated")
    torch.manual_seed(seed)
    reference = KimiK3Body(cfg, default_parallel_config(), tp_group=SingleRankGroup())
    torch.manual_seed(seed)
    body = KimiK3Body(cfg, default_parallel_config())
    group = parallel_state.get_tensor_model_parallel_group()
    full = dict(reference.named_parameters())
    same = {}
    for name, p in body.named_parameters():
        dim = _shard_dim(name)
        pieces = [torch.empty_like(p) for _ in range(world_size)]
        dist.all_gather(pieces, p.detach().contiguous(), group=group)
        if dim is None:  # replicated: equal on every rank, and to TP=1
            same[name] = all(torch.equal(x, full[name]) for x in pieces)
        else:
            same[name] = torch.equal(torch.cat(pieces, dim=dim), full[name].detach())
    return same


def _on_ranks_refusals(rank: int, world_size: int) -> dict:
    six_heads = KimiK3DraftConfig.from_target_config({**target_dict("lora_gated"), "num_attention_heads": 6}, **DRAFT)
    return {
        "heads": error_of(lambda: KimiK3Body(six_heads)),
        "sequence_parallel": error_of(
            lambda: KimiK3Body(
                our_config("lora_gated"),
                default_parallel_config(sequence_parallel=True, tensor_model_parallel_size=world_size),
            )
        ),
        "context_parallel": error_of(
            lambda: KimiK3Body(our_config("lora_gated"), default_parallel_config(context_parallel_size=2))
        ),
    }


def _on_ranks_one_bad_rank(rank: int, world_size: int, variants) -> dict:
    import torch.distributed as dist

    cfg, plan = our_config("lora_gated"), tp_plan("unpacked")
    torch.manual_seed(5)
    body = KimiK3Body(cfg, default_parallel_config())
    th, be, probe = _inputs(cfg, plan, seed=11)
    errors = {}
    for variant in variants:
        bad = bad_inputs(variant, rank, world_size, th, be, plan)
        errors[variant] = error_of(lambda: body(*bad))
    out = body(th, be, plan)
    (out * probe).sum().backward()
    check = torch.tensor([float(rank)])
    dist.all_reduce(check)
    return {"errors": errors, "sync": check.item() == sum(range(world_size)), "finite": bool(torch.isfinite(out).all())}


# --------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [2])
def test_checkpoints_move_between_tp_sizes_in_both_formats(tp_pool, tmp_path, world_size):
    """HF and torch_dist files written at TP=1 (the converter's output among them) load at TP=N and the
    reverse (the converter's HF output of the TP=N files too), tensor for tensor."""
    check_checkpoints_move_between_tp_sizes(tp_pool(world_size), tmp_path, world_size, KimiK3Body,
                                            our_config("lora_gated"))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_tp_matches_tp1_outputs_and_every_gradient(tp_pool, world_size):
    reports = tp_pool(world_size).run(_on_ranks_parity, list(CASES))
    failures = []
    for rank, report in enumerate(reports):
        for case_name, result in report.items():
            assert result["reference_nontrivial"], f"{case_name}: the test loss gives zero gradients somewhere"
            if not result["zero_at_invalid"]:
                failures.append(f"rank {rank} {case_name}: output not zero at invalid blocks")
            for check, err in result["errors"].items():
                if not err <= RTOL:
                    failures.append(f"rank {rank} {case_name} {check}: relative error {err:.3g}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_initial_weights_do_not_depend_on_tp(tp_pool, world_size):
    for rank, same in enumerate(tp_pool(world_size).run(_on_ranks_init, 21)):
        differing = [name for name, ok in same.items() if not ok]
        assert not differing, f"rank {rank}: {differing}"


def test_layouts_the_body_cannot_run_are_refused_on_every_rank(tp_pool):
    reports = tp_pool(4).run(_on_ranks_refusals)
    for report in reports:
        assert "must divide num_attention_heads=6: this draft supports TP in [1, 2, 3, 6]" in report["heads"]
        assert "sequence_parallel=True is not supported" in report["sequence_parallel"]
        assert "context_parallel_size=2 is not supported" in report["context_parallel"]
    assert all(r == reports[0] for r in reports)


def test_one_bad_rank_makes_every_rank_raise_the_same_error(tp_pool):
    variants = ["block_embeddings_shape", "target_features", "plan_block_size", "block_embeddings_dims"]
    reports = tp_pool(2).run(_on_ranks_one_bad_rank, variants)
    for variant in variants:
        messages = {r["errors"][variant] for r in reports}
        assert len(messages) == 1, f"{variant}: ranks disagree: {messages}"
        (message,) = messages
        assert message.startswith("ValueError: DFlash body input rejected on every tensor-parallel rank"), message
    assert all(r["sync"] and r["finite"] for r in reports)
