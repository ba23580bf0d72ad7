"""Run megatron-core's DDP and optimizers on CPU ranks (gloo): the CUDA assumptions they make, mapped.

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
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["cuda_on_cpu"]

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
