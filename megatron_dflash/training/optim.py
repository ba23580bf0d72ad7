"""Gradients, optimizer and learning-rate schedule of the draft: megatron-core's, on every device.

`MegatronEngine` wraps the body in megatron-core's `DistributedDataParallel` (fp32 gradient buffers,
one all-reduce over the data-parallel group, or a reduce-scatter under the distributed optimizer),
finishes the gradients with `finalize_model_grads(num_tokens=...)`, steps `get_megatron_optimizer`'s
Adam (fp32 main parameters under bf16, megatron's grad-norm clipping, optionally the
`DistributedOptimizer` with its state sharded over DP) and `OptimizerParamScheduler`. On CPU ranks
(gloo) the same code runs under `device_shim.cuda_on_cpu()`, so tests and CPU runs train with the
engine that GPU runs use.

Gradient accumulation with global normalisation (`calculate_per_token_loss`): every micro-batch
back-propagates its `loss_sum` unnormalised; after the last one the gradients are summed over
DP and divided once by the global `sum(weight_sum)`. So the update does not depend on how the
global batch is split into micro-batches and DP ranks.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from ..common.errors import DivergenceError
from ..common.parallel import ProcessGroups, current_process_groups, distributed_ready, is_distributed_group
from .device_shim import cuda_on_cpu

__all__ = ["DISTRIBUTED_OPTIMIZER_FORMAT", "Engine", "MegatronEngine", "build_engine", "build_scheduler",
           "optimizer_layout"]

# megatron's checkpoint format of the distributed optimizer's state: each DP rank writes its own shard of
# every gradient bucket (a fully parallel save, no gather); a checkpoint resumes at another DP size, but
# only at the same TP size and again with the distributed optimizer.
DISTRIBUTED_OPTIMIZER_FORMAT = "dp_reshardable"


def optimizer_layout(use_distributed_optimizer: bool, tensor_model_parallel_size: int) -> str:
    """What a checkpoint's optimizer state is bound to; a run resumes it only with the same layout.

    The replicated optimizer's state is sharded like the parameters (resumes at any TP and DP size);
    the distributed optimizer's is laid out in megatron's gradient buckets of one TP size (any DP size).
    """
    if use_distributed_optimizer:
        return f"distributed optimizer ({DISTRIBUTED_OPTIMIZER_FORMAT}) at TP={tensor_model_parallel_size}"
    return "replicated optimizer"


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
    if group is None or not distributed_ready():
        return 1
    return group.size() if is_distributed_group(group) else 1


@contextlib.contextmanager
def _world_collectives_within_the_draft_stage(active: bool, stage):
    """Inside the block, `all_gather_object` over the default (world) group runs over the draft's stage.

    megatron-core 0.16's `get_megatron_optimizer` aligns the optimizer's parameter groups across ranks
    with `all_gather_object` over the whole world (once per model chunk and once for expert
    parameters). Under pipeline parallelism only the draft's stage builds an optimizer, so the stages
    without the draft would never join; the alignment belongs to the ranks that hold the draft, its
    tensor x data-parallel group, `stage`.
    """
    if not active:
        yield
        return
    real = dist.all_gather_object

    def within_stage(object_list, obj, group=None):
        if group is not None:
            return real(object_list, obj, group=group)
        gathered = [None] * dist.get_world_size(stage)
        real(gathered, obj, group=stage)
        object_list[:] = gathered

    dist.all_gather_object = within_stage
    try:
        yield
    finally:
        dist.all_gather_object = real


def _draft_stage_process_groups(distributed_optimizer: bool, groups: ProcessGroups):
    """megatron's process groups for the draft's optimizer under pipeline parallelism.

    The body is on one stage, so its grad norm is reduced over that stage's ranks only (megatron's
    default model-parallel group spans every stage, which would wait for the other stages forever).
    megatron's optimizer reduces gradient statistics over `mp`, or with the distributed optimizer
    (each DP rank holds a shard of the gradients) over `intra_dist_opt`: the draft's TP group, and
    its TP x DP group. With the distributed optimizer `mp` stays megatron's model-parallel group:
    there it only numbers the optimizer's sharded state (`dp_group_idx_<rank in mp>`), which keeps
    checkpoints' keys as they were. Everything else is the job's `groups`; the draft has no experts.
    """
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection(
        tp=groups.tp,
        dp=groups.dp,
        dp_cp=groups.dp_cp,
        mp=groups.mp if distributed_optimizer else groups.tp,
        intra_dist_opt=groups.tp_dp,
        expt_dp=None,
        tp_ep_pp=None,
    )


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


# ------------------------------------------------------------------------------------------ megatron


class MegatronEngine(Engine):
    """megatron-core DDP + `finalize_model_grads` + `get_megatron_optimizer` + `OptimizerParamScheduler`.

    On CUDA megatron runs as written; on CPU ranks (gloo) every call into megatron runs under
    `device_shim.cuda_on_cpu()`, which maps the few places where megatron names the GPU.
    """

    def __init__(self, body: nn.Module, args, draft_config, *, use_cuda: bool = True,
                 groups: Optional[ProcessGroups] = None):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.transformer.transformer_config import TransformerConfig

        self.groups = current_process_groups() if groups is None else groups
        self.device_context = contextlib.nullcontext if use_cuda else cuda_on_cpu
        self.device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
        dtype = torch.bfloat16 if args.bf16 else torch.float32
        transformer_config = TransformerConfig(
            num_layers=draft_config.num_hidden_layers,
            hidden_size=draft_config.hidden_size,
            ffn_hidden_size=draft_config.intermediate_size,
            num_attention_heads=draft_config.num_attention_heads,
            num_query_groups=draft_config.num_key_value_heads,
            # Read by megatron's DDP / optimizer only, never by the draft's layers; a draft family without one
            # head width (Kimi K3's MLA) leaves the default.
            kv_channels=getattr(draft_config, "head_dim", None),
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
            # megatron's check raises on the rank that sees a NaN before the all-reduce, leaving the others
            # waiting in it; `step` checks after the reduction, on every rank alike.
            check_for_nan_in_grad=False,
        )
        self.pp = int(args.pipeline_model_parallel_size)
        self.distributed = bool(args.use_distributed_optimizer)
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
        with self.device_context():
            self.model = DistributedDataParallel(transformer_config, ddp_config, body)
            overrides = None
            try:
                from megatron.core.optimizer import get_standard_config_overrides

                overrides = get_standard_config_overrides(opt_config)
            except ImportError:
                pass
            with _world_collectives_within_the_draft_stage(self.pp > 1, self.groups.tp_dp):
                if self.pp > 1:
                    self.optimizer = get_megatron_optimizer(
                        opt_config, [self.model], config_overrides=overrides, use_gloo_process_groups=False,
                        pg_collection=_draft_stage_process_groups(self.distributed, self.groups),
                    )
                else:
                    self.optimizer = get_megatron_optimizer(opt_config, [self.model], config_overrides=overrides)
        self.scheduler = build_scheduler(self.optimizer, args)

    def zero_grad(self) -> None:
        with self.device_context():
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()

    def finish_grads(self, local_weight: torch.Tensor) -> float:
        from megatron.core.distributed import finalize_model_grads

        num_tokens = local_weight.detach().to(device=self.device, dtype=torch.float32).reshape(()).clone()
        with self.device_context():
            if self.pp > 1:
                # finalize_model_grads would talk over the pipeline group (embedding grads, num_tokens
                # broadcast); the draft is on one stage: DP grad sync, DP sum of the weight, scale.
                self.model.finish_grad_sync()
                dp_group = self.groups.dp
                if _group_size(dp_group) > 1:
                    dist.all_reduce(num_tokens, group=dp_group)
                if float(num_tokens.item()) > 0:
                    self.model.scale_gradients(1.0 / num_tokens)
                return float(num_tokens.item())
            finalize_model_grads([self.model], num_tokens=num_tokens)  # all-reduces num_tokens over DP
        return float(num_tokens.item())

    def _check_finite_gradients(self) -> None:
        """Raise on every rank of the draft alike if any rank holds a NaN / Inf gradient (one small all-reduce).

        The whole local gradient buffer is checked: after the data-parallel reduction a non-finite value is
        on every DP rank, and under the distributed optimizer a rank's unreduced part still shows its own."""
        finite = torch.ones(1, dtype=torch.float32, device=self.device)
        for buffer in self.model.buffers:
            finite *= torch.isfinite(buffer.grad_data).all().to(torch.float32)
        group = self.groups.tp_dp
        if _group_size(group) > 1:
            dist.all_reduce(finite, op=dist.ReduceOp.MIN, group=group)
        if float(finite.item()) < 1.0:
            raise DivergenceError(
                "non-finite gradients (NaN or Inf) after this step's micro-batches, on at least one rank; the "
                "update is skipped and training stops: lower --lr, check the data, or drop --bf16."
            )

    def step(self) -> float:
        self._check_finite_gradients()
        with self.device_context():
            ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise DivergenceError("megatron's optimizer skipped the step (non-finite gradients); training stops: "
                                  "lower --lr, check the data, or drop --bf16.")
        self.scheduler.step(1)
        return float(grad_norm) if grad_norm is not None else float("nan")

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def _sharding_metadata(self) -> dict:
        return {"distrib_optim_sharding_type": DISTRIBUTED_OPTIMIZER_FORMAT} if self.distributed else {}

    def sharded_state_dict(self, model_sd: dict, prefix: str = "model.") -> dict:
        with self.device_context():
            return {"optimizer": self.optimizer.sharded_state_dict(model_sd, metadata=self._sharding_metadata())}

    def sharded_state_dict_for_load(self, model_sd: dict) -> dict:
        if self.distributed:
            self._materialise_torch_adam_state()
        with self.device_context():
            return {"optimizer": self.optimizer.sharded_state_dict(model_sd, is_loading=True,
                                                                   metadata=self._sharding_metadata())}

    def _materialise_torch_adam_state(self) -> None:
        """Give torch's Adam the per-parameter state it creates lazily at its first step (zeros, step 0).

        Without Transformer Engine / Apex, megatron 0.16's `DistributedOptimizer.state_dict()` reads the
        step count from torch's per-parameter state, which a fresh optimizer (a resume before any step)
        does not have yet; the load then overwrites these placeholders with the checkpoint's values.
        """
        for inner in self._torch_adams():
            for group in inner.param_groups:
                for p in group["params"]:
                    state = inner.state[p]
                    state.setdefault("exp_avg", torch.zeros_like(p.data))
                    state.setdefault("exp_avg_sq", torch.zeros_like(p.data))
                    state.setdefault("step", torch.tensor(0.0, dtype=torch.float32))

    def _torch_adams(self) -> list:
        """The torch `Adam` / `AdamW` inside megatron's optimizer(s) (the CPU fallback without TE / Apex)."""
        inner = [getattr(opt, "optimizer", None) for opt in getattr(self.optimizer, "chained_optimizers",
                                                                     [self.optimizer])]
        return [opt for opt in inner if isinstance(opt, (torch.optim.Adam, torch.optim.AdamW))]

    def _restore_torch_adam_steps(self) -> None:
        """Each parameter's Adam step count after a distributed-optimizer load: the checkpoint's, its own tensor.

        megatron 0.16's `DistributedOptimizer` keeps torch Adam's step count in the parameter groups of the
        checkpoint; its `load_state_dict` hands every parameter one shared `step` tensor and then copies the
        pre-load placeholder over it (the step rides along with the per-parameter state). Set it from the
        loaded groups, one tensor per parameter (torch increments each parameter's step in place).
        """
        for adam in self._torch_adams():
            for group in adam.param_groups:
                if "step" not in group:
                    continue
                for p in group["params"]:
                    if "step" in adam.state[p]:
                        adam.state[p]["step"] = torch.tensor(float(group["step"]), dtype=torch.float32)

    def load_state(self, loaded: dict) -> None:
        # no_grad: the distributed optimizer copies the checkpoint into views of its fp32 main parameters
        with torch.no_grad(), self.device_context():
            self.optimizer.load_state_dict(loaded["optimizer"])
        if self.distributed:
            self._restore_torch_adam_steps()


def build_engine(body: nn.Module, args, draft_config, *, use_cuda: bool,
                 groups: Optional[ProcessGroups] = None) -> Engine:
    """The draft's engine (collective over the ranks that hold the draft). `groups`: the job's process groups
    (default `common.parallel.current_process_groups()`)."""
    return MegatronEngine(body, args, draft_config, use_cuda=use_cuda, groups=groups)
