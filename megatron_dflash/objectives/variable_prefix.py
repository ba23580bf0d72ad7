"""Variable-prefix training (D2SD): blocks that show a sampled prefix of real tokens before the MASKs.

A plain DFlash block shows one real token (the anchor, slot 0) and predicts slots ``1..gamma``. A
variable-prefix block with prefix length ``l`` shows the real tokens ``x_p .. x_{p+l-1}`` at slots
``0..l-1`` and predicts only the masked suffix, slots ``l..gamma``. Training on many prefix lengths teaches
the draft to continue a partially accepted block.

One training step::

    lengths = sample_prefix_lengths(plan, seed=seed, optimizer_step=step, base=0.8, sample_ids=sample_ids)
    blocks = embed_blocks(input_ids, plan, embedding, mask_token_id=mask_id,
                          input_embedding_scale=scale, prefix_lengths=lengths)
    hidden = body(target_hidden, blocks, plan)
    out = variable_prefix_loss(hidden, plan, input_ids, head, prefix_lengths=lengths, decay_gamma=7.0)

The loss supervises slots ``k >= l`` (and the plan's loss mask), with decay weights that restart at the
prefix, ``w_k = exp(-(k - l) / decay_gamma)``; acceptance is counted from slot ``l``, the first masked slot.

Prefix lengths follow D2SD's truncated geometric prior ``Pr(l) ∝ base**l`` over
``l in [min(2, W-1), W-1]``: the lower bound skips the plain DFlash case (``l = 1``) when the block is long
enough, the upper bound keeps at least one masked slot. ``base < 1`` favours short prefixes. The draw is an
integer hash of ``(seed, step, sample_id, anchor)`` mapped through the prior's CDF with integer thresholds,
so it is identical on every device and rank and independent of batch order, with no torch RNG.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

# The 32-bit hashing shared with the plan, so both draws rest on one audited hash.
from ..common.hashing import M32 as _M32
from ..common.hashing import absorb, mix32, seed_step_hash  # noqa: E402
from ..plan.batch_plan import DFlashBatchPlan
from .dflash_loss import DFlashLossOutput, OutputHead, dflash_loss

__all__ = ["prefix_length_range", "prefix_length_prior", "sample_prefix_lengths", "variable_prefix_loss"]

# Salt and stage constants (odd, arbitrary) that make the prefix draw independent of the anchor draw,
# which hashes the same (seed, step, sample_id, position): reusing that hash would correlate a block's
# prefix with the key that selected its anchor.
_VP_SALT = 0x5A17E3C1
_VP_STAGE = 0x3C6EF372
_VP_SAMPLE_LO = 0x6A09E667
_VP_SAMPLE_HI = 0x1F83D9AB
_VP_SECOND = 0x510E527F


def prefix_length_range(block_size: int) -> tuple[int, int]:
    """``(lo, hi)`` = ``(min(2, W-1), W-1)``, the support of the prefix-length prior."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2:
        raise ValueError(f"block_size={block_size!r} must be an int >= 2.")
    return min(2, block_size - 1), block_size - 1


def prefix_length_prior(block_size: int, base: float) -> dict[int, float]:
    """``{l: Pr(l)}`` of the truncated geometric prior ``Pr(l) ∝ base**l`` on `prefix_length_range`."""
    if not (isinstance(base, (int, float)) and not isinstance(base, bool) and base > 0 and math.isfinite(base)):
        raise ValueError(f"base={base!r} must be a positive finite number (base < 1 favours short prefixes).")
    lo, hi = prefix_length_range(block_size)
    # Normalise in log space relative to the largest term so that large W or base cannot overflow.
    logs = [l * math.log(base) for l in range(lo, hi + 1)]
    top = max(logs)
    mass = [math.exp(x - top) for x in logs]
    total = sum(mass)
    return {l: m / total for l, m in zip(range(lo, hi + 1), mass)}


def _thresholds(block_size: int, base: float) -> list[int]:
    """Integer CDF thresholds in ``[0, 2**32]``: ``l = lo + #{j : u >= t_j}`` for a uniform 32-bit ``u``."""
    prior = prefix_length_prior(block_size, base)
    cumulative, out = 0.0, []
    for l in sorted(prior)[:-1]:
        cumulative += prior[l]
        out.append(min(1 << 32, int(round(cumulative * (1 << 32)))))
    return out


def sample_prefix_lengths(
    plan: DFlashBatchPlan,
    *,
    seed: int,
    optimizer_step: int,
    base: float,
    sample_ids: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``[B, N]`` int64 prefix length of every block, drawn from the truncated geometric prior.

    Args:
        plan: the batch plan (its anchors key the draw).
        seed, optimizer_step: the run seed and the optimizer step (Python ints), as for the plan.
        base: the prior's ratio, ``Pr(l) ∝ base**l``.
        sample_ids: ``[B]`` integer sample IDs (the ones given to `build_dflash_batch_plan`). Without them
            the draw is keyed by ``(seed, step, anchor)`` only, so two rows with a block at the same anchor
            get the same prefix length; pass them to decorrelate rows.

    Returns:
        ``[B, N]`` int64 on the plan's device, values in ``[min(2, W-1), W-1]`` for valid blocks and 1 for
        invalid blocks (all MASK anyway). Deterministic: the same inputs give the same lengths on every
        device, rank and batch order; no torch RNG, no host synchronisation.
    """
    if not isinstance(plan, DFlashBatchPlan):
        raise ValueError(f"plan must be a DFlashBatchPlan, got {type(plan).__name__}.")
    for name, value in (("seed", seed), ("optimizer_step", optimizer_step)):
        if isinstance(value, (bool, torch.Tensor)) or not isinstance(value, int):
            raise ValueError(f"{name} must be a Python int, got {type(value).__name__}.")
    if optimizer_step < 0:
        raise ValueError(f"optimizer_step must be >= 0, got {optimizer_step}.")
    lo, _ = prefix_length_range(plan.block_size)
    thresholds = _thresholds(plan.block_size, base)
    B = plan.batch_size
    device = plan.device
    if sample_ids is None:
        sample_ids = torch.zeros(B, dtype=torch.int64, device=device)
    elif not isinstance(sample_ids, torch.Tensor) or tuple(sample_ids.shape) != (B,):
        shape = tuple(sample_ids.shape) if isinstance(sample_ids, torch.Tensor) else type(sample_ids).__name__
        raise ValueError(f"sample_ids must be a [batch] = ({B},) integer tensor, got {shape}.")
    elif sample_ids.dtype.is_floating_point or sample_ids.dtype == torch.bool:
        raise ValueError(f"sample_ids must be an integer tensor, got dtype {sample_ids.dtype}.")
    sample_ids = sample_ids.to(device=device, dtype=torch.int64)

    base_hash = absorb(seed_step_hash(seed, optimizer_step), _VP_SALT, _VP_STAGE)  # host-side int
    row = absorb(absorb(base_hash, sample_ids & _M32, _VP_SAMPLE_LO), (sample_ids >> 32) & _M32, _VP_SAMPLE_HI)
    row2 = absorb(row, 0, _VP_SECOND)  # [B]
    anchors = plan.anchor_positions.to(torch.int64) & _M32
    u = mix32(row[:, None] ^ anchors)
    u = mix32((u + row2[:, None]) & _M32)  # [B, N] uniform in [0, 2**32)
    lengths = torch.full_like(u, lo)
    for t in thresholds:  # W - 2 comparisons at most: static, no host sync
        lengths = lengths + (u >= t).to(torch.int64)
    return torch.where(plan.block_valid, lengths, torch.ones((), dtype=torch.int64, device=device))


def variable_prefix_loss(
    hidden: torch.Tensor,
    plan: DFlashBatchPlan,
    input_ids: torch.Tensor,
    head: OutputHead,
    *,
    prefix_lengths: torch.Tensor,
    decay_gamma: Optional[float] = None,
    **loss_kwargs,
) -> DFlashLossOutput:
    """D2SD's variable-prefix loss: `dflash_loss` on each block's masked suffix.

    ``hidden [B, N, W, H]`` must come from blocks embedded with the same ``prefix_lengths``
    (`objectives.dflash_loss.dflash_loss.embed_blocks`). Slots ``k >= l`` are supervised (and the plan's loss mask), with weight
    ``exp(-(k - l) / decay_gamma)``; the loss is normalised over the global batch like `dflash_loss`
    (``loss_sum`` / ``weight_sum``). Acceptance is counted from slot ``l``. Other keyword arguments
    (``chunk_slots``, soft targets, a D-PACE ``weighting`` whose block products start at slot ``l``, ...) are
    passed to `dflash_loss`.
    """
    if "loss_mask" in loss_kwargs or "weights" in loss_kwargs:
        raise ValueError(
            "variable_prefix_loss derives loss_mask and weights from prefix_lengths; call dflash_loss directly "
            "to supply your own."
        )
    return dflash_loss(
        hidden, plan, input_ids, head, decay_gamma=decay_gamma, prefix_lengths=prefix_lengths, **loss_kwargs
    )
