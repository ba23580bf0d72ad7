"""Rotary position embeddings, always computed in fp32.

Frequencies are rebuilt from the config on every call rather than kept in a buffer: a
`model.to(bfloat16)` would round a stored buffer, and the resulting phase error grows with
position (about 2.4 rad at distance 2048 for head_dim 128, theta 1e6) and silently costs
acceptance length. The supported scalings (`linear`, `llama3`, `yarn`) follow the
definitions used by HF `transformers` so that the draft sees the same angles in training
and in serving.
"""

from __future__ import annotations

import math
from typing import Optional

import torch


def rope_inv_freq(
    head_dim: int,
    theta: float,
    scaling: Optional[dict] = None,
    max_position_embeddings: int = 0,
    device: Optional[torch.device] = None,
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies `[head_dim // 2]` (fp32) and the attention scaling factor."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq, 1.0
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq, 1.0
    factor = float(scaling["factor"])
    if rope_type == "linear":
        return inv_freq / factor, 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, factor, scaling), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, theta, factor, scaling, max_position_embeddings, device)
    raise ValueError(f"unsupported rope scaling type {rope_type!r}")


def _llama3_inv_freq(inv_freq: torch.Tensor, factor: float, scaling: dict) -> torch.Tensor:
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are interpolated, short ones kept, the band between blended.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(head_dim, theta, factor, scaling, max_position_embeddings, device):
    def mscale(scale: float, coeff: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * coeff * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)
    original = scaling.get("original_max_position_embeddings") or max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1 where the frequency is extrapolated (kept), 0 where interpolated
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 `cos`, `sin` of shape `[*positions.shape, head_dim]` (halves repeated)."""
    angles = positions.to(torch.float32)[..., None] * inv_freq.to(torch.float32)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos() * attention_scaling, angles.sin() * attention_scaling


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x [..., heads, head_dim]` by `cos`/`sin [..., head_dim]` (rotate-half layout).

    `cos`/`sin` are cast to `x.dtype` as the serving runtimes do; they are computed in
    fp32 so the cast happens once, after the angles are exact.
    """
    cos = cos.to(x.dtype).unsqueeze(-2)
    sin = sin.to(x.dtype).unsqueeze(-2)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
