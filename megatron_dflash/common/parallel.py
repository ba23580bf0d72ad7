"""Parallel state, asked for one way: the process groups of a job, what is refused, agreement.

`ProcessGroups` is the job's collection of process groups (world, TP, PP, DP, EP, ...) with the ranks
and sizes the code asks for. The training job builds it once when it sets up distribution
(`training.distributed.initialize_distributed`) and hands it down; library functions that must also run
without a job (tests, tools, a notebook) take it as an argument whose default, `current_process_groups()`,
is the one place that reads megatron's global `parallel_state`: its groups when initialised, else the
single-process form, so a body built in a plain Python process (a notebook, a HF export) is the TP=1
case of the same code. `megatron_ready()` is the one "torch.distributed and megatron initialised" test.
Sequence parallelism and context parallelism > 1 are refused: every rank of a TP group holds the whole
sequence.

`agree_or_raise` is the one "every rank agrees, or every rank raises the same error" of the package.

`initialize_model_parallel` / `destroy_model_parallel` set up and tear down megatron's
`parallel_state` so that tearing down releases the process groups setting up created.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from .atomic import NoSpaceError, as_no_space

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
    if distributed_ready():
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


def distributed_ready() -> bool:
    """Whether `torch.distributed` is available and its default process group initialised."""
    return dist.is_available() and dist.is_initialized()


def megatron_ready() -> bool:
    """Whether `torch.distributed` and megatron's `parallel_state` are both initialised."""
    return distributed_ready() and parallel_state.model_parallel_is_initialized()


@dataclass(frozen=True)
class ProcessGroups:
    """The process groups of a job and the ranks / sizes the code asks of them.

    Every field is a `torch.distributed` process group, or `SingleRankGroup` in the single-process form
    (`ProcessGroups.single()`), so `group.rank()` / `group.size()` always answer. Fields:

        world: every rank of the job.
        tp: the tensor-parallel group (the draft body's, the target's vocabulary shards).
        pp: the pipeline group (same TP and DP coordinates, one rank per stage).
        dp: the data-parallel group; `dp_cp`: data x context parallel (the data order's replicas).
        mp: the model-parallel group (TP x PP): the ranks that must receive the same batch.
        tp_dp: tensor x data parallel (the draft stage's ranks under pipeline parallelism).
        ep / etp: the expert-parallel and expert-tensor-parallel groups of an MoE target.
        cp_size: the context-parallel size (refused above 1, see `check_parallel_layout`).
    """

    world: Any
    tp: Any
    pp: Any
    dp: Any
    dp_cp: Any
    mp: Any
    tp_dp: Any
    ep: Any
    etp: Any
    cp_size: int = 1

    @classmethod
    def single(cls, world=None) -> "ProcessGroups":
        """The single-process form: every group is one rank. `world`: the default group when
        `torch.distributed` is initialised without megatron (its ranks then only share the world)."""
        one = SingleRankGroup()
        return cls(world=world or one, tp=one, pp=one, dp=one, dp_cp=one, mp=one, tp_dp=one, ep=one, etp=one)

    @classmethod
    def from_megatron(cls) -> "ProcessGroups":
        """The groups megatron's `parallel_state` holds now (it must be initialised: `megatron_ready()`)."""
        return cls(
            world=dist.group.WORLD,
            tp=parallel_state.get_tensor_model_parallel_group(),
            pp=parallel_state.get_pipeline_model_parallel_group(),
            dp=parallel_state.get_data_parallel_group(),
            dp_cp=parallel_state.get_data_parallel_group(with_context_parallel=True),
            mp=parallel_state.get_model_parallel_group(),
            tp_dp=parallel_state.get_tensor_and_data_parallel_group(),
            ep=parallel_state.get_expert_model_parallel_group(),
            etp=parallel_state.get_expert_tensor_parallel_group(),
            cp_size=parallel_state.get_context_parallel_world_size(),
        )

    @property
    def is_distributed(self) -> bool:
        """Whether the job has more than one rank."""
        return is_distributed_group(self.world)

    @property
    def rank(self) -> int:
        """This rank's global index."""
        return self.world.rank()

    @property
    def world_size(self) -> int:
        return self.world.size()

    @property
    def tp_size(self) -> int:
        return self.tp.size()

    @property
    def tp_rank(self) -> int:
        return self.tp.rank()

    @property
    def pp_size(self) -> int:
        return self.pp.size()

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline stage."""
        return self.pp.rank()

    @property
    def dp_size(self) -> int:
        return self.dp.size()

    @property
    def dp_rank(self) -> int:
        return self.dp.rank()

    @property
    def ep_size(self) -> int:
        return self.ep.size()

    @property
    def ep_rank(self) -> int:
        return self.ep.rank()

    @property
    def etp_size(self) -> int:
        return self.etp.size()

    @property
    def etp_rank(self) -> int:
        return self.etp.rank()

    def pp_peer(self, stage: int) -> int:
        """Global rank of pipeline stage `stage` in this rank's pipeline group (same TP and DP coordinates)."""
        return dist.get_global_rank(self.pp, stage)


def current_process_groups() -> ProcessGroups:
    """The documented default of every function that takes a `ProcessGroups` and must also run without a job:
    megatron's groups when `torch.distributed` and megatron are initialised, else the single-process form.
    The one place that reads megatron's global `parallel_state` for groups."""
    if megatron_ready():
        return ProcessGroups.from_megatron()
    return ProcessGroups.single(dist.group.WORLD if distributed_ready() else None)


def tensor_parallel_group(group=None):
    """The TP group to use: `group` if given, else that of `current_process_groups()`."""
    if group is not None:
        return group
    return current_process_groups().tp


def is_distributed_group(group) -> bool:
    """Whether `group` is a real process group with more than one rank (`SingleRankGroup` is not)."""
    return not isinstance(group, SingleRankGroup) and group.size() > 1


def collective_device(group=None) -> torch.device:
    """Where a collective over `group` (default: the world) takes its tensors: the current CUDA device
    for nccl, the CPU otherwise."""
    if distributed_ready() and not isinstance(group, SingleRankGroup) and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_parallel_layout(sequence_parallel: bool, context_parallel_size: Optional[int] = None) -> None:
    """Refuse sequence parallelism and context parallelism > 1 with errors that say why."""
    if sequence_parallel:
        raise ValueError(
            "sequence_parallel=True is not supported by the DFlash draft body: every block attends "
            "to the whole target prefix, so each tensor-parallel rank needs the full sequence. "
            "Set sequence_parallel=False for the draft (the target may still use it)."
        )
    if context_parallel_size is None:
        context_parallel_size = current_process_groups().cp_size
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


def _explain_body_input(per_rank: list, mismatch: bool) -> str:
    """The draft body's message when its tensor-parallel ranks erred or disagree (`agree_or_raise`)."""
    lines = [f"rank {r}: {err}" for r, (err, _) in enumerate(per_rank) if err is not None]
    if mismatch:
        shapes = ", ".join(f"rank {r}: {sig_r}" for r, (_, sig_r) in enumerate(per_rank))
        lines.append(f"ranks of the tensor-parallel group disagree on input shapes ({shapes})")
    return ("DFlash body input rejected on every tensor-parallel rank: " + "; ".join(lines)
            + ". Every TP rank must receive the same batch.")


# failure codes of `agree_or_raise`'s exception form, reduced with MAX over the group
_AGREED, _FAILED, _NO_SPACE = 0, 1, 2


def agree_or_raise(
    local_error: Union[None, str, BaseException],
    signature: Sequence[int] = (),
    group=None,
    device=None,
    *,
    explain: Callable[[list, bool], str] = _explain_body_input,
    alone: Callable[[str], str] = str,
    error_type: type = ValueError,
    elsewhere: Union[None, str, BaseException] = None,
    path: Optional[str] = None,
    note: Optional[str] = None,
) -> None:
    """Return on every rank of `group` when no rank failed (and, for messages, all signatures agree); else
    raise the same error on every rank, instead of leaving some ranks waiting in the next collective.

    Collective over `group` (default: the world; a `SingleRankGroup` or one rank: local, no collective).
    `device`: where the collective's tensors live (default `collective_device(group)`). Two forms:

    * Messages (`local_error` a str or None; `elsewhere` None): `signature`, a few integers that must be
      equal on all ranks (shapes). One small all-reduce decides; only on failure are every rank's
      `(message, signature)` gathered and `error_type(explain(per_rank, mismatch))` raised everywhere
      (`per_rank[r] = (message or None, signature)`). Alone, the local message is `error_type(alone(msg))`.
    * Exceptions (`elsewhere` given: what ranks that did not fail raise, a message for `RuntimeError` or an
      exception): one all-reduce of a failure code. With `path` (a write every rank took part in): a full
      file system on any rank is `NoSpaceError(path, note)` on every rank (`common.atomic.as_no_space`); otherwise
      the ranks that failed raise their own `local_error`, the others `elsewhere`.
    """
    group = dist.group.WORLD if group is None and distributed_ready() else group
    if elsewhere is not None:
        _agree_on_exception(local_error, group, device, elsewhere, path, note)
        return
    if group is None or not is_distributed_group(group):
        if local_error is not None:
            raise error_type(alone(local_error))
        return
    disagreement = gather_disagreement(local_error, signature, group, device or collective_device(group))
    if disagreement is not None:
        raise error_type(explain(*disagreement))


def _agree_on_exception(local_error, group, device, elsewhere, path, note) -> None:
    """`agree_or_raise`'s exception form (see there)."""
    code = _AGREED
    if local_error is not None:
        code = _NO_SPACE if path is not None and as_no_space(local_error, path) is not None else _FAILED
    if group is not None and is_distributed_group(group):
        flag = torch.tensor([code], dtype=torch.int64, device=device or collective_device(group))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        code = int(flag.item())
    if code == _AGREED:
        return
    if code == _NO_SPACE:
        raise NoSpaceError(os.path.abspath(path), note) from local_error
    if local_error is not None:
        raise local_error
    raise RuntimeError(elsewhere) if isinstance(elsewhere, str) else elsewhere


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
