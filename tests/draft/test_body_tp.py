"""The draft body under tensor parallelism, on simulated gloo ranks (TP = world size = 2, 4).

TP=N must match TP=1 with the same full weights: outputs, every parameter gradient (the
matching shard of it) and the input gradients. Initial weights must not depend on the TP
size. Layouts the body cannot run (TP not dividing the KV heads, sequence parallelism,
context parallelism) are refused on every rank, and one rank with bad input makes every
rank raise the same error instead of hanging the group.

The functions starting with `_on_ranks_` run in the rank processes (see `tp_harness.py`):
each rank builds a TP=1 reference body itself, with the same seed, so nothing large
travels between processes.
"""

from __future__ import annotations

import pytest
import torch

from megatron_dflash.draft.body import DFlashBody, default_parallel_config
from megatron_dflash.draft.config import DFlashConfig
from megatron_dflash.common.parallel import SingleRankGroup
from megatron_dflash.plan.batch_plan import DFlashBatchPlan

from tp_checks import RTOL, bad_inputs, error_of, relative_error, shard, tp_plan

WORLD_SIZES = (2, 4)

# Column-parallel weights are split on dim 0 (output features), row-parallel ones on dim 1
# (input features); everything else (fc, the norms, q/k norms) is replicated.
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


def _config(name: str) -> DFlashConfig:
    """Tiny drafts whose heads, KV heads and MLP split over 2 and 4 ranks."""
    common = dict(
        hidden_size=64,
        intermediate_size=128,
        vocab_size=100,
        mask_token_id=3,
        block_size=4,
        num_target_layers=8,
        target_layer_ids=[1, 4],
        max_position_embeddings=256,
        rope_theta=10000.0,
    )
    if name == "mha_sliding":
        # 4 heads / 4 KV heads; layer 1 is a sliding-window layer (causal in-block).
        return DFlashConfig(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=16,
            layer_types=["full_attention", "sliding_attention"],
            sliding_window=6,
            **common,
        )
    if name == "gqa_documents":
        # GQA 8 heads / 4 KV heads, a sliding layer between two full ones.
        return DFlashConfig(
            num_hidden_layers=3,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=8,
            layer_types=["full_attention", "sliding_attention", "full_attention"],
            sliding_window=5,
            **common,
        )
    if name == "kv3":
        # 3 KV heads: no TP size > 1 that divides them among 2 or 4 ranks.
        return DFlashConfig(
            num_hidden_layers=1,
            num_attention_heads=6,
            num_key_value_heads=3,
            head_dim=8,
            **common,
        )
    raise KeyError(name)


CASES = {
    # name: (config, plan, attention backend)
    "mha_sliding_unpacked": ("mha_sliding", "unpacked", "auto"),
    "gqa_documents": ("gqa_documents", "documents", "auto"),
    "gqa_documents_dense": ("gqa_documents", "documents", "dense"),
}


def _inputs(cfg: DFlashConfig, plan: DFlashBatchPlan, seed: int):
    """target_hidden, block_embeddings and a probe for the loss, identical on every rank."""
    gen = torch.Generator().manual_seed(seed)
    B, N, W, H = plan.batch_size, plan.num_blocks, cfg.block_size, cfg.hidden_size
    target_hidden = torch.randn(B, plan.seq_length, cfg.num_taps * H, generator=gen)
    block_embeddings = torch.randn(B, N, W, H, generator=gen)
    probe = torch.randn(B, N, W, H, generator=gen)
    return target_hidden, block_embeddings, probe


def _shard_dim(name: str):
    """Dim along which parameter `name` is split over TP, None if replicated."""
    module = name.split(".")[-2]
    if module in COLUMN_PARALLEL:
        return 0
    if module in ROW_PARALLEL:
        return 1
    return None


# --------------------------------------------------------------------------------------
# Functions run on the ranks
# --------------------------------------------------------------------------------------


def _reference_and_tp_bodies(cfg: DFlashConfig, backend: str, rank: int, world_size: int):
    """A TP=1 body (this rank's own copy) and the TP=N body holding this rank's shards of its weights."""
    torch.manual_seed(1234)
    reference = DFlashBody(cfg, default_parallel_config(), tp_group=SingleRankGroup(), attention_backend=backend)
    # Non-trivial norm weights, so that a norm applied to the wrong slice shows up.
    gen = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for p in reference.parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
    body = DFlashBody(cfg, default_parallel_config(), attention_backend=backend)
    assert body.tp_group.size() == world_size
    full = dict(reference.named_parameters())
    names = [n for n, _ in body.named_parameters()]
    assert names == list(full), (names, list(full))
    with torch.no_grad():
        for name, p in body.named_parameters():
            dim = _shard_dim(name)
            if dim is not None:  # megatron's own bookkeeping agrees with the layout
                assert getattr(p, "tensor_model_parallel", False), name
                assert p.partition_dim == dim, (name, p.partition_dim)
            p.copy_(shard(full[name], dim, rank, world_size))
    return reference, body


def _on_ranks_parity(rank: int, world_size: int, case_names) -> dict:
    """For each case: {check: relative error} of TP=N against TP=1 with the same weights."""
    from megatron.core import parallel_state

    assert parallel_state.get_tensor_model_parallel_world_size() == world_size
    report = {}
    for case_name in case_names:
        config_name, plan_name, backend = CASES[case_name]
        cfg, plan = _config(config_name), tp_plan(plan_name)

        reference, body = _reference_and_tp_bodies(cfg, backend, rank, world_size)
        full = dict(reference.named_parameters())

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
            "any_invalid": bool(invalid.any()),
            "reference_nontrivial": bool(ref_out.abs().max() > 0)
            and all(bool(p.grad.abs().max() > 0) for p in reference.parameters()),
        }
    return report


def _on_ranks_decoding(rank: int, world_size: int, config_name: str) -> dict:
    """Decoding forwards with a KV cache at TP=N (each rank caching its own KV heads) against TP=1.

    Three forwards, as `spec_generate` makes them: the prompt, then a verified slab per cycle written at
    each row's own position while the rows advance by different amounts (the cache starts too small).
    """
    from megatron_dflash.draft.kv_cache import DraftKVCache

    cfg = _config(config_name)
    reference, body = _reference_and_tp_bodies(cfg, "chunked", rank, world_size)
    B, W, H = 2, cfg.block_size, cfg.hidden_size
    gen = torch.Generator().manual_seed(5)
    caches = {"ref": DraftKVCache(reference, B, 4), "tp": DraftKVCache(body, B, 4)}
    starts, anchors = torch.zeros(B, dtype=torch.int64), torch.tensor([9, 12])
    errors, shapes = [], {}
    with torch.no_grad():
        for step, length in enumerate((12, W, W)):
            new_context = torch.randn(B, length, cfg.num_taps * H, generator=gen)
            blocks = torch.randn(B, 1, W, H, generator=gen)
            plan = DFlashBatchPlan.for_decoding(anchors, starts[:, None] + torch.arange(length), block_size=W)
            outs = {label: model(new_context, blocks, plan, kv_cache=caches[label])
                    for label, model in (("ref", reference), ("tp", body))}
            errors.append(relative_error(outs["tp"], outs["ref"]))
            starts, anchors = anchors, anchors + torch.tensor([1 + step, W - step])
    for label, cache in caches.items():
        shapes[label] = tuple(cache.keys[0].shape)
    return {"errors": errors, "shapes": shapes}


def _on_ranks_init(rank: int, world_size: int, config_name: str, seed: int) -> dict:
    """{param: whether the gathered TP shards equal the TP=1 init with the same seed}."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    cfg = _config(config_name)
    torch.manual_seed(seed)
    reference = DFlashBody(cfg, default_parallel_config(), tp_group=SingleRankGroup())
    torch.manual_seed(seed)
    body = DFlashBody(cfg, default_parallel_config())
    group = parallel_state.get_tensor_model_parallel_group()
    full = dict(reference.named_parameters())
    same = {}
    for name, p in body.named_parameters():
        dim = _shard_dim(name)
        if dim is None:
            gathered = p.detach()
            # Replicated parameters must also be equal across ranks.
            pieces = [torch.empty_like(gathered) for _ in range(world_size)]
            dist.all_gather(pieces, gathered.contiguous(), group=group)
            same[name] = all(torch.equal(x, full[name]) for x in pieces)
        else:
            pieces = [torch.empty_like(p) for _ in range(world_size)]
            dist.all_gather(pieces, p.detach().contiguous(), group=group)
            same[name] = torch.equal(torch.cat(pieces, dim=dim), full[name].detach())
    keys = [k for k in body.state_dict() if not k.endswith("_extra_state")]
    same["<state dict keys>"] = keys == [k for k in reference.state_dict() if not k.endswith("_extra_state")]
    return same


def _on_ranks_refusals(rank: int, world_size: int) -> dict:
    """The error each rank raises for layouts the body refuses."""
    return {
        "kv_heads": error_of(lambda: DFlashBody(_config("kv3"))),
        "sequence_parallel": error_of(
            lambda: DFlashBody(
                _config("mha_sliding"),
                default_parallel_config(sequence_parallel=True, tensor_model_parallel_size=world_size),
            )
        ),
        "context_parallel": error_of(
            lambda: DFlashBody(_config("mha_sliding"), default_parallel_config(context_parallel_size=2))
        ),
    }


def _on_ranks_one_bad_rank(rank: int, world_size: int, variants) -> dict:
    """Per variant: the error this rank raised; then proof that the group is still in sync."""
    import torch.distributed as dist

    cfg, plan = _config("mha_sliding"), tp_plan("unpacked")
    torch.manual_seed(5)
    body = DFlashBody(cfg, default_parallel_config())
    th, be, probe = _inputs(cfg, plan, seed=11)
    errors = {}
    for variant in variants:
        bad = bad_inputs(variant, rank, world_size, th, be, plan)
        errors[variant] = error_of(lambda: body(*bad))
    # After the rejected calls the ranks must still agree: a normal step and a collective work.
    out = body(th, be, plan)
    (out * probe).sum().backward()
    check = torch.tensor([float(rank)])
    dist.all_reduce(check)
    return {"errors": errors, "sync": check.item() == sum(range(world_size)), "finite": bool(torch.isfinite(out).all())}


# --------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_tp_matches_tp1_outputs_and_every_gradient(tp_pool, world_size):
    reports = tp_pool(world_size).run(_on_ranks_parity, list(CASES))
    failures = []
    for rank, report in enumerate(reports):
        for case_name, result in report.items():
            assert result["reference_nontrivial"], f"{case_name}: the test loss gives zero gradients somewhere"
            assert result["any_invalid"], f"{case_name}: the plan should have invalid blocks"
            if not result["zero_at_invalid"]:
                failures.append(f"rank {rank} {case_name}: output not zero at invalid blocks")
            for check, err in result["errors"].items():
                if not err <= RTOL:
                    failures.append(f"rank {rank} {case_name}: {check} relative error {err:.3g}")
    assert not failures, "TP={} differs from TP=1:\n".format(world_size) + "\n".join(failures)


def test_decoding_with_a_kv_cache_matches_tp1(tp_pool):
    """The draft's decoding forward (KV cache of the rank-local KV heads) at TP=2 equals TP=1."""
    reports = tp_pool(2).run(_on_ranks_decoding, "gqa_documents")
    for rank, report in enumerate(reports):
        assert all(err <= RTOL for err in report["errors"]), (rank, report["errors"])
        heads = _config("gqa_documents").num_key_value_heads
        assert report["shapes"]["ref"][2] == heads and report["shapes"]["tp"][2] == heads // 2
        assert report["shapes"]["tp"][1] >= 12 + 2 * 4  # grown past the prompt and two slabs


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_initial_weights_do_not_depend_on_tp(tp_pool, world_size):
    reports = tp_pool(world_size).run(_on_ranks_init, "gqa_documents", 2024)
    for rank, same in enumerate(reports):
        differ = [name for name, ok in same.items() if not ok]
        assert not differ, f"TP={world_size} rank {rank}: initial weights differ from TP=1 for {differ}"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_refused_layouts_raise_on_every_rank(tp_pool, world_size):
    reports = tp_pool(world_size).run(_on_ranks_refusals)
    for rank, errors in enumerate(reports):
        kv = errors["kv_heads"]
        assert kv.startswith("ValueError:"), (rank, kv)
        assert "num_key_value_heads=3" in kv and "at most 3" in kv and str(world_size) in kv, (rank, kv)
        sp = errors["sequence_parallel"]
        assert sp.startswith("ValueError:") and "sequence_parallel" in sp, (rank, sp)
        cp = errors["context_parallel"]
        assert cp.startswith("ValueError:") and "context_parallel_size=2" in cp, (rank, cp)


def _check_same_error_everywhere(reports, variants):
    for variant in variants:
        messages = [report["errors"][variant] for report in reports]
        assert messages[0].startswith("ValueError:"), (variant, messages[0])
        assert all(m == messages[0] for m in messages), f"{variant}: ranks raised different errors: {messages}"
    for rank, report in enumerate(reports):
        assert report["sync"] and report["finite"], f"rank {rank}: group out of sync after a rejected input"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_one_bad_rank_makes_every_rank_raise_the_same_error(tp_pool, world_size):
    variants = ["block_embeddings_shape", "target_features", "plan_block_size"]
    reports = tp_pool(world_size).run(_on_ranks_one_bad_rank, variants)
    _check_same_error_everywhere(reports, variants)
    errors = reports[0]["errors"]
    assert "rank 1: block_embeddings has shape" in errors["block_embeddings_shape"]
    assert f"rank {world_size - 1}: target_hidden has" in errors["target_features"]
    assert "rank 0: plan.block_size=5" in errors["plan_block_size"]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_one_bad_rank_with_a_tensor_of_other_rank_does_not_break_the_group(tp_pool, world_size):
    # The rank-agreement collective must have the same size on every rank even when one
    # rank's tensor has a different number of dimensions.
    variants = ["block_embeddings_dims"]
    reports = tp_pool(world_size).run(_on_ranks_one_bad_rank, variants)
    _check_same_error_everywhere(reports, variants)
    assert "rank 1: block_embeddings must be" in reports[0]["errors"]["block_embeddings_dims"]

