"""What the tensor-parallel tests of the draft bodies share: plans that exercise the edge cases, a weight's
shard on a rank, the relative error of a TP=N result against TP=1, the error a call raises, and the inputs
that make one rank of the group bad.
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
