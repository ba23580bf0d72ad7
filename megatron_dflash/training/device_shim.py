"""Run megatron-core on CPU ranks (gloo): the CUDA assumptions it makes, mapped, in two contexts.

* `cuda_on_cpu()`: the draft's engine (DDP, optimizers, grad clipping), entered around each engine call;
* `megatron_target_on_cpu()`: the megatron target (``GPTModel``: build and forward), entered by the training
  loop for the whole run when ``--target-backend megatron`` runs without CUDA (`training.loop.train`).

Both patch only while active and restore everything on exit; importing this module patches nothing. GPU runs
never enter either: megatron runs there as written.

The engine (`cuda_on_cpu`)
--------------------------

megatron-core 0.16's `DistributedDataParallel`, `finalize_model_grads`, `get_megatron_optimizer`
(`Float16OptimizerWithFloat16Params`, `FP32Optimizer`, `DistributedOptimizer`) and grad clipping are
plain torch arithmetic and `torch.distributed` collectives; gloo runs every collective they issue. They
only *name* the GPU, in four ways, which `cuda_on_cpu()` maps to the CPU while it is active:

* **device arguments**: buffers and scalars are created with `device=torch.cuda.current_device()` or
  `device='cuda'` (grad buffers, `found_inf`, `_scale_one`, the grad norm's accumulator), and a few
  tensors are moved with `.cuda()` / `.to('cuda')` (distributed-optimizer state gathers). A
  `TorchFunctionMode` rewrites any CUDA `device` of a torch call to the CPU and makes `.cuda()` a
  no-op for tensors that are already on the CPU.
* **dtype checks by type name**: the optimizers accept a parameter only if `param.type()` is
  `torch.cuda.{Float,Half,BFloat16}Tensor`, and grad clipping asserts `torch.cuda.FloatTensor`. The
  mode reports the CUDA type name of a CPU tensor for `Tensor.type()` without arguments.
* **`torch.cuda.current_device()`** (an int on a GPU) returns `"cpu"`, a valid `device=`.
* **`torch.cuda.synchronize()` / `empty_cache()`** (called when buffers are freed or re-allocated)
  do nothing: CPU work is synchronous and has no caching allocator.

`torch.cuda.is_available()` keeps answering False, so code that picks a backend or an RNG by it is
unaffected. Everything is restored on exit; the contexts nest. Not used on CUDA, where megatron runs
as written. Features that need CUDA for real (overlapped grad reduction on a side stream, NCCL user
buffers, FSDP) are not covered; the engine does not enable them.

The target (`megatron_target_on_cpu`)
-------------------------------------

The frozen target is built with ``use_cpu_initialization`` and its callers pass explicit causal masks on the
CPU (megatron's default mask, ``get_default_causal_mask``, is built with ``device="cuda"``; `target.masks.causal_mask` is
that mask on the CPU). What is left, each patch restored on exit:

* **RoPE device**: ``RotaryEmbedding.get_emb`` moves ``inv_freq`` to ``torch.cuda.current_device()``, which
  answers ``"cpu"``.
* **RNG fork**: ``DotProductAttention`` forks megatron's CUDA RNG tracker around its attention dropout
  (probability 0 for the target); the fork reads and sets CUDA RNG states, so it becomes a no-op context.
* **Tied-embedding sync under pipeline parallelism**: ``LanguageModule.setup_embeddings_and_output_layer``
  moves the last stage's copy of the embedding to CUDA and all-reduces it with the first stage's. That copy
  is loaded from the checkpoint right after the build (`target.megatron.weights`: ``output_layer.weight`` from
  ``embed_tokens``), so the sync is skipped (``_is_in_embd_group`` answers False). Its only caller is that
  initial sync.
* **MoE token dispatch**: the all-to-all dispatcher creates a CUDA stream at construction and copies its
  split sizes device -> host on it (``_maybe_dtoh_and_synchronize``). On the CPU the sizes already live on the
  host: the stream is a placeholder and the copy is the tensor -> numpy conversion the GPU path ends with (the
  all-to-all takes sequences of ints).
* **Uneven expert-TP collectives**: expert tensor parallelism gathers and reduce-scatters tokens in uneven
  pieces (each rank routes a different number of tokens to its experts). NCCL takes uneven
  ``all_gather`` / ``reduce_scatter`` lists, gloo does not: the uneven case of
  ``mappings._gather_along_first_dim`` / ``_reduce_scatter_along_first_dim`` becomes equal-sized collectives
  (pad to the largest piece and trim; all-reduce and slice). The even case is megatron's own.
* **No Transformer Engine**: megatron 0.16's router gating (``moe_utils.router_gating_linear``) reads the
  name ``te_general_gemm``, which only a successful TE import defines: it is set to None (megatron's "no TE"
  value), so the router takes its ``torch.mm`` path. ``multi_latent_attention`` imports megatron's TE
  extension successfully with placeholder classes and then asks ``isinstance(..., TELinear)`` of a
  placeholder: its ``HAVE_TE`` is set to False, the truth where TE does not run (no CUDA).
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

from ..target.masks import causal_mask  # the CPU callers' explicit mask, re-exported for them

__all__ = ["cuda_on_cpu", "megatron_target_on_cpu", "causal_mask"]

_CPU = torch.device("cpu")


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return False


def _to_cpu(value):
    return _CPU if _is_cuda(value) else value


class _CudaToCpu(TorchFunctionMode):
    """Rewrites CUDA devices to the CPU; `Tensor.type()` names the CUDA type; `Tensor.cuda()` stays put."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _to_cpu(kwargs["device"])
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to:  # .to("cuda"), .to(torch.device("cuda"), dtype)
            args = tuple(_to_cpu(a) for a in args)
        out = func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and isinstance(out, str) \
                and out.startswith("torch.") and not out.startswith("torch.cuda."):
            out = "torch.cuda." + out[len("torch."):]
        return out


@contextlib.contextmanager
def cuda_on_cpu():
    """Inside the block megatron's CUDA-only code paths (see the module docstring) run on the CPU."""
    saved = {name: getattr(torch.cuda, name) for name in ("current_device", "synchronize", "empty_cache")}
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.empty_cache = lambda: None
    try:
        with _CudaToCpu():
            yield
    finally:
        for name, fn in saved.items():
            setattr(torch.cuda, name, fn)


# ------------------------------------------------------------------------------------------ the target


def _host_split_sizes(self, point, tokens_per_expert=None):
    """CPU stand-in for ``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize``: split sizes as numpy."""
    for name in ("input_splits", "output_splits", "output_splits_tp"):
        value = getattr(self, name, None)
        if isinstance(value, torch.Tensor):
            setattr(self, name, value.numpy())
    return tokens_per_expert


def _uneven_gather(original):
    """``_gather_along_first_dim`` whose uneven case (``output_split_sizes``) runs as an equal-sized gather."""

    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        import torch.distributed as dist

        if output_split_sizes is None or group.size() == 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        width = max(output_split_sizes)
        padded = input_.new_zeros((width,) + tuple(input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in output_split_sizes]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([part[:n] for part, n in zip(parts, output_split_sizes)], dim=0)

    return gather


def _uneven_reduce_scatter(original):
    """``_reduce_scatter_along_first_dim`` whose uneven case (``input_split_sizes``) is an all-reduce + slice."""

    def reduce_scatter(input_, group, input_split_sizes=None, use_global_buffer=False):
        import torch.distributed as dist

        if input_split_sizes is None or group.size() == 1:
            return original(input_, group, input_split_sizes, use_global_buffer)
        total = input_.clone()
        dist.all_reduce(total, group=group)
        return torch.split(total, list(input_split_sizes), dim=0)[group.rank()].contiguous()

    return reduce_scatter


@contextlib.contextmanager
def megatron_target_on_cpu():
    """Inside the block megatron's ``GPTModel`` builds and runs on CPU ranks (see the module docstring)."""
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.tensor_parallel import mappings
    from megatron.core.tensor_parallel import random as mp_random
    from megatron.core.transformer import multi_latent_attention as mla
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as alltoall

    mp_random.initialize_rng_tracker()
    tracker = mp_random.get_cuda_rng_tracker()
    had_fork = "fork" in vars(tracker)
    saved = dict(
        current_device=torch.cuda.current_device, fork=vars(tracker).get("fork"),
        embd_group=LanguageModule._is_in_embd_group, stream=alltoall.cuda_dtoh_stream,
        dtoh=alltoall._maybe_dtoh_and_synchronize, gather=mappings._gather_along_first_dim,
        scatter=mappings._reduce_scatter_along_first_dim, mla_te=mla.HAVE_TE,
    )
    define_gemm = not hasattr(moe_utils, "te_general_gemm")

    torch.cuda.current_device = lambda: "cpu"
    tracker.fork = lambda *args, **kwargs: contextlib.nullcontext()
    LanguageModule._is_in_embd_group = lambda self: False
    alltoall.cuda_dtoh_stream = object()  # not None: __init__ creates no CUDA stream
    alltoall._maybe_dtoh_and_synchronize = _host_split_sizes
    mappings._gather_along_first_dim = _uneven_gather(saved["gather"])
    mappings._reduce_scatter_along_first_dim = _uneven_reduce_scatter(saved["scatter"])
    mla.HAVE_TE = False
    if define_gemm:
        moe_utils.te_general_gemm = None
    try:
        yield
    finally:
        torch.cuda.current_device = saved["current_device"]
        if had_fork:
            tracker.fork = saved["fork"]
        else:
            del tracker.fork
        LanguageModule._is_in_embd_group = saved["embd_group"]
        alltoall.cuda_dtoh_stream, alltoall._maybe_dtoh_and_synchronize = saved["stream"], saved["dtoh"]
        mappings._gather_along_first_dim = saved["gather"]
        mappings._reduce_scatter_along_first_dim = saved["scatter"]
        mla.HAVE_TE = saved["mla_te"]
        if define_gemm:
            del moe_utils.te_general_gemm
