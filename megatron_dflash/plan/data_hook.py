"""The plan hook: the batch plan attached to a batch, and the periodic check that every rank of a group built
the same plan (docs/design.md §5 The batch plan and the anchor rule).

``attach_dflash_plan`` adds ``batch["dflash_plan"]`` (a ``DFlashBatchPlan``) to a batch of the format of
`data/batching.py` (``loss_mask`` [B, S], ``sample_ids`` [B], ``document_ids`` [B, S]) on the device of the
batch, without any host synchronisation; ``verify_plan_agreement`` is the opt-in, periodic check that every
rank of a group built the same plan. It reads only the batch's tensors, so it needs nothing of `data`.
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch

from ..common.hashing import M32 as _M32
from ..common.hashing import hash_elements
from ..common.parallel import current_process_groups, distributed_ready, is_distributed_group, megatron_ready
from .batch_plan import DFlashBatchPlan, build_dflash_batch_plan

__all__ = ["attach_dflash_plan", "plan_checksum", "verify_plan_agreement", "PlanDisagreementError"]

# Base of the stages that separate the checksums of a plan's fields (`plan_checksum`).
_STAGE_CHECK = 0x4F1BBCDD


def attach_dflash_plan(batch: dict, *, optimizer_step: int, seed: int, anchors_per_sample: int, block_size: int,
                       use_documents: bool = True, lookahead: Optional[int] = None) -> dict:
    """Add ``batch["dflash_plan"] = build_dflash_batch_plan(...)`` and return the same dict.

    Reads ``loss_mask`` [B, S], ``sample_ids`` [B] and (with ``use_documents`` and when present)
    ``document_ids`` [B, S] (so blocks never cross documents or enter padding). ``lookahead``: the variant's
    anchor rule (`build_dflash_batch_plan`; None: a supervised position anywhere in the block). The plan is built on the
    device of ``loss_mask``, without host synchronisation; it is a pure function of the batch, step and
    seed, so every tensor-parallel rank holding the same batch builds the same plan locally.
    """
    for key in ("loss_mask", "sample_ids"):
        if key not in batch:
            raise KeyError(f"attach_dflash_plan: the batch has no '{key}' (keys: {sorted(batch)}).")
    loss_mask = batch["loss_mask"]
    if loss_mask.dtype != torch.bool:
        loss_mask = loss_mask > 0
    document_ids = batch.get("document_ids") if use_documents else None
    sample_ids = batch["sample_ids"].to(device=loss_mask.device)
    if document_ids is not None:
        document_ids = document_ids.to(device=loss_mask.device)
    batch["dflash_plan"] = build_dflash_batch_plan(
        loss_mask,
        sample_ids,
        anchors_per_sample=anchors_per_sample,
        block_size=block_size,
        optimizer_step=optimizer_step,
        seed=seed,
        document_ids=document_ids,
        lookahead=lookahead,
    )
    return batch


_PLAN_FIELDS = ("anchor_positions", "block_valid", "context_start", "position_ids", "context_position_ids",
                "loss_mask")


class PlanDisagreementError(RuntimeError):
    """The ranks of a group built different DFlash batch plans."""


def _tensor_checksum(t: torch.Tensor, stage: int) -> torch.Tensor:
    t = t.detach().reshape(-1)
    if t.is_floating_point():
        t = t.to(torch.float64).view(torch.int64)
    else:
        t = t.to(torch.int64)
    pos = torch.arange(t.numel(), dtype=torch.int64, device=t.device)
    # Each term < 2**32; sums of up to 2**31 terms stay below 2**63, so no overflow.
    return hash_elements(t, stage, pos).sum()


def plan_checksum(
    plan: DFlashBatchPlan, extra: Optional[Mapping[str, torch.Tensor]] = None
) -> tuple[list, torch.Tensor]:
    """Names and the int64 checksum vector of a plan (shapes, block size, one hash per field, extras).

    Each field's entry is the sum over elements of a 32-bit hash of (value, index), so any changed,
    moved or reordered element changes it. On the plan's device; no host synchronisation.
    """
    device = plan.device
    names = ["batch", "num_blocks", "block_size", "seq_length"]
    values = [torch.tensor([plan.batch_size, plan.num_blocks, plan.block_size, plan.seq_length],
                           dtype=torch.int64, device=device)]
    items = [(name, getattr(plan, name)) for name in _PLAN_FIELDS]
    items += [(f"extra:{k}", v) for k, v in sorted((extra or {}).items())]
    for i, (name, tensor) in enumerate(items):
        names.append(name)
        values.append(_tensor_checksum(tensor.to(device), _STAGE_CHECK + 0x1000193 * (i + 1) & _M32).reshape(1))
    return names, torch.cat(values)


def verify_plan_agreement(plan: DFlashBatchPlan, group=None, *,
                          extra: Optional[Mapping[str, torch.Tensor]] = None) -> torch.Tensor:
    """Check that every rank of ``group`` holds the same plan; raise on every rank if not.

    Computes ``plan_checksum`` (plus ``extra`` tensors, e.g. the tokens; the same keys on every rank) and
    all-reduces its MIN and MAX over the group (one all-reduce of ``[v, -v]`` with MAX). Every rank sees
    the same MIN/MAX, so either all ranks pass or all raise ``PlanDisagreementError`` naming the fields
    that differ. This synchronises with the host: call it at start-up and every K steps, not every step.

    Args:
        group: a ``torch.distributed`` process group; default the tensor-parallel group of megatron's
            ``parallel_state`` when it is initialised, else the default group.

    Returns:
        The local checksum vector.
    """
    import torch.distributed as dist

    names, local = plan_checksum(plan, extra)
    if not distributed_ready():
        return local
    if group is None and megatron_ready():
        group = current_process_groups().tp
    if group is not None and not is_distributed_group(group):
        return local
    world = dist.get_world_size(group)
    if world == 1:
        return local
    both = torch.cat([local, -local])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    n = local.numel()
    high, low = both[:n], -both[n:]
    differ = (high != low).tolist()
    if any(differ):
        local_l, low_l, high_l = local.tolist(), low.tolist(), high.tolist()
        detail = "; ".join(
            f"{names[i]} (this rank {local_l[i]}, min {low_l[i]}, max {high_l[i]})"
            for i in range(n) if differ[i]
        )
        rank = dist.get_rank(group)
        raise PlanDisagreementError(
            f"DFlash batch plans disagree across the {world} ranks of the group (this is rank {rank} of the "
            f"group): {detail}. Every rank must build its plan from the same batch (loss_mask, sample_ids, "
            f"document_ids), optimizer_step, seed, anchors_per_sample and block_size; check that the batch is "
            f"broadcast to every tensor-parallel rank and that all ranks use the same step."
        )
    return local
