"""Integer hashing on 32-bit lanes, identical on Python ints and on int64 tensors of any device.

Everything deterministic in a batch (anchors, variable-prefix lengths, sample IDs computed from
content, plan checksums) is drawn from these functions instead of a random generator, so any rank
on any device can recompute it. Values live in int64 tensors but never exceed 32 bits, and every
multiplication uses a constant below 2**31 on a value below 2**32: no product overflows int64, so
CPU and CUDA give bit-identical results.
"""

from __future__ import annotations

from typing import Union

import torch

__all__ = ["M32", "absorb", "hash_elements", "mix32", "seed_step_hash", "split64"]

M32 = 0xFFFFFFFF
_TWO32 = 1 << 32

# Per-stage constants (arbitrary odd 32-bit values) so that absorbing the same value at different
# stages (e.g. seed == step) does not cancel out.
_STAGE_SEED_LO = 0x9E3779B9
_STAGE_SEED_HI = 0x85EBCA77
_STAGE_STEP_LO = 0xC2B2AE3D
_STAGE_STEP_HI = 0x27D4EB2F
_STAGE_ELEMENT_HI = 0x9E3779B1

IntOrTensor = Union[int, torch.Tensor]


def _mul32(x: IntOrTensor, c: int) -> IntOrTensor:
    """``(x * c) mod 2**32`` for ``0 <= x < 2**32`` without ever forming a product >= 2**63.

    Constants >= 2**31 are applied as ``-(x * (2**32 - c))``: ``2**32 - c`` is below 2**31, the product
    stays below 2**63, and masking the negated value with 0xFFFFFFFF yields the same residue.
    """
    if c < (1 << 31):
        return (x * c) & M32
    return (-(x * (_TWO32 - c))) & M32


def mix32(x: IntOrTensor) -> IntOrTensor:
    """A bijective 32-bit avalanche mixer (xorshift-multiply, "lowbias32" constants)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    x = x ^ (x >> 16)
    return x


def absorb(h: IntOrTensor, value: IntOrTensor, stage: int) -> IntOrTensor:
    """Fold one 32-bit ``value`` into the running 32-bit hash ``h``; ``stage`` separates uses."""
    return mix32(((h + stage) & M32) ^ value)


def split64(value: int) -> tuple[int, int]:
    """Low and high 32-bit halves of a Python int taken modulo 2**64."""
    value &= (1 << 64) - 1
    return value & M32, value >> 32


def seed_step_hash(seed: int, optimizer_step: int) -> int:
    """32-bit hash of (seed, step), computed on the host from Python ints (no device work)."""
    seed_lo, seed_hi = split64(seed)
    step_lo, step_hi = split64(optimizer_step)
    h = absorb(0, seed_lo, _STAGE_SEED_LO)
    h = absorb(h, seed_hi, _STAGE_SEED_HI)
    h = absorb(h, step_lo, _STAGE_STEP_LO)
    h = absorb(h, step_hi, _STAGE_STEP_HI)
    return h


def hash_elements(values: torch.Tensor, stage: int, positions: torch.Tensor) -> torch.Tensor:
    """A 32-bit hash of each element of int64 ``values`` mixed with its position (``positions``, broadcast
    against ``values``); ``stage`` separates uses. On the device of ``values``, no host synchronisation.

    Summing the result over a dimension gives an order-aware hash of it (content sample IDs, plan checksums).
    """
    lo = values & M32
    hi = (values >> 32) & M32
    h = absorb(mix32((positions + stage) & M32), lo, stage)
    return absorb(h, hi, _STAGE_ELEMENT_HI)
