"""An independent oracle for the training engine: megatron's DDP / optimizer semantics in plain torch.

The product trains with `MegatronEngine` (megatron-core's `DistributedDataParallel`,
`finalize_model_grads`, `get_megatron_optimizer`) everywhere. This module re-derives what those
do for the draft, written from their documented semantics without calling any of them, so the
tests can compare the real engine against it:

* fp32 `main_grad` per parameter; gradients accumulate there across micro-batches (also under bf16);
* one all-reduce (sum) of a flat fp32 gradient buffer over the data-parallel group, then the
  buffer is scaled by 1 / (global sum of the loss weights) (`calculate_per_token_loss`);
* the grad norm: squares of tensor-parallel shards summed over the tensor-parallel group, replicated
  parameters counted once (TP rank 0); clip with `coeff = clip / (norm + 1e-6)` when below 1;
* Adam with decoupled weight decay over fp32 master parameters (biases and 1-D parameters without
  weight decay), the bf16 parameters copied back from the masters after each step;
* megatron's `OptimizerParamScheduler` (the same schedule object the product uses: the schedule's
  arithmetic is megatron's, what is compared here is that both engines drive it identically).

`reference_engine()` makes the training loop build this engine instead of the product's.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from torch import nn

from megatron_dflash.training.optim import Engine, build_scheduler


def no_weight_decay(name: str, param: torch.Tensor) -> bool:
    """megatron's default: biases and 1-D parameters (norm weights) get no weight decay."""
    return name.endswith(".bias") or param.dim() == 1


def _is_split(param: torch.Tensor) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False))


def _group_size(group) -> int:
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


class ReferenceEngine(Engine):
    """Plain-torch DDP + clipped Adam with fp32 masters (see the module docstring). `model` is the body."""

    def __init__(self, body: nn.Module, args, *, dp_group=None, tp_group=None, tp_rank: int = 0):
        self.model = body
        self.dp_group = dp_group
        self.tp_group = tp_group
        self.tp_rank = tp_rank
        self.clip_grad = float(args.clip_grad)
        named = [(n, p) for n, p in body.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        total = sum(p.numel() for p in self.params)
        self.grad_buffer = torch.zeros(total, dtype=torch.float32)
        self.main_grads = []
        offset = 0
        for p in self.params:
            view = self.grad_buffer[offset: offset + p.numel()].view_as(p)
            offset += p.numel()
            p.main_grad = view
            self.main_grads.append(view)
            p.register_post_accumulate_grad_hook(self._accumulate)
        # fp32 master copies of low-precision parameters (the fp32 ones are their own master)
        self.masters = [p if p.dtype == torch.float32 else nn.Parameter(p.detach().float().clone())
                        for p in self.params]
        groups = []
        for decays in (True, False):
            params = [m for (n, p), m in zip(named, self.masters) if no_weight_decay(n, p) != decays]
            if params:
                groups.append({"params": params, "wd_mult": 1.0 if decays else 0.0, "default_config": True})
        self.optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(args.adam_beta1, args.adam_beta2),
                                           eps=args.adam_eps, weight_decay=args.weight_decay, foreach=False)
        self.scheduler = build_scheduler(self.optimizer, args)

    @staticmethod
    def _accumulate(param: torch.Tensor) -> None:
        param.main_grad.add_(param.grad.to(torch.float32))
        param.grad = None

    def zero_grad(self) -> None:
        self.grad_buffer.zero_()

    def finish_grads(self, local_weight: torch.Tensor) -> float:
        weight = local_weight.detach().to(torch.float64).reshape(1).clone()
        if _group_size(self.dp_group) > 1:
            dist.all_reduce(self.grad_buffer, group=self.dp_group)
            dist.all_reduce(weight, group=self.dp_group)
        total = float(weight.item())
        if total > 0:
            self.grad_buffer.mul_(1.0 / total)
        return total

    def grad_norm(self) -> float:
        squares = torch.zeros(1, dtype=torch.float32)
        for p, g in zip(self.params, self.main_grads):
            if _is_split(p) or self.tp_rank == 0:
                squares += g.pow(2).sum()
        if _group_size(self.tp_group) > 1:
            dist.all_reduce(squares, group=self.tp_group)
        return float(squares.sqrt().item())

    def step(self) -> float:
        norm = self.grad_norm()
        if not math.isfinite(norm):
            raise FloatingPointError(f"the gradient norm is {norm}")
        if self.clip_grad > 0:
            coeff = self.clip_grad / (norm + 1.0e-6)
            if coeff < 1.0:
                self.grad_buffer.mul_(coeff)
        for m, g in zip(self.masters, self.main_grads):
            m.grad = g
        self.optimizer.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                if m is not p:
                    p.copy_(m.to(p.dtype))
        for m in self.masters:
            m.grad = None
        self.scheduler.step(1)
        return norm


def build_reference_engine(body: nn.Module, args, draft_config, *, use_cuda: bool, groups=None) -> ReferenceEngine:
    """`optim.build_engine`'s signature; the DP / TP groups are the job's (`groups`), as the product's engine uses."""
    from megatron_dflash.common.parallel import current_process_groups

    if use_cuda:
        raise ValueError("the reference engine runs on CPU ranks only")
    groups = current_process_groups() if groups is None else groups
    return ReferenceEngine(body, args, dp_group=groups.dp, tp_group=groups.tp, tp_rank=groups.tp_rank)


@contextlib.contextmanager
def reference_engine():
    """Inside the block the training loop trains with `ReferenceEngine` (no checkpoints: it has no state dict)."""
    from megatron_dflash.training import optim

    saved = optim.build_engine
    optim.build_engine = build_reference_engine
    try:
        yield
    finally:
        optim.build_engine = saved
