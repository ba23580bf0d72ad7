"""What the tensor-parallel tests of the draft bodies share: plans that exercise the edge cases, a weight's
shard on a rank, the relative error of a TP=N result against TP=1, the error a call raises, the inputs
that make one rank of the group bad, and the check that a body's files move between TP sizes.
"""

from __future__ import annotations

import torch

from megatron_dflash.plan.batch_plan import DFlashBatchPlan

# fp32 reductions in a different order (sharded matmuls + all-reduce): relative tolerance.
RTOL = 1e-5


def tp_plan(name: str) -> DFlashBatchPlan:
    """Plans with an invalid row (no valid block), an anchor at 0 (empty context), documents."""
    W, S = 4, 20
    if name == "unpacked":
        input_mask = torch.ones(3, S, dtype=torch.bool)
        input_mask[0, 15:] = False  # unsupervised tail
        input_mask[1, :3] = False
        return DFlashBatchPlan.from_anchors(
            torch.tensor([[0, 5, 11], [3, 9, 16], [0, 0, 0]]),
            block_size=W,
            block_valid=torch.tensor([[True, True, True], [True, True, False], [False, False, False]]),
            input_mask=input_mask,
        )
    if name == "documents":
        # Row 0: two documents then padding; row 1: one document; row 2: padding only.
        document_ids = torch.tensor(
            [
                [0] * 9 + [1] * 8 + [-1] * 3,
                [5] * S,
                [-1] * S,
            ]
        )
        return DFlashBatchPlan.from_anchors(
            torch.tensor([[0, 4, 11], [2, 16, 7], [0, 0, 0]]),
            block_size=W,
            seq_length=S,
            block_valid=torch.tensor([[True, True, True], [True, True, True], [False, False, False]]),
            document_ids=document_ids,
        )
    raise KeyError(name)


def shard(full: torch.Tensor, dim, rank: int, world_size: int) -> torch.Tensor:
    if dim is None:
        return full
    return full.chunk(world_size, dim=dim)[rank]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    if actual.shape != expected.shape:
        return float("inf")
    if not torch.isfinite(actual).all():
        return float("inf")
    scale = expected.abs().max().item()
    return (actual - expected).abs().max().item() / max(scale, 1e-12)


def error_of(build) -> str:
    try:
        build()
    except Exception as err:  # the type is part of what is checked
        return f"{type(err).__name__}: {err}"
    return "no error"


def bad_inputs(variant: str, rank: int, world_size: int, th, be, plan):
    """This rank's (target_hidden, block_embeddings, plan) for a one-bad-rank variant."""
    if variant == "block_embeddings_shape" and rank == 1:
        return th, be[:, :, :-1], plan  # one slot short
    if variant == "target_features" and rank == world_size - 1:
        return th[..., :-1], be, plan  # one feature short
    if variant == "plan_block_size" and rank == 0:
        # Same tensor shapes on every rank; only rank 0's plan disagrees with the config.
        return th, be, DFlashBatchPlan.from_anchors(
            plan.anchor_positions, block_size=plan.block_size + 1, seq_length=plan.seq_length,
            block_valid=plan.block_valid,
        )
    if variant == "block_embeddings_dims" and rank == 1:
        return th, be[:, 0], plan  # a 3-d tensor where a 4-d one is expected
    return th, be, plan


def save_here_and_load_tp1(rank: int, world_size: int, body_class, config, hf_tp1: str, megatron_tp1: str,
                           hf_out: str, megatron_out: str):
    """On each rank of a TP=N pool: save the seed-0 body at this TP size in both formats (`hf_out`,
    `megatron_out`), load the TP=1 files here (gathered back to full tensors by `hf_state_dict`)."""
    from megatron_dflash.checkpoint.hf import hf_state_dict, load_hf_checkpoint, save_hf_checkpoint
    from megatron_dflash.checkpoint.torch_dist import load_megatron_draft, save_megatron_draft
    from megatron_dflash.draft.body import default_parallel_config

    torch.manual_seed(0)
    body = body_class(config, default_parallel_config())
    save_hf_checkpoint(body, hf_out)
    save_megatron_draft(body, megatron_out)
    from_megatron = load_megatron_draft(megatron_tp1)
    assert isinstance(from_megatron, body_class) and from_megatron.tp_group.size() == world_size
    return hf_state_dict(load_hf_checkpoint(hf_tp1)), hf_state_dict(from_megatron)


def check_checkpoints_move_between_tp_sizes(pool, tmp_path, world_size: int, body_class, config) -> None:
    """HF and torch_dist files written at TP=1 (the converter's output among them) load at TP=`world_size`,
    and the files written there (and the converter's HF output of them) load at TP=1, tensor for tensor."""
    from megatron_dflash.checkpoint.conversion import convert_hf_to_megatron, convert_megatron_to_hf
    from megatron_dflash.checkpoint.hf import hf_state_dict, load_hf_checkpoint, save_hf_checkpoint
    from megatron_dflash.checkpoint.torch_dist import load_megatron_draft, resolve_iteration_dir

    torch.manual_seed(4)
    source = body_class(config)
    with torch.no_grad():  # not the seed-0 init the ranks save: a mix-up of the two files cannot pass
        for p in source.parameters():
            p.normal_(0.0, 0.3)
    save_hf_checkpoint(source, str(tmp_path / "hf1"))
    convert_hf_to_megatron(str(tmp_path / "hf1"), str(tmp_path / "meg1"), validate=True)
    expected = hf_state_dict(source)
    torch.manual_seed(0)
    written_at_tp = hf_state_dict(body_class(config))  # TP-independent init: what the ranks save

    results = pool.run(save_here_and_load_tp1, body_class, config, str(tmp_path / "hf1"),
                       resolve_iteration_dir(str(tmp_path / "meg1")), str(tmp_path / "hfN"), str(tmp_path / "megN"),
                       timeout=300)
    for rank, (from_hf, from_megatron) in enumerate(results):
        for name, tensor in expected.items():
            assert torch.equal(from_hf[name], tensor), f"rank {rank} HF {name}"
            assert torch.equal(from_megatron[name], tensor), f"rank {rank} torch_dist {name}"
    convert_megatron_to_hf(str(tmp_path / "megN"), str(tmp_path / "hfN_back"), validate=True)
    for label, loaded in (
        ("HF", load_hf_checkpoint(str(tmp_path / "hfN"))),
        ("torch_dist", load_megatron_draft(str(tmp_path / "megN"))),
        ("converted", load_hf_checkpoint(str(tmp_path / "hfN_back"))),
    ):
        got = hf_state_dict(loaded)
        assert got.keys() == written_at_tp.keys()
        for name, tensor in written_at_tp.items():
            assert torch.equal(got[name], tensor), f"{label} written at TP={world_size}: {name}"
