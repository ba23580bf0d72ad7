"""Gradients, optimizer and learning-rate schedule of the draft.

Two engines with the same semantics; the loop only talks to `Engine`:

* `MegatronEngine` (CUDA): megatron-core `DistributedDataParallel` (fp32 gradient buffers,
  all-reduce over the data-parallel group), `finalize_model_grads(num_tokens=...)` for the global
  normalisation, `get_megatron_optimizer` (Adam, fp32 main params under bf16, megatron's
  grad-norm clipping) and `OptimizerParamScheduler`.
* `LocalEngine` (no CUDA): megatron's DDP buffers and optimizers call `torch.cuda` internally, so
  this re-implements exactly what they do, in plain torch:
  fp32 `main_grad` per parameter (gradients accumulate there across micro-batches, also under
  bf16), one all-reduce (sum) of the flat gradient buffer over the data-parallel group, scaling by
  1 / (global sum of the loss weights), megatron's grad norm (squares of tensor-parallel shards
  summed over the tensor-parallel group, replicated parameters counted once; the draft lives on one
  pipeline stage, so the pipeline group takes no part) and clip
  (`coeff = clip / (norm + 1e-6)`), `torch.optim.AdamW` (decoupled weight decay; biases and 1-D
  parameters without weight decay, megatron's default) over fp32 master parameters, and the same
  `OptimizerParamScheduler`.

Gradient accumulation with global normalisation (`calculate_per_token_loss`): every micro-batch
back-propagates its `loss_sum` unnormalised; after the last one the gradients are summed over
DP and divided once by the global `sum(weight_sum)`. So the update does not depend on how the
global batch is split into micro-batches and DP ranks.
"""

from __future__ import annotations

import dataclasses
import math


import torch
import torch.distributed as dist
from torch import nn

__all__ = ["Engine", "LocalEngine", "MegatronEngine", "build_engine", "build_scheduler", "no_weight_decay"]


def no_weight_decay(name: str, param: torch.Tensor) -> bool:
    """Megatron's default: biases and 1-D parameters (norm weights) get no weight decay."""
    return name.endswith(".bias") or param.dim() == 1


def _is_split(param: torch.Tensor) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False))


def _like(sharded, key: str, data: torch.Tensor):
    """A `ShardedTensor` laid out like `sharded` (same global shape, offsets, replicas) for `data`."""
    return dataclasses.replace(sharded, key=key, data=data, dtype=data.dtype)


def build_scheduler(optimizer, args):
    """megatron's `OptimizerParamScheduler`: linear warm-up from 0, then `--lr-decay-style` to `--min-lr`."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters,
        lr_decay_steps=args.lr_decay_iters,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
    )


def _group_size(group) -> int:
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


class Engine:
    """Interface: `model` (call it), `zero_grad()`, `finish_grads(local_weight) -> global weight`,
    `step() -> grad_norm`, `lr`, `sharded_state_dict(model_sd)`, `load_state(loaded)`."""

    model: nn.Module
    scheduler = None

    def zero_grad(self) -> None: ...

    def finish_grads(self, local_weight: torch.Tensor) -> float: ...

    def step(self) -> float: ...

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])


# ------------------------------------------------------------------------------------------ CPU


class LocalEngine(Engine):
    """The CPU engine (see the module docstring). `model` is the body itself."""

    def __init__(self, body: nn.Module, args, *, dp_group=None, mp_group=None, tp_rank: int = 0):
        self.model = body
        self.args = args
        self.dp_group = dp_group
        self.mp_group = mp_group
        self.tp_rank = tp_rank
        self.clip_grad = float(args.clip_grad)
        named = [(n, p) for n, p in body.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        total = sum(p.numel() for p in self.params)
        # One flat fp32 gradient buffer: one all-reduce per step, like megatron's grad buffer.
        self.grad_buffer = torch.zeros(total, dtype=torch.float32, device=self.params[0].device)
        self.main_grads = []
        offset = 0
        for p in self.params:
            view = self.grad_buffer[offset: offset + p.numel()].view_as(p)
            offset += p.numel()
            p.main_grad = view
            self.main_grads.append(view)
            p.register_post_accumulate_grad_hook(self._accumulate)
        # fp32 master copies of low-precision parameters (the fp32 ones are their own master).
        self.masters = []
        for p in self.params:
            if p.dtype == torch.float32:
                self.masters.append(p)
            else:
                master = nn.Parameter(p.detach().to(torch.float32).clone())
                self.masters.append(master)
        decay = [m for n, p, m in zip(self.names, self.params, self.masters) if not no_weight_decay(n, p)]
        no_decay = [m for n, p, m in zip(self.names, self.params, self.masters) if no_weight_decay(n, p)]
        groups = []
        for params, mult in ((decay, 1.0), (no_decay, 0.0)):
            if params:
                groups.append({"params": params, "wd_mult": mult, "default_config": True})
        self.optimizer = torch.optim.AdamW(
            groups, lr=args.lr, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps,
            weight_decay=args.weight_decay, foreach=False,
        )
        # Optimizer state exists from the start (what AdamW creates lazily on its first step), so a
        # checkpoint always has the same structure.
        for m in self.masters:
            self.optimizer.state[m] = {
                "step": torch.tensor(0.0, dtype=torch.float32),
                "exp_avg": torch.zeros_like(m, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(m, memory_format=torch.preserve_format),
            }
        self.scheduler = build_scheduler(self.optimizer, args)

    @staticmethod
    def _accumulate(param: torch.Tensor) -> None:
        param.main_grad.add_(param.grad.to(torch.float32))
        param.grad = None

    def zero_grad(self) -> None:
        self.grad_buffer.zero_()
        for p in self.params:
            p.grad = None

    def finish_grads(self, local_weight: torch.Tensor) -> float:
        """Sum gradients and the loss weight over DP, divide the gradients by the global weight."""
        weight = local_weight.detach().to(torch.float64).reshape(1).clone()
        if _group_size(self.dp_group) > 1:
            dist.all_reduce(self.grad_buffer, group=self.dp_group)
            dist.all_reduce(weight, group=self.dp_group)
        total = float(weight.item())
        if total > 0:
            self.grad_buffer.mul_(1.0 / total)
        return total

    def grad_norm(self) -> float:
        """Megatron's global L2 norm: split parameters on every TP rank, replicated ones on TP rank 0."""
        squares = torch.zeros(1, dtype=torch.float32, device=self.grad_buffer.device)
        for p, g in zip(self.params, self.main_grads):
            if _is_split(p) or self.tp_rank == 0:
                squares += g.float().pow(2).sum()
        if _group_size(self.mp_group) > 1:
            dist.all_reduce(squares, group=self.mp_group)
        return float(squares.sqrt().item())

    def step(self) -> float:
        norm = self.grad_norm()
        if not math.isfinite(norm):
            raise FloatingPointError(
                f"the gradient norm is {norm}: a non-finite loss or gradient; lower --lr, check the data, or "
                "use --bf16 off."
            )
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

    # ---------------------------------------------------------------- checkpoint state
    def sharded_state_dict(self, model_sd: dict, prefix: str = "model.") -> dict:
        """Adam moments (and fp32 masters) sharded like their parameters, plus the step count."""
        out: dict = {}
        for name, p, m in zip(self.names, self.params, self.masters):
            base = model_sd[prefix + name]
            state = self.optimizer.state[m]
            for key in ("exp_avg", "exp_avg_sq"):
                out[f"optimizer.state.{key}.{name}"] = _like(base, f"optimizer.state.{key}.{name}", state[key])
            if m is not p:
                out[f"optimizer.master.{name}"] = _like(base, f"optimizer.master.{name}", m.data)
        steps = {float(self.optimizer.state[m]["step"]) for m in self.masters}
        out["optimizer.common"] = {"step": steps.pop() if len(steps) == 1 else sorted(steps)}
        return out

    def load_state(self, loaded: dict) -> None:
        with torch.no_grad():
            for name, p, m in zip(self.names, self.params, self.masters):
                state = self.optimizer.state[m]
                for key in ("exp_avg", "exp_avg_sq"):
                    value = loaded[f"optimizer.state.{key}.{name}"]
                    if value is not state[key]:
                        state[key].copy_(value)
                if m is not p:
                    value = loaded[f"optimizer.master.{name}"]
                    if value is not m.data:
                        m.data.copy_(value)
                    p.copy_(m.to(p.dtype))
            step = loaded["optimizer.common"]["step"]
            for m in self.masters:
                self.optimizer.state[m]["step"] = torch.tensor(float(step), dtype=torch.float32)


# ------------------------------------------------------------------------------------------ CUDA


class MegatronEngine(Engine):
    """megatron-core DDP + `get_megatron_optimizer` + `OptimizerParamScheduler` (CUDA only).

    Not exercised by the CPU test suite (megatron's buffers and optimizers need CUDA).
    """

    def __init__(self, body: nn.Module, args, draft_config):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.transformer.transformer_config import TransformerConfig

        dtype = torch.bfloat16 if args.bf16 else torch.float32
        transformer_config = TransformerConfig(
            num_layers=draft_config.num_hidden_layers,
            hidden_size=draft_config.hidden_size,
            ffn_hidden_size=draft_config.intermediate_size,
            num_attention_heads=draft_config.num_attention_heads,
            num_query_groups=draft_config.num_key_value_heads,
            kv_channels=draft_config.head_dim,
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            # The draft lives on one pipeline stage: its DDP / optimizer never talk to other stages.
            pipeline_model_parallel_size=1,
            params_dtype=dtype,
            bf16=args.bf16,
            calculate_per_token_loss=True,
            use_cpu_initialization=True,
            gradient_accumulation_fusion=False,
        )
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=args.use_distributed_optimizer,
            check_for_nan_in_grad=True,
        )
        self.pp = int(args.pipeline_model_parallel_size)
        self.model = DistributedDataParallel(transformer_config, ddp_config, body)
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=args.lr,
            min_lr=args.min_lr,
            weight_decay=args.weight_decay,
            adam_beta1=args.adam_beta1,
            adam_beta2=args.adam_beta2,
            adam_eps=args.adam_eps,
            clip_grad=args.clip_grad,
            bf16=args.bf16,
            params_dtype=dtype,
            use_distributed_optimizer=args.use_distributed_optimizer,
        )
        overrides = None
        try:
            from megatron.core.optimizer import get_standard_config_overrides

            overrides = get_standard_config_overrides(opt_config)
        except ImportError:
            pass
        self.optimizer = get_megatron_optimizer(opt_config, [self.model], config_overrides=overrides)
        if self.pp > 1:
            # The body is on one stage: the grad norm is reduced over TP only (megatron's default, the
            # model-parallel TP x PP group, would wait for the other stages forever).
            from megatron.core import parallel_state

            tp_group = parallel_state.get_tensor_model_parallel_group()
            for opt in [self.optimizer] + list(getattr(self.optimizer, "chained_optimizers", [])):
                opt.grad_stats_parallel_group = tp_group
        self.scheduler = build_scheduler(self.optimizer, args)

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def finish_grads(self, local_weight: torch.Tensor) -> float:
        from megatron.core.distributed import finalize_model_grads

        num_tokens = local_weight.detach().to(torch.float32).reshape(()).clone().cuda()
        if self.pp > 1:
            # finalize_model_grads would talk over the pipeline group (embedding grads, num_tokens
            # broadcast); the draft is on one stage: DP grad sync, DP sum of the weight, scale.
            from megatron.core import parallel_state

            self.model.finish_grad_sync()
            dp_group = parallel_state.get_data_parallel_group()
            if _group_size(dp_group) > 1:
                dist.all_reduce(num_tokens, group=dp_group)
            if float(num_tokens.item()) > 0:
                self.model.scale_gradients(1.0 / num_tokens)
            return float(num_tokens.item())
        finalize_model_grads([self.model], num_tokens=num_tokens)  # all-reduces num_tokens over DP
        return float(num_tokens.item())

    def step(self) -> float:
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise FloatingPointError("megatron's optimizer skipped the step (non-finite gradients).")
        self.scheduler.step(1)
        return float(grad_norm) if grad_norm is not None else float("nan")

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def sharded_state_dict(self, model_sd: dict, prefix: str = "model.") -> dict:
        return {"optimizer": self.optimizer.sharded_state_dict(model_sd)}

    def sharded_state_dict_for_load(self, model_sd: dict) -> dict:
        return {"optimizer": self.optimizer.sharded_state_dict(model_sd, is_loading=True)}

    def load_state(self, loaded: dict) -> None:
        self.optimizer.load_state_dict(loaded["optimizer"])


def build_engine(body: nn.Module, args, draft_config, *, use_cuda: bool) -> Engine:
    from megatron.core import parallel_state

    if use_cuda:
        return MegatronEngine(body, args, draft_config)
    initialised = dist.is_available() and dist.is_initialized() and parallel_state.model_parallel_is_initialized()
    dp_group = parallel_state.get_data_parallel_group() if initialised else None
    # The grad norm's group: TP only. The body lives on one pipeline stage (PP > 1: the other stages hold
    # no body and would never join a model-parallel all-reduce); at PP = 1 the two groups are the same.
    mp_group = parallel_state.get_tensor_model_parallel_group() if initialised else None
    tp_rank = parallel_state.get_tensor_model_parallel_rank() if initialised else 0
    return LocalEngine(body, args, dp_group=dp_group, mp_group=mp_group, tp_rank=tp_rank)
