"""RMSNorm with the exact arithmetic of HF Qwen3 (normalise in fp32, scale in the input dtype)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """`weight * (x / rms(x))` over the last dimension.

    The normalisation runs in fp32 and the result is cast back before the weight is
    applied, in the same order as the reference modeling code, so bf16 outputs agree bit
    for bit with a served draft.
    """

    def __init__(self, size: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """`x [..., size]`; `weight` overrides `self.weight` (used to route its gradient)."""
        input_dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight if weight is None else weight) * x.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
