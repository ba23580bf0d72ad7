"""Block attention for DFlash draft models.

Every draft block ``b`` of a row has ``W = block_size`` slots. A slot of block ``b`` attends to

* the target context of its row at sequence indices ``context_start[b] <= j < anchor[b]``
  (strictly before the anchor, inside the anchor's document), optionally restricted to a sliding
  window, and
* the slots of its own block (all of them, or only the earlier ones when ``causal``), never another block.

The reference formulation concatenates context keys and all block keys and applies an additive mask of
shape ``[B, 1, N*W, S + N*W]``. That mask (and the score tensor behind it) grows with ``N * W * (S + N*W)``
although almost all of it is masked out, so three backends are provided:

* ``"dense"``: the reference with the dense mask, written to be obviously right. It is the test oracle.
* ``"chunked"``: exact and without the dense mask. The context part (queries of a chunk of blocks against
  the context keys) and the in-block part (``[W, W]`` per block) are computed separately, each returning its
  output and log-sum-exp, and merged exactly through the log-sum-exp. Blocks are processed in chunks; forward
  keeps only each row's output and log-sum-exp, and backward recomputes only each chunk's scores
  (flash-attention style), so forward+backward memory is bounded by one chunk.
* ``"flex"``: ``torch.nn.attention.flex_attention`` with a ``BlockMask`` built from the same visibility
  rule as the dense mask (compiled on CUDA, eager elsewhere).

Shapes: B = batch, S = context length, N = blocks per row, W = block size, Hq = query heads,
Hkv = key/value heads (Hq % Hkv == 0, grouped-query attention), D = head dim.
RoPE and q/k norms are applied by the caller; this module sees plain tensors.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

__all__ = [
    "BlockVisibility",
    "block_attention",
    "dense_block_attention_mask",
]

_BACKENDS = ("auto", "dense", "chunked", "flex")

# Target size of the fp32 score tensor of one chunk of blocks in the "chunked" backend: on CPU of one key tile
# (below) of the chunk, elsewhere of the chunk's whole key range. Forward and backward hold at most about two
# such tensors at a time (the exponentiated scores and their gradient). On CPU small chunks are faster
# (cache-sized, and each chunk's context is cropped to the keys its blocks can see, which shrinks with the
# chunk when anchors are sorted; 4 MiB measured best at S = 4096, hidden 256, 4 heads); accelerators prefer
# fewer, larger kernels.
_CHUNK_SCORE_BYTES_CPU = 4 * 2**20
_CHUNK_SCORE_BYTES_ACCELERATOR = 128 * 2**20
# Context keys per score tile of a chunk on CPU: a [rows, 1024] fp32 tile stays in cache, where the
# small-inner-dimension Q K^T product and the passes over the scores run about 1.5 times faster than on
# a chunk's whole key range.
_KEY_TILE_CPU = 1024


@dataclass(frozen=True, eq=False)
class BlockVisibility:
    """What each draft block may attend to.

    Attributes:
        anchor_positions: ``[B, N]`` int64, sequence index of slot 0 of each block.
        context_start: ``[B, N]`` int64, first context index the block may see (its document start; 0
            unpacked). Visible context keys are ``context_start <= j < anchor``.
        block_valid: ``[B, N]`` bool. Invalid blocks see no context and their attention output is zero.
        causal: in-block direction. ``False``: a slot sees every slot of its block; ``True``: slot ``q``
            sees slot ``k`` iff ``k <= q``.
        sliding_window: ``None`` for full attention. Otherwise a query at sequence position ``a + q``
            (anchor ``a``, slot ``q``) sees context key ``j`` iff ``(a + q) - j < sliding_window``, and
            in-block slot ``k`` iff ``|q - k| < sliding_window`` (and ``k <= q`` when causal).

    Values are not checked against the sequence length here (that would need a host sync); the batch plan
    validates them when it is built.
    """

    anchor_positions: torch.Tensor
    context_start: torch.Tensor
    block_valid: torch.Tensor
    causal: bool = False
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        shape = tuple(self.anchor_positions.shape)
        if len(shape) != 2:
            raise ValueError(f"anchor_positions must have shape [B, N], got {shape}.")
        for name in ("context_start", "block_valid"):
            other = tuple(getattr(self, name).shape)
            if other != shape:
                raise ValueError(
                    f"{name} must have the same shape as anchor_positions {shape}, got {other}."
                )
        for name in ("anchor_positions", "context_start"):
            tensor = getattr(self, name)
            if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
                raise ValueError(f"{name} must be an integer tensor, got dtype {tensor.dtype}.")
        if not isinstance(self.causal, bool):
            raise ValueError(f"causal must be a bool, got {self.causal!r}.")
        if self.block_valid.dtype != torch.bool:
            raise ValueError(f"block_valid must be a bool tensor, got dtype {self.block_valid.dtype}.")
        devices = {t.device for t in (self.anchor_positions, self.context_start, self.block_valid)}
        if len(devices) != 1:
            raise ValueError(f"visibility tensors must live on one device, got {sorted(map(str, devices))}.")
        if self.sliding_window is not None and (
            isinstance(self.sliding_window, bool)
            or not isinstance(self.sliding_window, int)
            or self.sliding_window < 1
        ):
            raise ValueError(
                f"sliding_window must be None or a positive int, got {self.sliding_window!r}."
            )

    @classmethod
    def from_plan(cls, plan, *, causal: bool = False, sliding_window: int | None = None) -> "BlockVisibility":
        """Build from any object with ``anchor_positions``, ``context_start`` and ``block_valid`` ([B, N])."""
        missing = [
            name for name in ("anchor_positions", "context_start", "block_valid") if not hasattr(plan, name)
        ]
        if missing:
            raise TypeError(
                f"from_plan needs a batch plan with anchor_positions, context_start and block_valid; "
                f"{type(plan).__name__} lacks {missing}."
            )
        return cls(
            anchor_positions=plan.anchor_positions,
            context_start=plan.context_start,
            block_valid=plan.block_valid,
            causal=causal,
            sliding_window=sliding_window,
        )

    @property
    def batch_size(self) -> int:
        return self.anchor_positions.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.anchor_positions.shape[1]

    @property
    def device(self) -> torch.device:
        return self.anchor_positions.device

    def to(self, device: torch.device | str) -> "BlockVisibility":
        return BlockVisibility(
            anchor_positions=self.anchor_positions.to(device),
            context_start=self.context_start.to(device),
            block_valid=self.block_valid.to(device),
            causal=self.causal,
            sliding_window=self.sliding_window,
        )


# ---------------------------------------------------------------------------------------------------------
# The visibility rule on the flattened ("dense") layout, shared by the dense oracle and the flex backend.
# ---------------------------------------------------------------------------------------------------------


def _flat_mask_mod(visibility: BlockVisibility, seq_length: int, block_size: int) -> Callable:
    """Return ``mask_mod(b, h, q_idx, kv_idx) -> bool`` on the flattened layout.

    Queries are flattened to ``q_idx in [0, N*W)`` (block ``q_idx // W``, slot ``q_idx % W``); keys are the
    ``S`` context keys followed by the ``N*W`` block keys. Works both on broadcastable index tensors (dense
    mask) and on the scalar tensors that flex_attention passes.
    """
    anchors = visibility.anchor_positions
    starts = visibility.context_start
    valid = visibility.block_valid
    causal = visibility.causal
    window = visibility.sliding_window
    S, W = seq_length, block_size
    last_block = visibility.num_blocks - 1

    def mask_mod(b, h, q_idx, kv_idx):
        # flex may evaluate padded query indices past N*W: clamp so the gathers stay in range (those rows are
        # discarded anyway).
        block = torch.clamp(q_idx // W, max=last_block)
        q_slot = q_idx - (q_idx // W) * W
        anchor = anchors[b, block]
        is_context = kv_idx < S
        context_ok = valid[b, block] & (kv_idx >= starts[b, block]) & (kv_idx < anchor)
        key = kv_idx - S
        key_block = key // W
        k_slot = key - key_block * W
        block_ok = key_block == q_idx // W
        if causal:
            block_ok = block_ok & (k_slot <= q_slot)
        if window is not None:
            context_ok = context_ok & (anchor + q_slot - kv_idx < window)
            block_ok = block_ok & ((q_slot - k_slot).abs() < window)
        return (is_context & context_ok) | (~is_context & block_ok)

    return mask_mod


def dense_block_attention_mask(
    visibility: BlockVisibility,
    seq_length: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Additive mask of the reference formulation.

    Returns ``[B, 1, N*W, S + N*W]`` in ``dtype``: 0 where visible, ``-inf`` where masked. Keys are the ``S``
    context keys followed by the ``N*W`` block keys. An invalid block sees its own slots only (and no
    context), so no row is fully masked.
    """
    if seq_length < 0 or block_size < 1:
        raise ValueError(f"need seq_length >= 0 and block_size >= 1, got {seq_length} and {block_size}.")
    B, N = visibility.batch_size, visibility.num_blocks
    device = visibility.device
    mask_mod = _flat_mask_mod(visibility, seq_length, block_size)
    b = torch.arange(B, device=device).view(B, 1, 1)
    q_idx = torch.arange(N * block_size, device=device).view(1, -1, 1)
    kv_idx = torch.arange(seq_length + N * block_size, device=device).view(1, 1, -1)
    visible = mask_mod(b, None, q_idx, kv_idx)  # [B, N*W, S + N*W]
    mask = torch.zeros(visible.shape, dtype=dtype, device=device)
    mask.masked_fill_(~visible, float("-inf"))
    return mask.unsqueeze(1)


# ---------------------------------------------------------------------------------------------------------
# Input checks
# ---------------------------------------------------------------------------------------------------------


def _check_inputs(query, context_key, context_value, block_key, block_value, visibility) -> None:
    if not isinstance(visibility, BlockVisibility):
        raise TypeError(
            "visibility must be a BlockVisibility (see BlockVisibility.from_plan), got "
            f"{type(visibility).__name__}."
        )
    if query.dim() != 5:
        raise ValueError(f"query must have shape [B, N, W, Hq, D], got {tuple(query.shape)}.")
    B, N, W, Hq, D = query.shape
    if context_key.dim() != 4 or context_value.shape != context_key.shape:
        raise ValueError(
            "context_key and context_value must both have shape [B, S, Hkv, D], got "
            f"{tuple(context_key.shape)} and {tuple(context_value.shape)}."
        )
    if block_key.dim() != 5 or block_value.shape != block_key.shape:
        raise ValueError(
            "block_key and block_value must both have shape [B, N, W, Hkv, D], got "
            f"{tuple(block_key.shape)} and {tuple(block_value.shape)}."
        )
    Bc, S, Hkv, Dk = context_key.shape
    if Bc != B or block_key.shape[0] != B:
        raise ValueError(
            f"batch size mismatch: query has {B}, context_key {Bc}, block_key {block_key.shape[0]}."
        )
    if tuple(block_key.shape[1:3]) != (N, W):
        raise ValueError(
            f"block_key must have [B, N, W] = {(B, N, W)} leading dims like query, got "
            f"{tuple(block_key.shape[:3])}."
        )
    if block_key.shape[3] != Hkv:
        raise ValueError(
            "context and block keys must have the same number of KV heads, got "
            f"{Hkv} and {block_key.shape[3]}."
        )
    if Dk != D or block_key.shape[4] != D:
        raise ValueError(
            f"head dim mismatch: query has {D}, context_key {Dk}, block_key {block_key.shape[4]}."
        )
    if Hkv < 1 or Hq % Hkv != 0:
        raise ValueError(
            f"query heads ({Hq}) must be a positive multiple of key/value heads ({Hkv}) for grouped-query "
            "attention."
        )
    tensors = (query, context_key, context_value, block_key, block_value)
    if len({t.dtype for t in tensors}) != 1:
        raise ValueError(f"query/key/value dtypes differ: {[t.dtype for t in tensors]}.")
    if not query.dtype.is_floating_point:
        raise ValueError(f"attention inputs must be floating point, got {query.dtype}.")
    if len({t.device for t in tensors} | {visibility.device}) != 1:
        raise ValueError("query, keys, values and visibility tensors must be on the same device.")
    if tuple(visibility.anchor_positions.shape) != (B, N):
        raise ValueError(
            f"visibility is for [B, N] = {tuple(visibility.anchor_positions.shape)} but query has {(B, N)}."
        )


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Scores and softmax run in fp32 for half-precision inputs (fp64 inputs stay fp64)."""
    return torch.promote_types(dtype, torch.float32)


# ---------------------------------------------------------------------------------------------------------
# Dense reference
# ---------------------------------------------------------------------------------------------------------


def _dense_attention(query, context_key, context_value, block_key, block_value, visibility, scale):
    """Reference: one softmax over [context keys, all block keys] with the dense additive mask (>= fp32)."""
    B, N, W, Hq, D = query.shape
    S, Hkv = context_key.shape[1], context_key.shape[2]
    group = Hq // Hkv
    dtype = _compute_dtype(query.dtype)
    q = query.to(dtype).reshape(B, N * W, Hq, D).transpose(1, 2)  # [B, Hq, N*W, D]
    k = torch.cat([context_key.to(dtype), block_key.to(dtype).reshape(B, N * W, Hkv, D)], dim=1)
    v = torch.cat([context_value.to(dtype), block_value.to(dtype).reshape(B, N * W, Hkv, D)], dim=1)
    # Query head h uses KV head h // group.
    k = k.transpose(1, 2).repeat_interleave(group, dim=1)  # [B, Hq, S + N*W, D]
    v = v.transpose(1, 2).repeat_interleave(group, dim=1)
    mask = dense_block_attention_mask(visibility, S, W, dtype)  # [B, 1, N*W, S + N*W]
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale + mask
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v)  # [B, Hq, N*W, D]
    out = out.transpose(1, 2).reshape(B, N, W, Hq, D)
    out = out * visibility.block_valid.view(B, N, 1, 1, 1).to(out.dtype)
    return out.to(query.dtype)


# ---------------------------------------------------------------------------------------------------------
# Chunked exact path
# ---------------------------------------------------------------------------------------------------------


def _mask_scores_(scores: torch.Tensor, bands, groups: int, slots: int) -> None:
    """Set the scores of invisible (row, key) pairs to -inf, in place.

    ``scores [*, G*R, K]``; ``bands`` is a list of ``(start, stop, visible)``: ``visible`` (bool, broadcastable
    to ``[*, G, R / W, W, stop - start]``) says which rows see key columns ``start .. stop - 1``. Columns outside
    every band are visible to every row (so they cost no pass over the scores).
    """
    grouped = scores.view(*scores.shape[:-2], groups, -1, slots, scores.shape[-1])  # [*, G, R / W, W, K]
    for start, stop, visible in bands:
        grouped[..., start:stop].masked_fill_(~visible, float("-inf"))


def _grouped_masked_attention(query, key, value, bands, groups, slots):
    """Softmax attention with a boolean mask that returns the output and the log-sum-exp (forward only:
    `_ChunkedBlockAttention` differentiates it with the full log-sum-exp, see `_part_backward`).

    Inputs:
        query: ``[*, G*R, D]``, already scaled; its rows are ``G`` query heads that share one KV head, each
            with ``R`` rows (the mask is shared by the ``G`` heads, so it never has to be repeated).
        key, value: ``[*, K, D]``.
        bands: the mask as column bands (see `_mask_scores_`); each band's ``visible`` is bool, broadcastable
            to ``[*, G, R / W, W, band width]`` (rows are ``W`` slots of ``R / W`` blocks, so a rule that does
            not depend on the slot is a ``[..., 1, width]`` mask, never repeated ``W`` times).
        groups: ``G``.
        slots: ``W``.
    Outputs:
        out ``[*, G*R, D]`` and lse ``[*, G*R]`` (fp32 or wider); a row that sees no key gets out = 0 and
        lse = -inf (no NaN).

    One score-sized tensor, touched as few times as possible: the scores become unnormalised probabilities
    ``E = exp(S - rowmax)`` in place and the normaliser ``1 / rowsum(E)`` is applied to the small
    ``[*, G*R, D]`` output instead.
    """
    scores = torch.matmul(query, key.transpose(-1, -2))  # [*, G*R, K]
    _mask_scores_(scores, bands, groups, slots)
    row_max = scores.amax(dim=-1, keepdim=True)  # [*, G*R, 1]; -inf exactly on rows that see nothing
    empty = row_max == float("-inf")
    # Shift empty rows by 0 instead of -inf so that their weights are exp(-inf) = 0 rather than NaN.
    row_max.masked_fill_(empty, 0.0)
    weights = scores.sub_(row_max).exp_()  # E, in place: the scores are not needed any more
    row_sum = weights.sum(dim=-1, keepdim=True).masked_fill_(empty, 1.0)  # >= 1 on non-empty rows
    out = torch.matmul(weights, value).mul_(row_sum.reciprocal())  # [*, G*R, D]; exactly 0 on empty rows
    lse = (row_sum.log_() + row_max).masked_fill_(empty, float("-inf")).squeeze(-1)  # [*, G*R]
    return out, lse


def _in_block_visibility(block_size: int, causal: bool, window: int | None, device) -> torch.Tensor:
    """``[W, W]`` bool, entry [q, k]: slot q sees slot k of its own block (the diagonal is always visible)."""
    slots = torch.arange(block_size, device=device)
    q, k = slots.view(-1, 1), slots.view(1, -1)
    visible = torch.ones(block_size, block_size, dtype=torch.bool, device=device)
    if causal:
        visible = visible & (k <= q)
    if window is not None:
        visible = visible & ((q - k).abs() < window)
    return visible


def _chunk_attention(
    query: torch.Tensor,
    context_key: torch.Tensor,
    context_value: torch.Tensor,
    block_key: torch.Tensor,
    block_value: torch.Tensor,
    anchors: torch.Tensor,
    starts: torch.Tensor,
    valid: torch.Tensor,
    key_offset: int,
    open_keys: tuple[int, int],
    scale: float,
    causal: bool,
    window: int | None,
):
    """Exact attention for a chunk of ``C`` blocks.

    query ``[B, C, W, Hq, D]``, context_key/value ``[B, S', Hkv, D]`` (the context keys at sequence indices
    ``key_offset .. key_offset + S' - 1``, a range that holds every key the chunk may see; ``open_keys`` is the
    sub-range every valid block of the chunk sees whole, see `_chunk_key_ranges`),
    block_key/value ``[B, C, W, Hkv, D]``, anchors/starts/valid ``[B, C]`` -> ``[B, C, W, Hq, D]`` in
    query's dtype, and the log-sum-exp of every row over all the keys it sees, ``[B, C, W, Hq]`` in the
    compute dtype (finite: a slot always sees itself).
    """
    B, C, W, Hq, D = query.shape
    S, Hkv = context_key.shape[1], context_key.shape[2]
    G = Hq // Hkv
    device = query.device
    dtype = _compute_dtype(query.dtype)
    # GQA without repeating K/V: query heads are split as [Hkv, G] (head h -> KV head h // G) and the G heads
    # of a KV head are stacked as rows of one matmul. Scaling the small queries saves a pass over the scores.
    q = (query.to(dtype) * scale).view(B, C, W, Hkv, G, D)

    # In-block part: [W, W] per block. Never empty (a slot always sees itself), so its lse is finite.
    qb = _to_block_rows(q)
    kb = block_key.to(dtype).transpose(2, 3)  # [B, C, Hkv, W, D]
    vb = block_value.to(dtype).transpose(2, 3)
    in_block = _in_block_visibility(W, causal, window, device)  # broadcasts to [B, C, Hkv, G, 1, W, W]
    out_b, lse_b = _grouped_masked_attention(qb, kb, vb, [(0, W, in_block)], G, W)
    out_b = out_b.view(B, C, Hkv, G, W, D).permute(0, 1, 4, 2, 3, 5)  # [B, C, W, Hkv, G, D]
    lse_b = lse_b.view(B, C, Hkv, G, W).permute(0, 1, 4, 2, 3)  # [B, C, W, Hkv, G]

    # Context part: the chunk's queries against its range of context keys, in key tiles (cache-sized score
    # tiles run the matmuls and the passes over the scores faster). The mask is built per tile, without heads,
    # and only outside the keys every block sees.
    outs, lses = [out_b], [lse_b]
    qc = _to_context_rows(q)
    for start, stop in _key_tiles(S, device):
        kc = context_key[:, start:stop].to(dtype).transpose(1, 2).contiguous()  # [B, Hkv, K, D]
        vc = context_value[:, start:stop].to(dtype).transpose(1, 2).contiguous()
        bands = _context_bands(anchors, starts, valid, key_offset + start, stop - start, open_keys, W, window)
        out_c, lse_c = _grouped_masked_attention(qc, kc, vc, bands, G, W)
        outs.append(out_c.view(B, Hkv, G, C, W, D).permute(0, 3, 4, 1, 2, 5))  # [B, C, W, Hkv, G, D]
        lses.append(lse_c.view(B, Hkv, G, C, W).permute(0, 3, 4, 1, 2))  # [B, C, W, Hkv, G]

    # Exact merge of the partial softmaxes through their log-sum-exp. The in-block part's lse is finite, so
    # the total is finite and a part without visible keys (lse = -inf) gets weight exp(-inf) = 0.
    if len(outs) == 1:
        out, lse = out_b, lse_b
    else:
        lse = torch.logsumexp(torch.stack(lses), dim=0)
        out = sum(torch.exp(part_lse - lse).unsqueeze(-1) * part for part, part_lse in zip(outs, lses))

    out = out * valid.view(B, C, 1, 1, 1, 1).to(out.dtype)
    out = out.reshape(B, C, W, Hq, D).to(query.dtype)
    return out, lse.reshape(B, C, W, Hq)


def _key_tiles(num_keys: int, device: torch.device) -> list[tuple[int, int]]:
    """``[start, stop)`` tiles of a chunk's context keys (about `_KEY_TILE_CPU` keys each on CPU; one tile on
    accelerators, whose kernels prefer fewer, larger matmuls). Forward and backward tile alike."""
    if num_keys == 0:
        return []
    tiles = 1 if device.type != "cpu" else -(-num_keys // _KEY_TILE_CPU)
    bounds = [round(i * num_keys / tiles) for i in range(tiles + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def _to_block_rows(x: torch.Tensor) -> torch.Tensor:
    """``[B, C, W, Hkv, G, *]`` -> ``[B, C, Hkv, G * W, *]``: the rows of the in-block matmuls."""
    B, C, W, Hkv, G = x.shape[:5]
    return x.permute(0, 1, 3, 4, 2, *range(5, x.dim())).reshape(B, C, Hkv, G * W, *x.shape[5:])


def _from_block_rows(x: torch.Tensor, W: int, G: int) -> torch.Tensor:
    """Inverse of `_to_block_rows`."""
    B, C, Hkv = x.shape[:3]
    return x.view(B, C, Hkv, G, W, *x.shape[4:]).permute(0, 1, 4, 2, 3, *range(5, x.dim() + 1))


def _to_context_rows(x: torch.Tensor) -> torch.Tensor:
    """``[B, C, W, Hkv, G, *]`` -> ``[B, Hkv, G * C * W, *]``: the rows of the context matmuls."""
    B, C, W, Hkv, G = x.shape[:5]
    return x.permute(0, 3, 4, 1, 2, *range(5, x.dim())).reshape(B, Hkv, G * C * W, *x.shape[5:])


def _from_context_rows(x: torch.Tensor, C: int, W: int, G: int) -> torch.Tensor:
    """Inverse of `_to_context_rows`."""
    B, Hkv = x.shape[:2]
    return x.view(B, Hkv, G, C, W, *x.shape[3:]).permute(0, 3, 4, 1, 2, *range(5, x.dim() + 2))


def _context_visibility(anchors, starts, valid, key_offset: int, S: int, W: int, window) -> torch.Tensor:
    """``[B, 1, 1, C, W | 1, S']`` bool (broadcasts to ``[B, Hkv, G, C, W, S']``): slot ``(c, w)`` sees context
    key ``key_offset + j``. Built per chunk, without heads; without a sliding window the rule does not depend on
    the slot, so the mask has one row per block (repeating it ``W`` times cost a score-sized copy per chunk)."""
    B, C = anchors.shape
    device = anchors.device
    positions = torch.arange(key_offset, key_offset + S, device=device)
    anchor = anchors.view(B, C, 1, 1)
    lowest = starts.view(B, C, 1, 1)
    if window is not None:
        # (anchor + slot) - j < window  <=>  j >= anchor + slot - window + 1
        slot = torch.arange(W, device=device).view(1, 1, W, 1)
        lowest = torch.maximum(lowest, anchor + slot - (window - 1))
    visible = (positions >= lowest) & (positions < anchor) & valid.view(B, C, 1, 1)  # [B, C, W|1, S]
    return visible.view(B, 1, 1, C, visible.shape[2], S)


def _context_bands(anchors, starts, valid, key_offset: int, S: int, open_keys: tuple[int, int], W: int, window):
    """The context mask of a chunk as column bands (`_mask_scores_`): keys ``open_keys = [a, b)`` are seen by
    every valid block of the chunk and need no mask; the keys before and after them get
    `_context_visibility`. With sorted anchors the open range is most of the chunk's keys."""
    a, b = open_keys
    a, b = max(a, key_offset), min(b, key_offset + S)
    if a >= b:
        return [(0, S, _context_visibility(anchors, starts, valid, key_offset, S, W, window))]
    bands = []
    if a > key_offset:
        bands.append((0, a - key_offset, _context_visibility(anchors, starts, valid, key_offset, a - key_offset, W,
                                                             window)))
    if b < key_offset + S:
        bands.append((b - key_offset, S, _context_visibility(anchors, starts, valid, b, key_offset + S - b, W,
                                                             window)))
    return bands


def _part_backward(q, k, v, bands, groups: int, slots: int, lse, delta, grad_out):
    """Flash-attention backward of one part (context or in-block) of a softmax whose full log-sum-exp is known.

    ``q [*, G*R, D]`` (scaled), ``k, v [*, K, D]``, ``bands`` as in `_grouped_masked_attention`, ``lse`` and
    ``delta = rowsum(dO * O)`` ``[*, G*R, 1]`` over **all** the row's keys, ``grad_out [*, G*R, D]`` ->
    ``(dq, dk, dv)``. With the full ``lse`` the probabilities ``P = exp(S - lse)`` of this part are exact
    without its partner part, so each part's scores are recomputed once and nothing else is.
    """
    probs = torch.matmul(q, k.transpose(-1, -2))  # [*, G*R, K]
    _mask_scores_(probs, bands, groups, slots)
    probs.sub_(lse).exp_()
    grad_value = torch.matmul(probs.transpose(-1, -2), grad_out)
    grad_scores = torch.matmul(grad_out, v.transpose(-1, -2)).sub_(delta).mul_(probs)  # dS = P * (dP - delta)
    del probs
    grad_query = torch.matmul(grad_scores, k)
    grad_key = torch.matmul(grad_scores.transpose(-1, -2), q)
    return grad_query, grad_key, grad_value


class _ChunkedBlockAttention(torch.autograd.Function):
    """The chunked kernel with a flash-attention backward.

    Forward runs `_chunk_attention` chunk by chunk and keeps only the output and the log-sum-exp of every row
    (``[B, N, W, Hq, D]`` and ``[B, N, W, Hq]``). Backward walks the chunks again and recomputes only the
    scores of each part (no second ``P V`` product, no re-merge); the context key/value gradients of all
    chunks accumulate into one ``[B, S, Hkv, D]`` buffer.
    """

    @staticmethod
    def forward(ctx, query, context_key, context_value, block_key, block_value, anchors, starts, valid,
                key_ranges, chunk_blocks, scale, causal, window):
        outs, lses = [], []
        for index, (lo, hi, *open_keys) in enumerate(key_ranges):
            blocks = slice(index * chunk_blocks, (index + 1) * chunk_blocks)
            out, lse = _chunk_attention(
                query[:, blocks], context_key[:, lo:hi], context_value[:, lo:hi], block_key[:, blocks],
                block_value[:, blocks], anchors[:, blocks], starts[:, blocks], valid[:, blocks], lo,
                tuple(open_keys), scale, causal, window,
            )
            outs.append(out)
            lses.append(lse)
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        lse = lses[0] if len(lses) == 1 else torch.cat(lses, dim=1)
        ctx.save_for_backward(query, context_key, context_value, block_key, block_value, anchors, starts, valid,
                              out, lse)
        ctx.settings = (key_ranges, chunk_blocks, scale, causal, window)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, context_key, context_value, block_key, block_value, anchors, starts, valid, out, lse = ctx.saved_tensors
        key_ranges, chunk_blocks, scale, causal, window = ctx.settings
        B, N, W, Hq, D = query.shape
        Hkv = block_key.shape[3]
        G = Hq // Hkv
        dtype = _compute_dtype(query.dtype)
        device = query.device
        in_block = _in_block_visibility(W, causal, window, device)
        grad_query = torch.empty(B, N, W, Hq, D, dtype=dtype, device=device)
        grad_block_key = torch.empty(B, N, W, Hkv, D, dtype=dtype, device=device)
        grad_block_value = torch.empty_like(grad_block_key)
        grad_context_key = torch.zeros(context_key.shape, dtype=dtype, device=device)  # the one accumulator
        grad_context_value = torch.zeros_like(grad_context_key)
        for index, (lo, hi, *open_keys) in enumerate(key_ranges):
            blocks = slice(index * chunk_blocks, (index + 1) * chunk_blocks)
            C = query[:, blocks].shape[1]
            shape6 = (B, C, W, Hkv, G, D)
            q = (query[:, blocks].to(dtype) * scale).view(shape6)
            # Invalid blocks output exactly zero: they pass no gradient.
            d_out = (grad_out[:, blocks].to(dtype) * valid[:, blocks].view(B, C, 1, 1, 1).to(dtype)).view(shape6)
            delta = (d_out * out[:, blocks].to(dtype).view(shape6)).sum(dim=-1, keepdim=True)  # [B, C, W, Hkv, G, 1]
            row_lse = lse[:, blocks].reshape(B, C, W, Hkv, G, 1)

            kb = block_key[:, blocks].to(dtype).transpose(2, 3)  # [B, C, Hkv, W, D]
            vb = block_value[:, blocks].to(dtype).transpose(2, 3)
            dq, dk, dv = _part_backward(_to_block_rows(q), kb, vb, [(0, W, in_block)], G, W, _to_block_rows(row_lse),
                                        _to_block_rows(delta), _to_block_rows(d_out))
            grad_query[:, blocks] = _from_block_rows(dq, W, G).reshape(B, C, W, Hq, D)
            grad_block_key[:, blocks] = dk.transpose(2, 3)
            grad_block_value[:, blocks] = dv.transpose(2, 3)

            if hi > lo:
                qc, lse_c, delta_c = _to_context_rows(q), _to_context_rows(row_lse), _to_context_rows(delta)
                d_out_c = _to_context_rows(d_out)
                dq_c = None
                for start, stop in _key_tiles(hi - lo, device):
                    keys = slice(lo + start, lo + stop)
                    kc = context_key[:, keys].to(dtype).transpose(1, 2).contiguous()  # [B, Hkv, K, D]
                    vc = context_value[:, keys].to(dtype).transpose(1, 2).contiguous()
                    bands = _context_bands(anchors[:, blocks], starts[:, blocks], valid[:, blocks], lo + start,
                                           stop - start, tuple(open_keys), W, window)
                    dq, dk, dv = _part_backward(qc, kc, vc, bands, G, W, lse_c, delta_c, d_out_c)
                    dq_c = dq if dq_c is None else dq_c.add_(dq)
                    grad_context_key[:, keys] += dk.transpose(1, 2)
                    grad_context_value[:, keys] += dv.transpose(1, 2)
                grad_query[:, blocks] += _from_context_rows(dq_c, C, W, G).reshape(B, C, W, Hq, D)
        grad_query.mul_(scale)  # the scores used the scaled queries
        return (grad_query.to(query.dtype), grad_context_key.to(context_key.dtype),
                grad_context_value.to(context_value.dtype), grad_block_key.to(block_key.dtype),
                grad_block_value.to(block_value.dtype)) + (None,) * 8


def _default_chunk_blocks(
    batch: int, heads: int, block_size: int, seq_length: int, num_blocks: int, device: torch.device
) -> int:
    """Blocks per chunk so that one chunk's fp32 score tile is about 4 MiB (CPU) / 128 MiB (accelerators)."""
    cpu = device.type == "cpu"
    budget = _CHUNK_SCORE_BYTES_CPU if cpu else _CHUNK_SCORE_BYTES_ACCELERATOR
    keys = min(seq_length, _KEY_TILE_CPU) if cpu else seq_length
    bytes_per_block = 4 * batch * heads * block_size * max(keys, 1)
    return max(1, min(num_blocks, budget // bytes_per_block))


def _chunk_key_ranges(
    visibility: BlockVisibility, seq_length: int, block_size: int, chunk_blocks: int
) -> list[tuple[int, int, int, int]]:
    """``(lo, hi, open_lo, open_hi)`` per chunk of blocks.

    ``[lo, hi)``: the context keys any valid block of the chunk (in any row) may see. Keys outside it are masked
    for every query of the chunk, so cropping to it is exact; with sorted anchors and sliding windows it removes
    most of the work. ``[open_lo, open_hi)`` (possibly empty): the keys that every slot of every valid block of
    the chunk sees; they need no mask, so the mask is applied only to the thin bands around them (with sorted
    anchors, the spread of the chunk's anchors). Invalid blocks are left out of both: their output is zero and
    they pass no gradient whatever they attend to.

    Costs one host sync per call (per layer and step; backward reuses the forward's ranges): reading a
    ``[chunks, 4]`` tensor. The chunked kernel is the CPU path, where that read is free; on CUDA
    ``backend="auto"`` runs FlexAttention, which has no sync.
    """
    anchors = visibility.anchor_positions.clamp(0, seq_length)
    lowest = visibility.context_start
    # The last slot of a block reaches least far back: with a sliding window it sees keys from
    # anchor + (W - 1) - window + 1 on, slot 0 from anchor - window + 1 on.
    lowest_all_slots = lowest
    if visibility.sliding_window is not None:
        lowest = torch.maximum(lowest, anchors - (visibility.sliding_window - 1))
        lowest_all_slots = torch.maximum(lowest_all_slots, anchors + block_size - visibility.sliding_window)
    lowest = lowest.clamp(0, seq_length)
    sees = visibility.block_valid & (lowest < anchors)
    valid = visibility.block_valid
    B, N = anchors.shape
    pad = (-N) % chunk_blocks

    def per_chunk(values, where, fill, reduce):
        padded = torch.nn.functional.pad(torch.where(where, values, fill), (0, pad), value=fill)
        return reduce(padded.view(B, -1, chunk_blocks), dim=(0, 2))

    lo = per_chunk(lowest, sees, seq_length, torch.amin)
    hi = per_chunk(anchors, sees, 0, torch.amax)
    open_lo = per_chunk(lowest_all_slots.clamp(0, seq_length), valid, 0, torch.amax)
    open_hi = per_chunk(anchors, valid, seq_length, torch.amin)
    ranges = []
    for low, high, open_low, open_high in torch.stack([lo, hi, open_lo, open_hi], dim=1).tolist():
        high = max(low, high)
        ranges.append((low, high, max(low, open_low), min(high, max(open_low, open_high))))
    return ranges


def _chunked_attention(
    query, context_key, context_value, block_key, block_value, visibility, scale, chunk_blocks
):
    B, N, W, Hq, _ = query.shape
    S = context_key.shape[1]
    if chunk_blocks is None:
        chunk_blocks = _default_chunk_blocks(B, Hq, W, S, N, query.device)
    if N == 0:
        return query.new_zeros(query.shape)
    key_ranges = _chunk_key_ranges(visibility, S, W, chunk_blocks)
    return _ChunkedBlockAttention.apply(
        query, context_key, context_value, block_key, block_value, visibility.anchor_positions,
        visibility.context_start, visibility.block_valid, key_ranges, chunk_blocks, scale, visibility.causal,
        visibility.sliding_window,
    )


# ---------------------------------------------------------------------------------------------------------
# FlexAttention
# ---------------------------------------------------------------------------------------------------------


def _flex_available() -> bool:
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def _compiled_flex_attention() -> Callable:
    """flex_attention compiled once per process (eager flex materialises the full score matrix)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _flex_attention(query, context_key, context_value, block_key, block_value, visibility, scale):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    B, N, W, Hq, D = query.shape
    S, Hkv = context_key.shape[1], context_key.shape[2]
    q = query.reshape(B, N * W, Hq, D).transpose(1, 2)  # [B, Hq, N*W, D]
    k = torch.cat([context_key, block_key.reshape(B, N * W, Hkv, D)], dim=1).transpose(1, 2)
    v = torch.cat([context_value, block_value.reshape(B, N * W, Hkv, D)], dim=1).transpose(1, 2)
    if not torch.is_grad_enabled():
        # Nothing to differentiate; flex refuses inputs that require grad on devices without a flex backward
        # (CPU) even under no_grad.
        q, k, v = q.detach(), k.detach(), v.detach()
    elif not query.is_cuda and any(t.requires_grad for t in (q, k, v)):
        raise ValueError(
            f"backend='flex' has no backward on {query.device.type}; "
            "use backend='chunked' for training there."
        )
    compiled = query.is_cuda
    block_mask = create_block_mask(
        _flat_mask_mod(visibility, S, W),
        B,
        None,
        N * W,
        S + N * W,
        device=query.device,
        _compile=compiled,
    )
    attend = _compiled_flex_attention() if compiled else flex_attention
    with warnings.catch_warnings():
        # Off CUDA we run flex eagerly on purpose (unfused reference kernel); do not warn about it.
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        out = attend(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=Hq != Hkv)
    out = out.transpose(1, 2).reshape(B, N, W, Hq, D)
    return out * visibility.block_valid.view(B, N, 1, 1, 1).to(out.dtype)


# ---------------------------------------------------------------------------------------------------------
# Public entry point
# ---------------------------------------------------------------------------------------------------------


def block_attention(
    query: torch.Tensor,
    context_key: torch.Tensor,
    context_value: torch.Tensor,
    block_key: torch.Tensor,
    block_value: torch.Tensor,
    visibility: BlockVisibility,
    *,
    scale: float,
    backend: str = "auto",
    chunk_blocks: int | None = None,
) -> torch.Tensor:
    """Attention of every draft slot over its visible context and its own block.

    Args:
        query: ``[B, N, W, Hq, D]``.
        context_key, context_value: ``[B, S, Hkv, D]``.
        block_key, block_value: ``[B, N, W, Hkv, D]``.
        visibility: what each block sees (see :class:`BlockVisibility`).
        scale: softmax scale (usually ``D ** -0.5``).
        backend: ``"dense"`` (reference with the dense mask), ``"chunked"`` (exact, bounded memory),
            ``"flex"`` (FlexAttention) or ``"auto"`` (flex on CUDA when available, else chunked).
        chunk_blocks: blocks per chunk for ``"chunked"``; the default sizes one chunk's fp32 score tensor to
            about 4 MiB per key tile of 1024 keys on CPU and 128 MiB on accelerators (peak memory is about 2-3
            times that).

    Returns:
        ``[B, N, W, Hq, D]`` in the dtype of ``query``; exactly zero for invalid blocks and never NaN
        (also for blocks with an empty context and rows without a valid block). Scores and softmax run in
        fp32 (fp64 for fp64 inputs) for the dense and chunked backends.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}.")
    if chunk_blocks is not None and (
        isinstance(chunk_blocks, bool) or not isinstance(chunk_blocks, int) or chunk_blocks < 1
    ):
        raise ValueError(f"chunk_blocks must be None or a positive int, got {chunk_blocks!r}.")
    if not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number, got {scale!r}.")
    _check_inputs(query, context_key, context_value, block_key, block_value, visibility)

    if backend == "auto":
        backend = "flex" if query.is_cuda and _flex_available() else "chunked"
    args = (query, context_key, context_value, block_key, block_value, visibility, float(scale))
    if backend == "dense":
        return _dense_attention(*args)
    if backend == "flex":
        if not _flex_available():
            raise RuntimeError(
                "backend='flex' needs torch.nn.attention.flex_attention (torch >= 2.5); "
                "use backend='chunked'."
            )
        return _flex_attention(*args)
    return _chunked_attention(*args, chunk_blocks)
