"""Tensor-parallel plumbing for the draft body: which group, what is refused, agreement.

The tensor-parallel group comes from megatron's `parallel_state` when it is initialised
and is a single-rank stand-in otherwise, so a body built in a plain Python process (a
notebook, a HF export) is the TP=1 case of the same code. Sequence parallelism and
context parallelism > 1 are refused: every rank of a TP group holds the whole sequence.

`initialize_model_parallel` / `destroy_model_parallel` set up and tear down megatron's
`parallel_state` so that tearing down releases the process groups setting up created.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state


_SIGNATURE_SLOTS = 32

# The process groups our `initialize_model_parallel` created, in creation order, until
# `destroy_model_parallel` releases them.
_model_parallel_groups: list = []


def _live_process_groups() -> list:
    """Every process group torch.distributed holds, the default one included, in creation order.

    torch keeps no public list; megatron's own teardown reads this same registry.
    """
    from torch.distributed.distributed_c10d import _world

    return list(_world.pg_map)


def _release_process_groups(groups: list) -> None:
    """`destroy_process_group` of each of `groups` still registered, newest first.

    Newest first is torch's own order for a full teardown (some NCCL versions' abort is collective,
    so every rank must release in the same order; megatron creates its groups in the same order
    everywhere). A gloo group's worker and transport threads end with it.
    """
    live = set(_live_process_groups())
    for group in reversed(groups):
        if group in live:
            dist.destroy_process_group(group)


def initialize_model_parallel(**sizes) -> None:
    """megatron's `parallel_state.initialize_model_parallel(**sizes)`, remembering the groups it creates.

    megatron's `destroy_model_parallel` only forgets its groups (it destroys just the gloo
    data-parallel ones), and every process group owns threads: about sixty per set-up of a
    gloo world, so a process that sets up and tears down repeatedly (a test pool, a user
    calling `training.run` twice) grew by that much each time. Pair with `destroy_model_parallel`
    below. Groups left by an earlier set-up that megatron's own teardown dropped are released first.

    Collective over the world (as megatron's set-up is). It ends with a barrier: a gloo rank can
    return from creating a group while a peer is still connecting to it, and a rank that then
    released the group at once (a run refused right after set-up) would make the peer fail with
    "Connection closed by peer" instead of the run's own error.
    """
    if _model_parallel_groups and not parallel_state.model_parallel_is_initialized():
        _release_process_groups(_model_parallel_groups)
        _model_parallel_groups.clear()
    before = set(_live_process_groups())
    parallel_state.initialize_model_parallel(**sizes)
    _model_parallel_groups.extend(g for g in _live_process_groups() if g not in before)
    dist.barrier()


def destroy_model_parallel() -> None:
    """megatron's `parallel_state.destroy_model_parallel()`, then release the groups our set-up created.

    Groups created by anyone else (the default group, a caller's own `new_group`) are left alone.
    Local: no collective, but the same call on every rank (see `_release_process_groups`).
    """
    parallel_state.destroy_model_parallel()
    groups = list(_model_parallel_groups)
    _model_parallel_groups.clear()
    if dist.is_available() and dist.is_initialized():
        _release_process_groups(groups)


class SingleRankGroup:
    """What megatron's tensor-parallel layers need of a group when there is only one rank.

    Megatron's layers only ask a group for `size()` and `rank()` before skipping the
    collective of a one-rank group; this lets them run without `torch.distributed`.
    """

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def tensor_parallel_group(group=None):
    """The TP group to use: `group` if given, megatron's if initialised, else a single rank."""
    if group is not None:
        return group
    if dist.is_available() and dist.is_initialized() and parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_group()
    return SingleRankGroup()


def is_distributed_group(group) -> bool:
    return not isinstance(group, SingleRankGroup) and group.size() > 1


def check_parallel_layout(sequence_parallel: bool, context_parallel_size: Optional[int] = None) -> None:
    """Refuse sequence parallelism and context parallelism > 1 with errors that say why."""
    if sequence_parallel:
        raise ValueError(
            "sequence_parallel=True is not supported by the DFlash draft body: every block attends "
            "to the whole target prefix, so each tensor-parallel rank needs the full sequence. "
            "Set sequence_parallel=False for the draft (the target may still use it)."
        )
    if context_parallel_size is None and dist.is_available() and dist.is_initialized():
        if parallel_state.model_parallel_is_initialized():
            context_parallel_size = parallel_state.get_context_parallel_world_size()
    if context_parallel_size is not None and context_parallel_size > 1:
        raise ValueError(
            f"context_parallel_size={context_parallel_size} is not supported by the DFlash draft "
            "body; use context_parallel_size=1 and scale with data or tensor parallelism."
        )


def gather_disagreement(local_error: Optional[str], signature: Sequence[int], group, device):
    """None when no rank of `group` erred and all signatures agree; else `(per_rank, mismatch)`.

    One all-reduce (MAX of `[error flag, signature, -signature]`) decides, so the common case
    costs one tiny collective; only on failure are `(error, signature)` of every rank gathered.
    The signature is padded to a fixed length so that ranks whose inputs have a different
    number of dimensions still enter the same collective.
    """
    values = [len(signature)] + [int(v) for v in signature][: _SIGNATURE_SLOTS - 1]
    values += [-1] * (_SIGNATURE_SLOTS - len(values))
    sig = torch.tensor(values, dtype=torch.int64, device=device)
    flag = torch.tensor([0 if local_error is None else 1], dtype=torch.int64, device=device)
    summary = torch.cat([flag, sig, -sig])
    dist.all_reduce(summary, op=dist.ReduceOp.MAX, group=group)
    n = sig.numel()
    any_error = bool(summary[0].item())
    mismatch = not torch.equal(summary[1 : 1 + n], -summary[1 + n :])
    if not any_error and not mismatch:
        return None
    per_rank: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(per_rank, (local_error, list(signature)), group=group)
    return per_rank, mismatch


def agree_or_raise(local_error: Optional[str], signature: Sequence[int], group, device) -> None:
    """Make every rank of `group` raise the same error if any rank's input is bad.

    `local_error` is this rank's own validation message (None when fine) and `signature`
    a few integers that must be equal on all ranks (shapes). One small all-reduce decides;
    only when something is wrong are the messages gathered, so that a single bad rank
    turns into one identical `ValueError` everywhere instead of a hang in the next
    collective.
    """
    if not is_distributed_group(group):
        if local_error is not None:
            raise ValueError(local_error)
        return
    disagreement = gather_disagreement(local_error, signature, group, device)
    if disagreement is None:
        return
    messages, mismatch = disagreement
    lines = [f"rank {r}: {err}" for r, (err, _) in enumerate(messages) if err is not None]
    if mismatch:
        shapes = ", ".join(f"rank {r}: {sig_r}" for r, (_, sig_r) in enumerate(messages))
        lines.append(f"ranks of the tensor-parallel group disagree on input shapes ({shapes})")
    raise ValueError(
        "DFlash body input rejected on every tensor-parallel rank: " + "; ".join(lines)
        + ". Every TP rank must receive the same batch."
    )


class _ReduceGradOverGroup(torch.autograd.Function):
    """Identity forward; all-reduce (sum) of the gradient over ``group`` in backward."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def reduce_grad_over_group(tensor: torch.Tensor, group) -> torch.Tensor:
    """`tensor` unchanged, but its gradient is summed over `group` in backward.

    For a replicated tensor that each rank uses only for its own shard of the work (the
    per-head q/k norms under TP, the Kimi K3 draft's head-shared key slice, hidden states
    entering a vocab-parallel head): each rank's gradient is a partial sum, the true gradient is
    the sum over ranks. This is what megatron's `copy_to_tensor_model_parallel_region` means to
    do, but megatron-core 0.16 all-reduces `grad.contiguous()` and returns the original: a
    non-contiguous gradient (an expanded, head-shared tensor's) comes back unreduced. Here the
    reduced tensor is the one returned. A one-rank group is the identity.
    """
    if not is_distributed_group(group):
        return tensor
    return _ReduceGradOverGroup.apply(tensor, group)


class _AllGatherLastDim(torch.autograd.Function):
    """Concatenate every rank's tensor along the last dim; backward keeps this rank's slice.

    megatron's `gather_from_tensor_model_parallel_region` has the same autograd contract but
    allocates its buffer on `torch.cuda.current_device()`, so it cannot run on CPU ranks (gloo);
    this is the one all-gather of the draft's tensor-parallel code.
    """

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        ctx.width = tensor.shape[-1]
        return _all_gather_last_dim(tensor, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start = ctx.group.rank() * ctx.width
        return grad[..., start : start + ctx.width].contiguous(), None


def _all_gather_last_dim(tensor: torch.Tensor, group) -> torch.Tensor:
    local = tensor.contiguous()
    parts = [torch.empty_like(local) for _ in range(group.size())]
    dist.all_gather(parts, local, group=group)
    return torch.cat(parts, dim=-1)


def gather_last_dim(tensor: torch.Tensor, group) -> torch.Tensor:
    """`[..., X]` of every rank of `group` concatenated in rank order: `[..., group.size() * X]`.

    For a tensor whose gathered form feeds replicated computation (the same on every rank): its
    gradient is then the same on every rank, and backward keeps this rank's slice of it. Integer
    tensors (no gradient) are gathered the same way. The identity for a one-rank group.
    """
    if not is_distributed_group(group):
        return tensor
    if not tensor.requires_grad:
        return _all_gather_last_dim(tensor, group)
    return _AllGatherLastDim.apply(tensor, group)
