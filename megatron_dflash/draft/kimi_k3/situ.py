"""SiTU, the gated activation of Kimi K3's MLPs, in fp32 like the reference modeling code."""

from __future__ import annotations

from typing import Optional

import torch


def situ_and_mul(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: Optional[float]) -> torch.Tensor:
    """`beta * tanh(gate / beta) * sigmoid(gate) * bounded(up)`, elementwise.

    `bounded(u) = linear_beta * tanh(u / linear_beta)`, or `u` when `linear_beta` is None. The
    chain runs in fp32 and the product is cast back to the input dtype once, so bf16 outputs
    round where the reference's do. Elementwise, hence local to a tensor-parallel rank.

    Args:
        gate, up: `[..., intermediate]` (or this rank's channels of it).
        beta: the gate's bound (`activation_situ_beta`, 1.0 when the config has none).
        linear_beta: the up branch's bound (`activation_situ_linear_beta`) or None.
    """
    dtype = gate.dtype
    g = gate.float()
    u = up.float()
    activated = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    if linear_beta is not None:
        u = linear_beta * torch.tanh(u / linear_beta)
    return (activated * u).to(dtype)
