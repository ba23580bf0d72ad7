"""RMSNorm with the exact arithmetic of HF Qwen3 (normalise in fp32, scale in the input dtype)."""

from __future__ import annotations

import torch
from torch import nn


class _RMSNormFunction(torch.autograd.Function):
    """`weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`, keeping only `x` and the per-row `rsqrt` for
    backward.

    Autograd through the plain expression also keeps the normalised tensor (`x`'s size, fp32), once per
    norm: four per decoder layer (input, post-attention, q and k norms). Backward recomputes it from `x`
    (one elementwise pass). Forward runs the reference's operations in the reference's order, so outputs
    are bit-identical to it.
    """

    @staticmethod
    def forward(ctx, x, weight, eps):
        x32 = x.to(torch.float32)
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)  # [..., 1] fp32
        ctx.save_for_backward(x, weight, rstd)
        return weight * (x32 * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, rstd = ctx.saved_tensors
        normed = x.to(torch.float32) * rstd  # recomputed
        grad_weight = None
        if ctx.needs_input_grad[1]:
            product = grad_out * normed.to(x.dtype)
            grad_weight = product.reshape(-1, product.shape[-1]).sum(0).to(weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_normed = (grad_out * weight).to(torch.float32)
            # d/dx of x * rsqrt(mean(x^2) + eps): rstd * (g - normed * mean(g * normed)).
            mean = (grad_normed * normed).mean(-1, keepdim=True)
            grad_x = ((grad_normed - normed * mean) * rstd).to(x.dtype)
        return grad_x, grad_weight, None


class RMSNorm(nn.Module):
    """`weight * (x / rms(x))` over the last dimension.

    The normalisation runs in fp32 and the result is cast back before the weight is
    applied, in the same order as the reference modeling code, so bf16 outputs agree bit
    for bit with a served draft. Backward keeps only the input and the per-row scale
    (`_RMSNormFunction`).
    """

    def __init__(self, size: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """`x [..., size]`; `weight` overrides `self.weight` (used to route its gradient)."""
        return _RMSNormFunction.apply(x, self.weight if weight is None else weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
